"""Bad inputs to portep.Buffer's DeepEP V1 methods: each raises ValueError or TypeError naming the argument, nothing
hangs, and the Buffer still works afterwards (checked good calls
before and after). A buffer too small for a dispatch is refused with a ValueError that mentions bytes.
"""

import pytest
import torch

import deepep_workers as w
from dist_util import run_ranks


def _assert_records(out):
    problems = []
    for rank in sorted(out):
        for rec in out[rank]["records"]:
            if rec["raised"] is None:
                problems.append(
                    f"rank {rank} {rec['case']}: no error raised (expected {'/'.join(rec['allowed'])} "
                    f"naming {' or '.join(rec['names'])})"
                )
            elif not rec["type_ok"]:
                problems.append(
                    f"rank {rank} {rec['case']}: raised {rec['raised']}, expected "
                    f"{'/'.join(rec['allowed'])}: {rec['message']}"
                )
            elif not any(name in rec["message"] for name in rec["names"]):
                problems.append(
                    f"rank {rank} {rec['case']}: {rec['raised']} does not name "
                    f"{' or '.join(rec['names'])}: {rec['message']}"
                )
    failures = [f for r in sorted(out) for f in out[r]["failures"]]
    assert not problems and not failures, "\n".join(problems + failures)


@pytest.mark.slow
@pytest.mark.parametrize("rpn", [1, 2])
def test_bad_ht_inputs_are_refused_and_the_buffer_stays_usable(rpn):
    out = run_ranks(w.bad_inputs_ht, 2, args=(rpn, "shm"), timeout=180)
    _assert_records(out)


@pytest.mark.slow
def test_bad_ll_inputs_are_refused_and_the_buffer_stays_usable():
    out = run_ranks(w.bad_inputs_ll, 2, args=(1, "shm-unordered"), timeout=180)
    _assert_records(out)


@pytest.mark.slow
def test_buffer_too_small_is_refused_with_bytes_in_the_message():
    out = run_ranks(w.buffer_too_small, 2, args=("shm",), timeout=180)
    _assert_records(out)


def test_checked_calls_cache_keys():
    """The LL validation cache: tensor metadata and (type, value) ints make the key, unhashable or non-tensor
    arguments are never cached, and the set stays bounded."""
    import portep.validation as v

    g = torch.Generator().manual_seed(5)
    a = torch.randn(4, 8, generator=g)
    same = torch.randn(4, 8, generator=g)
    key = v.call_key("dispatch", v.tensor_key(a), int, 4)
    assert key == v.call_key("dispatch", v.tensor_key(same), int, 4)  # values are not part of the key
    assert key != v.call_key("dispatch", v.tensor_key(a.t()), int, 4)  # layout is
    assert key != v.call_key("dispatch", v.tensor_key(a.double()), int, 4)  # dtype is
    assert key != v.call_key("dispatch", v.tensor_key(a), float, 4.0)  # 4.0 never matches 4
    assert v.call_key("dispatch", v.tensor_key([1, 2])) is None  # not a tensor: always validated in full
    cache = v.CheckedCalls(limit=3)
    assert not cache.seen(key) and not cache.seen(None)
    cache.add(key)
    assert cache.seen(key)
    unhashable = ("combine", [1, 2])
    cache.add(unhashable)
    assert not cache.seen(unhashable)
    for i in range(3):
        cache.add(("other", i))
    assert not cache.seen(key)  # the limit cleared the set before it grew past 3
