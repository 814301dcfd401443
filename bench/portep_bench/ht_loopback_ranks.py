"""The two ranks of the HT loopback benchmark (ht_loopback.py) in one process: each rank's buffer and kernels, and
the normal-mode ops (notify + dispatch, cached dispatch, combine) on one rank's stream."""
import ctypes

import torch

from portep import native
from portep.backends import common as hb
from portep.backends.cuda.ht import _record_bytes, rows_per_ring

R = 2
N, H, K, E = 4096, 7168, 8, 256


class LoopbackRank:
    """One rank's buffer and kernels; peers are both ranks' buffers (direct stores, no proxies)."""

    def __init__(self, rank, area_bytes, regions, peers):
        self.rank = rank
        self.ctrl = (native.HT_CTRL_BYTES + 127) // 128 * 128
        self.area = area_bytes
        self.region = regions[rank]
        self.epoch = torch.zeros(2, dtype=torch.int64, device="cuda")
        self.counts_host, counts_dev = native.cuda_host_alloc_mapped(native.HT_HOST_COUNTS_BYTES)
        error_bytes = native.KERNEL_ERROR_WORDS * native.KERNEL_ERROR_BYTES
        self.error_host, error_dev = native.cuda_host_alloc_mapped(error_bytes)
        ctypes.memset(self.counts_host, 0, native.HT_HOST_COUNTS_BYTES)
        ctypes.memset(self.error_host, 0, error_bytes)
        self.signals = torch.zeros(R * native.HT_NUM_STREAMS, dtype=torch.int64, device="cuda")
        self.seen = torch.zeros_like(self.signals)
        self.failed = torch.zeros(native.KERNEL_ERROR_WORDS, dtype=torch.int32, device="cuda")
        self.fifos = native.DeviceFifoSet(1, 64)
        self.no_place = torch.zeros(R, dtype=torch.int64, device="cuda")  # every peer is direct
        self.kernels = native.HTKernels(rank, R, R, self.region.data_ptr(), peers.data_ptr(),
                                        self.no_place.data_ptr(), 0, self.ctrl,
                                        self.ctrl + area_bytes, self.epoch.data_ptr(), self.counts_host, counts_dev,
                                        error_dev, self.error_host, 10.0, self.fifos, self.signals.data_ptr(),
                                        self.seen.data_ptr(), native.HT_NUM_STREAMS, 0, self.failed.data_ptr())
        self.ticket = 0

    def ring_rows(self, row_bytes, C):
        rows = rows_per_ring(self.area, (R - 1) * C, row_bytes, native.HT_CHUNK_ROWS)
        assert rows >= native.HT_MIN_RING_ROWS, (rows, row_bytes, C)
        return rows


def layout(idx, E):
    N = idx.size(0)
    in_rank = torch.zeros(N, R, dtype=torch.bool, device="cuda")
    in_rank.scatter_(1, idx // (E // R), True)
    per_expert = torch.bincount(idx.flatten(), minlength=E).to(torch.int32)
    return in_rank, per_expert


def first_dispatch(ranks, inputs, E, C, streams):
    """Count mode (the CPU waits for the counts), then the data kernels: the handles the timed calls reuse."""
    handles = []
    for r, rk in enumerate(ranks):
        x, idx, w, in_rank, per_expert = inputs[r]
        N = x.size(0)
        h = {"rank_prefix": torch.empty(R, R, dtype=torch.int32, device="cuda"),
             "channel_prefix": torch.empty(R, C, dtype=torch.int32, device="cuda"),
             "rcp": torch.empty(R, C, dtype=torch.int32, device="cuda")}
        rk.ticket += 1
        rk.kernels.notify(C, streams[r].cuda_stream, True, in_rank.data_ptr(), per_expert.data_ptr(), N, E,
                          h["rank_prefix"].data_ptr(), h["channel_prefix"].data_ptr(), h["rcp"].data_ptr(), 0, 0, 0,
                          0, rk.ticket)
        handles.append(h)
    for r, rk in enumerate(ranks):
        got = rk.kernels.wait_counts(rk.ticket, E // R)
        assert got is not None, f"rank {r}: count exchange timed out"
        handles[r]["rows"] = got[0]
    for r, rk in enumerate(ranks):
        x, idx, w, in_rank, _ = inputs[r]
        h, N, K = handles[r], x.size(0), idx.size(1)
        rows = h["rows"]
        h["recv_x"] = torch.empty(rows, x.size(1), dtype=x.dtype, device="cuda")
        h["recv_idx"] = torch.full((rows, K), -1, dtype=torch.int64, device="cuda")
        h["recv_w"] = torch.zeros(rows, K, dtype=torch.float32, device="cuda")
        h["src_idx"] = torch.empty(rows, dtype=torch.int32, device="cuda")
        h["send_head"] = torch.empty(N, R, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()  # the fills above (current stream) before the kernels (their own streams)
    for r, rk in enumerate(ranks):
        x, idx, w, in_rank, _ = inputs[r]
        h, N, K = handles[r], x.size(0), idx.size(1)
        rows = h["rows"]
        rec = _record_bytes(x, None, K)
        rk.kernels.dispatch(C, streams[r].cuda_stream, x.data_ptr(), 0, idx.data_ptr(), w.data_ptr(),
                            in_rank.data_ptr(), h["rank_prefix"].data_ptr() + 4 * r, R,
                            h["channel_prefix"].data_ptr(), h["rcp"].data_ptr(), N, x.size(1) * 2, 0, K, E // R,
                            rk.ring_rows(rec, C), rows, h["recv_x"].data_ptr(), 0, h["recv_idx"].data_ptr(),
                            h["recv_w"].data_ptr(), h["src_idx"].data_ptr(), h["send_head"].data_ptr(), 0, 0, 0, 0,
                            0)
    torch.cuda.synchronize()
    return handles


def ctypes_u32(addr):
    return ctypes.c_uint32.from_address(addr).value


def cached_dispatch(rk, r, inputs_r, h, C, stream, fp8, mid=None):
    x, idx, _, in_rank, _ = inputs_r
    N = x.size(0)
    if fp8:
        data, scales = fp8
        row_bytes, S, out = data.size(1), scales.size(1), h["recv_fp8"]
        scales_ptr, out_scales = scales.data_ptr(), h["recv_scales"].data_ptr()
    else:
        data, row_bytes, S, out, scales_ptr, out_scales = x, x.size(1) * 2, 0, h["recv_x"], 0, 0
    rec = _record_bytes(data, fp8[1] if fp8 else None, 0)
    rk.kernels.notify(C, stream.cuda_stream, False, in_rank.data_ptr(), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    if mid is not None:
        mid.record(stream)
    rk.kernels.dispatch(C, stream.cuda_stream, data.data_ptr(), scales_ptr, 0, 0, in_rank.data_ptr(),
                        h["rank_prefix"].data_ptr() + 4 * r, R, h["channel_prefix"].data_ptr(), h["rcp"].data_ptr(),
                        N, row_bytes, S, 0, 0, rk.ring_rows(rec, C), h["rows"], out.data_ptr(), out_scales, 0, 0, 0,
                        0, 0, 0, 0, 0, 0)


def combine(rk, r, inputs_r, h, C, stream, bias=None):
    """bias: DeepEP's (bias0, bias1) pair of BF16 [N, H] tensors, or None."""
    x, idx, _, in_rank, _ = inputs_r
    b0, b1 = (bias[0].data_ptr(), bias[1].data_ptr()) if bias else (0, 0)
    N, H = x.shape
    row_bytes = hb.align(2 * H, 16)  # a combine row without top-k weights, as CudaHT.combine sizes it
    rk.kernels.notify(C, stream.cuda_stream, False, in_rank.data_ptr(), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    rk.kernels.combine(C, stream.cuda_stream, h["recv_x"].data_ptr(), 0, b0, b1, in_rank.data_ptr(),
                       h["rank_prefix"].data_ptr() + 4 * r, R, h["rcp"].data_ptr(), 0, 0, 0, N, H, 0,
                       rk.ring_rows(row_bytes, C), h["out"].data_ptr(), 0)


def make_ranks():
    """Both ranks on this GPU, each buffer sized by DeepEP's NVL hint for the benchmark's shape."""
    area = 100712960  # DeepEP's NVL hint for this shape, as python -m portep_bench gpu-ht sizes its Buffer
    ctrl = (native.HT_CTRL_BYTES + 127) // 128 * 128
    regions = [torch.zeros(ctrl + area, dtype=torch.uint8, device="cuda") for _ in range(R)]
    peers = torch.tensor([t.data_ptr() for t in regions], dtype=torch.int64, device="cuda")
    ranks = [LoopbackRank(r, area, regions, peers) for r in range(R)]
    native.cuda_load_kernels()
    return ranks
