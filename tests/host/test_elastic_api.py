"""ElasticBuffer's surface: deep_ep's V2 exports, V2's signatures and defaults, EventOverlap's V2 additions,
EventHandle, the experimental methods' refusals, and the argument checks with their refusals across ranks."""

import inspect

import pytest

import deep_ep
import elastic_workers as w
import portep
from deepep_workers import assert_clean
from dist_util import run_ranks
from portep.errors import NoEventError

V2_INIT = [
    ("group", inspect.Parameter.empty),
    ("num_bytes", None),
    ("num_cpu_bytes", 0),
    ("num_max_tokens_per_rank", 0),
    ("hidden", 0),
    ("num_topk", 0),
    ("use_fp8_dispatch", False),
    ("deterministic", False),
    ("allow_hybrid_mode", True),
    ("allow_multiple_reduction", True),
    ("prefer_overlap_with_compute", True),
    ("sl_idx", 3),
    ("num_allocated_qps", 0),
    ("num_cpu_timeout_secs", 300),
    ("num_gpu_timeout_secs", 100),
    ("explicitly_destroy", False),
]
V2_DISPATCH = [
    ("x", inspect.Parameter.empty),
    ("topk_idx", None),
    ("topk_weights", None),
    ("cumulative_local_expert_recv_stats", None),
    ("num_experts", None),
    ("num_max_tokens_per_rank", None),
    ("expert_alignment", None),
    ("num_sms", 0),
    ("num_qps", 0),
    ("previous_event", None),
    ("previous_event_before_epilogue", None),
    ("async_with_compute_stream", False),
    ("allocate_on_comm_stream", False),
    ("handle", None),
    ("do_handle_copy", True),
    ("do_cpu_sync", None),
    ("do_expand", False),
    ("do_zero_padding", False),
    ("use_tma_aligned_col_major_sf", False),
]
V2_COMBINE = [
    ("x", inspect.Parameter.empty),
    ("handle", inspect.Parameter.empty),
    ("topk_weights", None),
    ("bias", None),
    ("num_sms", 0),
    ("num_qps", 0),
    ("previous_event", None),
    ("previous_event_before_epilogue", None),
    ("async_with_compute_stream", False),
    ("allocate_on_comm_stream", False),
]


def _positional(fn):
    params = list(inspect.signature(fn).parameters.values())[1:]
    return [(p.name, p.default) for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]


def test_deep_ep_exports_v2_beside_v1():
    for name in (
        "Buffer",
        "ElasticBuffer",
        "EPHandle",
        "EventOverlap",
        "EventHandle",
        "Config",
        "topk_idx_t",
        "get_physical_domain_size",
        "get_logical_domain_size",
        "__version__",
    ):
        assert hasattr(deep_ep, name), name
    assert deep_ep.ElasticBuffer is portep.ElasticBuffer and deep_ep.Buffer is portep.Buffer
    assert deep_ep.__version__.startswith("2.")


@pytest.mark.parametrize(
    "method,expected",
    [("__init__", V2_INIT), ("dispatch", V2_DISPATCH), ("combine", V2_COMBINE)],
)
def test_signatures_are_v2s(method, expected):
    assert _positional(getattr(portep.ElasticBuffer, method)) == expected


def test_event_overlap_v2_additions():
    class Recorded:
        waits = 0

        def current_stream_wait(self):
            Recorded.waits += 1

    calls = []
    ev = portep.EventOverlap(Recorded())
    ev.register_hook_after_wait(lambda: calls.append("hook"))
    with pytest.raises(ValueError, match="already registered"):
        ev.register_hook_after_wait(lambda: None)
    ev.current_stream_wait()
    ev.current_stream_wait()
    assert calls == ["hook"] and Recorded.waits == 2
    with ev(release_handle=True):
        pass
    assert ev.event is None and Recorded.waits == 3
    with pytest.raises(AssertionError, match="needs an event"):
        ev.current_stream_wait()
    with pytest.raises(RuntimeError):  # V1's kind too
        portep.EventOverlap(None).current_stream_wait()
    assert issubclass(NoEventError, AssertionError) and issubclass(NoEventError, RuntimeError)
    with portep.EventOverlap(None):
        pass


def test_event_handle_without_cuda_is_complete():
    e = deep_ep.EventHandle()
    e.current_stream_wait()
    assert e.query() and repr(e)
    assert isinstance(portep.ElasticBuffer.capture(), deep_ep.EventHandle)


@pytest.mark.parametrize(
    "name",
    [
        "engram_write",
        "engram_fetch",
        "pp_set_config",
        "pp_send",
        "pp_recv",
        "agrs_set_config",
        "create_agrs_session",
        "destroy_agrs_session",
        "agrs_new_session",
        "agrs_get_inplace_tensor",
        "all_gather",
    ],
)
def test_experimental_methods_say_they_are_not_implemented(name):
    buf = object.__new__(portep.ElasticBuffer)
    with pytest.raises(NotImplementedError, match=f"ElasticBuffer.{name}: .* not implemented by portep"):
        getattr(buf, name)()


def test_num_cpu_bytes_is_refused():
    with pytest.raises(NotImplementedError, match="num_cpu_bytes=4096"):
        portep.ElasticBuffer(None, num_bytes=1 << 21, num_cpu_bytes=4096)


def test_size_is_required():
    with pytest.raises(ValueError, match="needs num_bytes, or num_max_tokens_per_rank > 0 and hidden > 0"):
        portep.ElasticBuffer(None)


@pytest.mark.parametrize("transport", ["shm", "shm-unordered"])
def test_argument_checks_and_a_one_rank_refusal(transport):
    out = run_ranks(w.refusal_body, 2, args=(transport,), timeout=240)
    assert_clean(out, 15)


@pytest.mark.parametrize("world,rpn", [(2, 2), (4, 2)], ids=["one-node", "2x2"])
def test_get_buffer_size_hint_covers_a_full_dispatch_and_combine(world, rpn):
    out = run_ranks(w.size_hint_body, world, args=(rpn,), timeout=240)
    assert_clean(out, 4)


def test_default_dtype_bfloat16_changes_nothing():
    out = run_ranks(w.default_dtype_body, 2, timeout=240)
    assert_clean(out, 5)


def test_default_device_changes_nothing():
    out = run_ranks(w.default_device_body, 2, timeout=240)
    assert_clean(out, 20)
