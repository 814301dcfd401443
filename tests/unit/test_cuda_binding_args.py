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

    def __init__(self, t):
        self.t = t
        self.device = types.SimpleNamespace(type="cuda", index=0)
        self.dtype = t.dtype

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
        error=0,
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
    ],
    ids=["cpu-topk_idx", "short-per_expert", "float-is_token_in_rank"],
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
