"""The adapter that runs the CPU-tensor LL suite on the CUDA backend (tests/support/gpu_ll_adapter.py), here with a
stand-in Buffer whose receive adds each call's counts to the stats tensor it was given and with CPU clones standing in
for GPU copies: two hooked dispatches sent before either receives both reach the caller's stats, as they reach the
one GPU tensor a DeepEP user passes (the GPU suite's two-batch overlap step lost one before)."""

import types

import pytest
import torch

from gpu_ll_adapter import CudaLLAdapter


class _Buffer:
    runtime = types.SimpleNamespace(check_error=lambda: None)

    def __init__(self, counts):
        self.counts = counts

    def low_latency_dispatch(self, x, idx, T, E, cumulative_local_expert_recv_stats=None, return_recv_hook=False, **kw):
        stats, counts = cumulative_local_expert_recv_stats, self.counts.pop(0)

        def receive():
            if stats is not None:
                stats.add_(counts)

        handle = (torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, 4, dtype=torch.int64), T, 8, E)
        out = (torch.randn(2, 3, 8), torch.zeros(2, dtype=torch.int32), handle, None)
        if return_recv_hook:
            return out + (receive,)
        receive()
        return out + (None,)


@pytest.fixture
def adapter(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self: self.clone())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: types.SimpleNamespace(synchronize=lambda: None))
    counts = [torch.tensor([5, 7], dtype=torch.int32) * (i + 1) for i in range(5)]
    return CudaLLAdapter(_Buffer(list(counts))), counts


def _dispatch(a, stats, hook):
    return a.low_latency_dispatch(
        torch.zeros(2, 8), torch.zeros(2, 1), 4, 2, cumulative_local_expert_recv_stats=stats, return_recv_hook=hook
    )


def test_two_calls_in_flight_both_add_to_the_callers_stats(adapter):
    a, counts = adapter
    stats = torch.tensor([100, 200], dtype=torch.int32)
    _dispatch(a, stats, False)
    first, second = _dispatch(a, stats, True), _dispatch(a, stats, True)
    first[4]()
    assert stats.tolist() == (torch.tensor([100, 200]) + counts[0] + counts[1]).tolist()
    second[4]()
    want = torch.tensor([100, 200]) + counts[0] + counts[1] + counts[2]
    assert stats.tolist() == want.tolist()
    stats.add_(1)  # the caller's own change between calls is kept: no call holds a copy now
    _dispatch(a, stats, True)[4]()
    assert stats.tolist() == (want + 1 + counts[3]).tolist()


def test_a_refused_call_leaves_the_stats_and_holds_no_copy(adapter):
    a, counts = adapter
    stats = torch.tensor([1, 2], dtype=torch.int32)
    real = a.buf.low_latency_dispatch
    a.buf.low_latency_dispatch = lambda *args, **kw: (_ for _ in ()).throw(ValueError("refused"))
    with pytest.raises(ValueError, match="refused"):
        _dispatch(a, stats, True)
    assert stats.tolist() == [1, 2]
    a.buf.low_latency_dispatch = real
    stats.add_(10)  # a copy held by the refused call would lose this
    _dispatch(a, stats, True)[4]()
    assert stats.tolist() == (torch.tensor([11, 12]) + counts[0]).tolist()


def test_a_failed_hook_leaves_the_stats_and_holds_no_copy(adapter):
    a, counts = adapter
    stats = torch.tensor([3, 4], dtype=torch.int32)
    res = _dispatch(a, stats, True)
    a.buf.runtime = types.SimpleNamespace(check_error=lambda: (_ for _ in ()).throw(RuntimeError("kernel failed")))
    with pytest.raises(RuntimeError, match="kernel failed"):
        res[4]()
    assert stats.tolist() == [3, 4]  # a failed call's counts are not copied back
    a.buf.runtime = _Buffer.runtime
    stats.add_(10)
    _dispatch(a, stats, True)[4]()
    assert stats.tolist() == (torch.tensor([13, 14]) + counts[1]).tolist()
