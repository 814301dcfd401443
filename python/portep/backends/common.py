"""What both backends share: the signal streams of a Buffer, alignment and row-dtype constants, the low-latency
layout of one buffer half and small tensor helpers. Imports nothing from either backend."""

import torch

from .._native import require_native

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
BF16, F32 = _native.ROW_BF16, _native.ROW_F32  # row dtypes of the native row kernels
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
    return torch.empty(t.shape, dtype=t.dtype).copy_(t)


def byte_view(region, dtype, size=None, offset=0):
    """A `dtype` view of the uint8 tensor `region` from byte `offset` (whole elements), shaped `size` if given: the
    engines' get_local_buffer_tensor (Buffer checked offset and size against the buffer)."""
    elem = dtype.itemsize
    view = region[offset:offset + (region.numel() - offset) // elem * elem].view(dtype)
    return view if size is None else view[:torch.Size(size).numel()].view(size)


def align(n, a=ALIGN):
    return (n + a - 1) // a * a


class LLLayout:
    """The low-latency mode's layout of one buffer half, from its one definition (gpu_kernels/ll_layout.h): T, H, E,
    E_l, M, the message and row sizes disp and comb, the areas send and recv, half, send_off(h), recv_off(h)."""

    def __init__(self, eng, T, H, E):
        lay = _native.ll_layout(T, H, E, eng.num_ranks)  # raises for a hidden size the layout cannot take
        if lay.E_l > eng.max_local_experts:
            raise ValueError(f"num_experts={E} gives {lay.E_l} local experts per rank; this Buffer supports at most "
                             f"{eng.max_local_experts}")
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
