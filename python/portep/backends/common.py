"""What both backends share: the contract their engines keep (Engine), the signal streams of a Buffer, alignment
and row-dtype constants, the low-latency layout of one buffer half and small tensor helpers. Imports nothing from
either backend."""

from typing import Any, Optional, Protocol, Tuple

import torch

from .._native import require_native
from ..lockstep import Lockstep


class Engine(Protocol):
    """What buffer.py calls on a backend's engine (backends/host/engine.py's HostEngine, backends/cuda/engine.py's
    CudaEngine). The Buffer checks the inputs and holds the lockstep; an engine moves the data. Arguments are DeepEP's,
    in DeepEP's order, already checked; tensors live on the engine's device. tests/build/test_seams.py holds both
    engines to this contract, parameter for parameter."""

    rank: int
    num_ranks: int
    num_nodes: int
    ranks_per_node: int
    lockstep: Lockstep

    def raise_notice(self, results: Any = None) -> None:
        """Raises what the engine found since the last call (a dead peer, a kernel's error report)."""

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int) -> Tuple[Any, ...]:
        """DeepEP's get_dispatch_layout: per-rank, per-node (None on one node) and per-expert counts, and
        is_token_in_rank."""

    def dispatch(
        self,
        x: torch.Tensor,
        x_scales: Optional[torch.Tensor],
        topk_idx: Optional[torch.Tensor],
        topk_weights: Optional[torch.Tensor],
        num_tokens_per_rank: Optional[torch.Tensor],
        num_tokens_per_rdma_rank: Optional[torch.Tensor],
        is_token_in_rank: Optional[torch.Tensor],
        num_tokens_per_expert: Optional[torch.Tensor],
        expert_alignment: int,
        num_worst_tokens: int,
        num_channels: int,
        handle: Optional[tuple],
    ) -> Tuple[Any, ...]:
        """Normal-mode dispatch (a cached one where handle is given): the received rows and DeepEP's handle."""

    def combine(
        self, x: torch.Tensor, handle: tuple, topk_weights: Optional[torch.Tensor], bias: Tuple[torch.Tensor, ...]
    ) -> Tuple[Any, ...]:
        """Normal-mode combine of the rows a dispatch with this handle delivered."""

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        T: int,
        E: int,
        use_fp8: bool,
        round_scale: bool,
        use_ue8m0: bool,
        cumulative_stats: Optional[torch.Tensor],
        wait_stats: Optional[torch.Tensor],
        return_recv_hook: bool,
    ) -> Tuple[Any, ...]:
        """Low-latency dispatch of at most T tokens per rank to E experts: received rows, counts, handle, hook."""

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: tuple,
        zero_copy: bool,
        out: Optional[torch.Tensor],
        return_recv_hook: bool,
        wait_stats: Optional[torch.Tensor],
        use_logfmt: bool = False,
    ) -> Tuple[Any, ...]:
        """Low-latency combine: the reduced rows and the receive hook (None unless return_recv_hook); use_logfmt:
        rows travel in LogFMT-10 (gpu_kernels/logfmt.h)."""

    def get_next_low_latency_combine_buffer(self, handle: tuple) -> torch.Tensor:
        """Where the next low-latency combine takes its rows from (zero_copy)."""

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """DeepEP's clean_low_latency_buffer, which also resynchronises the ranks."""

    def mark_checked(self, T: int, H: int, E: int, dispatch_flags: Optional[tuple] = None) -> None:
        """A low-latency call of this signature passed the Buffer's checks and launched: an engine with a native fast
        path may skip the checks from now on."""

    def update_mask(self, rank: int, masked: bool) -> None:
        """Shrink mode: masks (or unmasks) rank."""

    def query_mask(self, out: torch.Tensor) -> None:
        """Shrink mode: writes the mask, int32 [num_ranks], into out."""

    def clean_mask(self) -> None:
        """Shrink mode: unmasks every rank."""

    def get_local_buffer_tensor(
        self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0, use_rdma_buffer: bool = False
    ) -> torch.Tensor:
        """A view of this rank's communication memory."""

    def destroy(self) -> None:
        """Releases everything the engine holds; idempotent."""


# Signal streams of one Buffer (slots are (source rank, stream)).
STREAM_NOTIFY = 0
STREAM_HT_TO_FORWARDER = 1
STREAM_HT_PLACED = 2
STREAM_HT_COMBINE_TO_FORWARDER = 3
STREAM_HT_COMBINE_PARTIAL = 4
STREAM_HT_COMBINE_DIRECT = 5
STREAM_SYNC = 6  # the ranks' synchronisation of clean_low_latency_buffer (sync())
STREAM_LL_BASE = 8  # then LL_STREAMS_PER_EXPERT per local expert: [2 buffer halves][2 phases][local expert]
LL_STREAMS_PER_EXPERT = 4


def ll_streams_end(max_local_experts):
    """The first signal stream after the LL ones (the host backend's status streams, peer_watch.h; the CUDA
    backend's normal-mode streams)."""
    return STREAM_LL_BASE + LL_STREAMS_PER_EXPERT * max_local_experts


_native = require_native()
ALIGN = _native.OFFSET_ALIGN  # (proxy/transfer_cmd.h)
BF16, F32, LOGFMT = _native.ROW_BF16, _native.ROW_F32, _native.ROW_LOGFMT  # row dtypes of the native row kernels
MAX_COMMAND_BYTES = _native.MAX_CMD_BYTES
MAX_CHANNELS = 128


def ranges_without(keep, n):
    """[begin, end) ranges covering 0..n except the indices in keep."""
    out, begin = [], 0
    for k in sorted(keep):
        if k > begin:
            out.append((begin, k))
        begin = k + 1
    if begin < n:
        out.append((begin, n))
    return out


def dense(t):
    """t with row-major strides: a copy only where t has others, which contiguous() keeps for an empty tensor or a
    size-1 dimension, and which the byte views of the row kernels refuse (a [0, 1] tensor of strides (1, 0), made
    by an expression on a rank without tokens, is contiguous)."""
    if not torch.is_tensor(t):
        return t
    stride, expected = t.stride(), []
    step = 1
    for size in reversed(t.shape):
        expected.append(step)
        step *= size
    if t.is_contiguous() and tuple(reversed(expected)) == stride:
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def byte_view(region, dtype, size=None, offset=0):
    """A `dtype` view of the uint8 tensor `region` from byte `offset` (whole elements), shaped `size` if given: the
    engines' get_local_buffer_tensor (Buffer checked offset and size against the buffer)."""
    elem = dtype.itemsize
    view = region[offset : offset + (region.numel() - offset) // elem * elem].view(dtype)
    return view if size is None else view[: torch.Size(size).numel()].view(size)


def align(n, a=ALIGN):
    return (n + a - 1) // a * a


class LLLayout:
    """The low-latency mode's layout of one buffer half, from its one definition (gpu_kernels/ll_layout.h): T, H, E,
    E_l, M, the message and row sizes disp and comb, the areas send and recv, half, send_off(h), recv_off(h)."""

    def __init__(self, eng, T, H, E):
        lay = _native.ll_layout(T, H, E, eng.num_ranks)  # raises for a hidden size the layout cannot take
        if lay.E_l > eng.max_local_experts:
            raise ValueError(
                f"num_experts={E} gives {lay.E_l} local experts per rank; this Buffer supports at most "
                f"{eng.max_local_experts}"
            )
        self.T, self.H, self.E, self.E_l, self.M = lay.T, lay.H, lay.E, lay.E_l, lay.M
        self.disp, self.comb, self.send, self.recv, self.half = lay.disp, lay.comb, lay.send, lay.recv, lay.half
        self._native = lay
        eng.require_bytes(2 * self.half, f"low-latency mode with {T} tokens, hidden {H}, {E} experts")

    def send_off(self, half):
        return self._native.send_off(half)

    def recv_off(self, half):
        return self._native.recv_off(half)


def positions(mask_matrix):
    """For a bool [N, M] matrix: each True's index among the Trues of its column, -1 elsewhere (int32)."""
    pos = torch.cumsum(mask_matrix.to(torch.int32), 0, dtype=torch.int32) - 1
    return torch.where(mask_matrix, pos, torch.full_like(pos, -1))
