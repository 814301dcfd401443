"""The CUDA kernels' bindings read the tensors Python hands them, on a machine without a GPU: stand-ins that look
like CUDA tensors (device cuda:0, contiguous, dtype, entries; host memory behind them) get through every argument
check to the launch, which the CUDA runtime then refuses (no device here); a CPU tensor or a wrong size is refused
by name before that. This catches a binding that misreads an argument, which otherwise shows only on a GPU."""

import types

import pytest
import torch

from portep import native

pytestmark = pytest.mark.skipif(
    not native.build_info()["gpu_built"] or torch.cuda.is_available(),
    reason="needs portep's GPU kernels compiled in, and no GPU (the stand-ins' host memory must never be launched on)",
)


class CudaStandIn:
    """A CPU tensor presenting itself as one on cuda:0 (only what the bindings read)."""

    is_cuda, is_cpu = True, False

    def __init__(self, t):
        self.t = t
        self.device = types.SimpleNamespace(type="cuda", index=0)
        self.dtype = t.dtype

    def get_device(self):
        return self.device.index

    def __str__(self):
        return f"CudaStandIn({self.t.dtype}, {tuple(self.t.shape)})"

    def is_contiguous(self):
        return self.t.is_contiguous()

    def numel(self):
        return self.t.numel()

    def data_ptr(self):
        return self.t.data_ptr()

    def element_size(self):
        return self.t.element_size()


def _on_gpu(t, index):
    """A stand-in on cuda:index (the first tensor a binding reads names the GPU the others must be on)."""
    stand_in = CudaStandIn(t)
    stand_in.device = types.SimpleNamespace(type="cuda", index=index)
    return stand_in


def _layout_args(N=16, K=4, E=32, R=4, L=2, on_gpu=True):
    wrap = CudaStandIn if on_gpu else (lambda t: t)
    return dict(
        topk_idx=wrap(torch.randint(-1, E, (N, K), generator=torch.Generator().manual_seed(3))),
        num_tokens=N,
        num_topk=K,
        num_experts=E,
        num_ranks=R,
        ranks_per_node=L,
        per_rank=CudaStandIn(torch.empty(R, dtype=torch.int32)),
        per_node=CudaStandIn(torch.empty(R // L, dtype=torch.int32)),
        per_expert=CudaStandIn(torch.empty(E, dtype=torch.int32)),
        is_token_in_rank=CudaStandIn(torch.empty(N, R, dtype=torch.bool)),
        stream=0,
        rank=0,
        failed=CudaStandIn(torch.zeros(native.KERNEL_ERROR_WORDS, dtype=torch.int32)),
        errors=_error_records(),
    )


def test_the_layout_binding_reads_every_tensor_and_reaches_the_launch():
    with pytest.raises(RuntimeError, match="cuda_dispatch_layout: "):
        native.cuda_dispatch_layout(**_layout_args())


def test_the_layout_binding_takes_no_per_node_counts_on_one_node():
    args = _layout_args(R=4, L=4)
    args["per_node"] = None
    with pytest.raises(RuntimeError, match="cuda_dispatch_layout: "):
        native.cuda_dispatch_layout(**args)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda a: a.update(topk_idx=a["topk_idx"].t), "topk_idx: a tensor on cuda is needed, got one on cpu"),
        (lambda a: a.update(per_expert=CudaStandIn(torch.empty(31, dtype=torch.int32))), "per_expert: 31 entries"),
        (lambda a: a.update(is_token_in_rank=CudaStandIn(torch.empty(16, 4))), "is_token_in_rank: dtype"),
        (lambda a: a.update(per_rank=_on_gpu(a["per_rank"].t, 1)), "per_rank: a tensor on cuda:0 is needed"),
    ],
    ids=["cpu-topk_idx", "short-per_expert", "float-is_token_in_rank", "per_rank-on-another-gpu"],
)
def test_the_layout_binding_refuses_a_wrong_tensor_by_name(change, message):
    args = _layout_args()
    change(args)
    with pytest.raises(ValueError, match=message):
        native.cuda_dispatch_layout(**args)


class ShapedStandIn(CudaStandIn):
    """A stand-in whose shape the binding reads too."""

    def __init__(self, t):
        super().__init__(t)
        self.shape = tuple(t.shape)


def _slot_sum_args(T=6, K=4, H=64, C=10):
    g = torch.Generator().manual_seed(5)
    return dict(
        rows=ShapedStandIn(torch.randn(C, H, generator=g).to(torch.bfloat16)),
        row_of_slot=ShapedStandIn(torch.randint(-1, C, (T, K), generator=g)),
        bias0=ShapedStandIn(torch.randn(T, H, generator=g).to(torch.bfloat16)),
        bias1=None,
        out=ShapedStandIn(torch.empty(T, H, dtype=torch.bfloat16)),
        stream=0,
    )


def test_the_slot_sum_binding_reads_every_tensor_and_reaches_the_launch():
    with pytest.raises(RuntimeError, match="slot sums: ") as refused:
        native.slot_sums(**_slot_sum_args())
    assert "invalid argument" not in str(refused.value)  # refused by the runtime (no GPU), not by the launcher's checks


@pytest.mark.parametrize(
    "change,message",
    [
        (
            lambda a: a.update(row_of_slot=a["row_of_slot"].t),
            "row_of_slot: a tensor on cuda:0 is needed, got one on cpu",
        ),
        (lambda a: a.update(bias0=ShapedStandIn(torch.zeros(5, 64, dtype=torch.bfloat16))), "bias0: 320 entries"),
        (lambda a: a.update(rows=ShapedStandIn(torch.zeros(10, 63, dtype=torch.bfloat16))), r"rows: shape \(10, 63\)"),
        (lambda a: a.update(rows=ShapedStandIn(torch.zeros(20, 32, dtype=torch.bfloat16))), r"rows: shape \(20, 32\)"),
        (lambda a: a.update(row_of_slot=ShapedStandIn(torch.zeros(6, 129, dtype=torch.int64))), "129 slots"),
        (lambda a: a.update(out=ShapedStandIn(torch.zeros(6, 64))), "out: dtype torch.float32"),
    ],
)
def test_the_slot_sum_binding_refuses_by_name(change, message):
    args = _slot_sum_args()
    change(args)
    with pytest.raises(ValueError, match=message):
        native.slot_sums(**args)


# ---- the normal-mode (HT) kernels: HTKernels of one node (no proxies: no FIFOs needed), its three calls ----
HT_R, HT_C, HT_N, HT_H, HT_K, HT_E, HT_S, HT_RECV = 2, 3, 12, 64, 4, 8, 2, 20
HT_REGION_BYTES = 1 << 21  # the stand-in region: past the control area's end


def _gpu(*shape, dtype=torch.int32):
    return CudaStandIn(torch.zeros(*shape, dtype=dtype))


def _error_records():
    """The kernels' error records in emulated mapped host memory (plain host memory; no kernel ever runs on it)."""
    return native.MappedHost(native.KERNEL_ERROR_WORDS * native.KERNEL_ERROR_BYTES, emulated=True)


def _ht_kernel_memory(R):
    """HTKernels' keywords for R ranks: stand-in tensors, and emulated mapped host memory."""
    return dict(
        rank=1,
        region=_gpu(HT_REGION_BYTES, dtype=torch.uint8),
        signals=_gpu(R * native.HT_NUM_STREAMS, dtype=torch.int64),
        peers=_gpu(R, dtype=torch.int64),
        place=_gpu(R, dtype=torch.int64),
        epoch=_gpu(native.HT_EPOCH_WORDS, dtype=torch.int64),
        host_counts=native.MappedHost(native.HT_HOST_COUNTS_BYTES, emulated=True),
        errors=_error_records(),
        failed=_gpu(native.KERNEL_ERROR_WORDS),
        signal_seen=_gpu(R * native.HT_NUM_STREAMS, dtype=torch.int64),
        num_streams=native.HT_NUM_STREAMS,
        stream_base=0,
        timeout_s=1.0,
    )


HT_CTRL_OFF, HT_AREA_BYTES = 1 << 20, 1 << 20  # the normal-mode area first, the control area after it


def _ht_layout(R, L):
    return native.HTLayout(
        num_ranks=R, ranks_per_node=L, proxy=L < R, ctrl_off=HT_CTRL_OFF, area_off=0, area_bytes=HT_AREA_BYTES
    )


def _ht_kernels():
    return native.HTKernels(_ht_layout(HT_R, HT_R), None, **_ht_kernel_memory(HT_R))


def _notify_args():
    return dict(
        channels=HT_C,
        stream=0,
        count_mode=True,
        is_token_in_rank=_gpu(HT_N, HT_R, dtype=torch.bool),
        tokens_per_expert=_gpu(HT_E),
        num_tokens=HT_N,
        num_experts=HT_E,
        recv_rank_prefix=_gpu(HT_R),
        rank_prefix=_gpu(HT_R, HT_R),
        channel_prefix=_gpu(HT_R, HT_C),
        recv_channel_prefix=_gpu(HT_R, HT_C),
    )


def _dispatch_args():
    return dict(
        channels=HT_C,
        stream=0,
        x=_gpu(HT_N, HT_H, dtype=torch.bfloat16),
        row_bytes=2 * HT_H,
        num_tokens=HT_N,
        is_token_in_rank=_gpu(HT_N, HT_R, dtype=torch.bool),
        rank_prefix_matrix=_gpu(HT_R, HT_R),
        channel_prefix=_gpu(HT_R, HT_C),
        recv_channel_prefix=_gpu(HT_R, HT_C),
        max_recv=HT_RECV,
        recv_x=_gpu(HT_RECV, HT_H, dtype=torch.bfloat16),
        scales=_gpu(HT_N, HT_S, dtype=torch.float32),
        num_scales=HT_S,
        recv_scales=_gpu(HT_RECV, HT_S, dtype=torch.float32),
        topk_idx=_gpu(HT_N, HT_K, dtype=torch.int64),
        topk_weights=_gpu(HT_N, HT_K, dtype=torch.float32),
        num_topk=HT_K,
        num_local_experts=HT_E // HT_R,
        recv_topk_idx=_gpu(HT_RECV, HT_K, dtype=torch.int64),
        recv_topk_weights=_gpu(HT_RECV, HT_K, dtype=torch.float32),
        recv_src_idx=_gpu(HT_RECV),
        send_head=_gpu(HT_N, HT_R),
    )


def _combine_args():
    return dict(
        channels=HT_C,
        stream=0,
        x=_gpu(HT_RECV, HT_H, dtype=torch.bfloat16),
        hidden=HT_H,
        num_tokens=HT_N,
        is_token_in_rank=_gpu(HT_N, HT_R, dtype=torch.bool),
        recv_prefix=_gpu(HT_R),
        recv_channel_prefix=_gpu(HT_R, HT_C),
        out=_gpu(HT_N, HT_H, dtype=torch.bfloat16),
        topk_weights=_gpu(HT_RECV, HT_K, dtype=torch.float32),
        num_topk=HT_K,
        out_weights=_gpu(HT_N, HT_K, dtype=torch.float32),
        bias0=_gpu(HT_N, HT_H, dtype=torch.bfloat16),
        bias1=_gpu(HT_N, HT_H, dtype=torch.bfloat16),
    )


HT_CALLS = {"notify": _notify_args, "dispatch": _dispatch_args, "combine": _combine_args}


@pytest.mark.parametrize("op", sorted(HT_CALLS))
def test_the_ht_bindings_read_every_tensor_and_reach_the_launch(op):
    with pytest.raises(RuntimeError, match=f"HT {op}: ") as refused:
        getattr(_ht_kernels(), op)(**HT_CALLS[op]())
    assert "invalid argument" not in str(refused.value)


def _empty_gpu(*shape, dtype):
    """A stand-in of no entries: its data_ptr is 0, as an empty CUDA tensor's is."""
    t = CudaStandIn(torch.zeros(*shape, dtype=dtype))
    t.data_ptr = lambda: 0
    return t


def test_a_rank_without_tokens_is_held_to_the_same_rules():
    """Whether an optional tensor was given is None or not, never its address (an empty tensor has none): with
    zero tokens, bias1 without bias0 is refused as it is with tokens, and a half-given forwarding pair is refused."""
    args = dict(
        _combine_args(),
        num_tokens=0,
        is_token_in_rank=_empty_gpu(0, HT_R, dtype=torch.bool),
        out=_empty_gpu(0, HT_H, dtype=torch.bfloat16),
        out_weights=_empty_gpu(0, HT_K, dtype=torch.float32),
        bias0=None,
        bias1=_empty_gpu(0, HT_H, dtype=torch.bfloat16),
    )
    with pytest.raises(ValueError, match="bias1 only with bias0"):
        _ht_kernels().combine(**args)
    with pytest.raises(RuntimeError, match="HT combine: "):  # with bias0 given (empty too) it reaches the launch
        _ht_kernels().combine(**dict(args, bias0=_empty_gpu(0, HT_H, dtype=torch.bfloat16)))
    for op in ("dispatch", "combine"):
        with pytest.raises(ValueError, match=f"{op}: fwd_channel_prefix and fwd_rank_prefix: both or neither"):
            getattr(_ht_kernels(), op)(**HT_CALLS[op](), fwd_rank_prefix=_gpu(1))


def test_the_ht_flag_exchange_takes_no_tensors():
    kernels = _ht_kernels()
    with pytest.raises(RuntimeError, match="HT notify: "):
        kernels.notify(channels=HT_C, stream=0)
    with pytest.raises(ValueError, match="without count_mode it takes no tensors"):
        kernels.notify(channels=HT_C, stream=0, is_token_in_rank=_gpu(HT_N, HT_R, dtype=torch.bool))


@pytest.mark.parametrize(
    "op,change,message",
    [
        ("notify", dict(is_token_in_rank=_gpu(HT_N + 1, HT_R, dtype=torch.bool)), "is_token_in_rank: 26 entries"),
        ("notify", dict(channel_prefix=_gpu(HT_R, HT_C + 1)), "channel_prefix: 8 entries, exactly 6"),
        ("notify", dict(tokens_per_expert=_gpu(HT_E, dtype=torch.int64)), "tokens_per_expert: dtype torch.int64"),
        ("notify", dict(recv_rank_prefix=None), "recv_rank_prefix: a tensor is needed"),
        ("notify", dict(fwd_rank_prefix=_gpu(1)), "all with forwarding, none without"),
        ("dispatch", dict(x=_gpu(HT_N, HT_H + 1, dtype=torch.bfloat16)), "x: 1560 bytes, exactly 1536"),
        ("dispatch", dict(recv_x=_gpu(HT_RECV - 1, HT_H, dtype=torch.bfloat16)), "recv_x: 2432 bytes"),
        ("dispatch", dict(recv_prefix=_gpu(HT_R)), "exactly one is needed"),
        ("dispatch", dict(rank_prefix_matrix=_gpu(HT_R)), "rank_prefix_matrix: 2 entries, exactly 4"),
        ("dispatch", dict(recv_scales=None), "scales with recv_scales"),
        ("dispatch", dict(topk_idx=_gpu(HT_N, HT_K, dtype=torch.int32)), "topk_idx: dtype torch.int32"),
        ("dispatch", dict(recv_src_idx=_gpu(HT_RECV - 1)), "recv_src_idx: 19 entries"),
        ("dispatch", dict(send_head=CudaStandIn(torch.zeros(HT_N, HT_R, dtype=torch.int32).t())), "contiguous"),
        ("combine", dict(x=_gpu(HT_RECV, HT_H, dtype=torch.float32)), "x: dtype torch.float32"),
        ("combine", dict(out=_gpu(HT_N - 1, HT_H, dtype=torch.bfloat16)), "out: 704 entries, exactly 768"),
        ("combine", dict(bias0=None), "bias1 only with bias0"),
        ("combine", dict(out_weights=None), "topk_weights with out_weights"),
        ("combine", dict(recv_prefix=_gpu(HT_R + 1)), "recv_prefix: 3 entries, exactly 2"),
        ("combine", dict(is_token_in_rank=torch.zeros(HT_N, HT_R, dtype=torch.bool)), "on cuda:0 is needed"),
    ],
)
def test_the_ht_bindings_refuse_a_wrong_tensor_by_name(op, change, message):
    args = HT_CALLS[op]()
    args.update(change)
    with pytest.raises(ValueError, match=message):
        getattr(_ht_kernels(), op)(**args)


def test_the_ht_kernels_refuse_a_short_peer_table_and_a_missing_fifo_set():
    with pytest.raises(ValueError, match="fifos: None"):
        native.HTKernels(_ht_layout(4, 2), None, **_ht_kernel_memory(4))
    with pytest.raises(ValueError, match="peers: 1 entries, exactly 2"):
        native.HTKernels(_ht_layout(2, 2), None, **{**_ht_kernel_memory(2), "peers": _gpu(1, dtype=torch.int64)})


def test_the_ht_kernels_need_a_region_past_the_control_area_without_a_channel():
    layout = _ht_layout(HT_R, HT_R)
    end = HT_CTRL_OFF + layout.ctrl_bytes
    assert HT_REGION_BYTES >= end  # the stand-in region is large enough: the good case above builds
    short = {**_ht_kernel_memory(HT_R), "region": _gpu(end - 1, dtype=torch.uint8)}
    with pytest.raises(ValueError, match=f"region: {end - 1} entries, at least {end} needed"):
        native.HTKernels(layout, None, **short)
    with pytest.raises(ValueError, match="region: a tensor is needed"):
        native.HTKernels(layout, None, **{**_ht_kernel_memory(HT_R), "region": None})
    with pytest.raises(ValueError, match="signals: 16 entries, exactly"):
        native.HTKernels(layout, None, **{**_ht_kernel_memory(HT_R), "signals": _gpu(16, dtype=torch.int64)})
