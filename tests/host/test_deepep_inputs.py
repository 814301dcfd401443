"""Bad inputs to portep.Buffer's DeepEP V1 methods: each raises ValueError or TypeError naming the argument, nothing
hangs, and the Buffer still works afterwards (checked good calls
before and after). A buffer too small for a dispatch is refused with a ValueError that mentions bytes.
"""

import pytest

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
