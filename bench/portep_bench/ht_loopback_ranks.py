"""The two ranks of the HT loopback benchmark (ht_loopback.py) in one process, through the engine's own code: each
rank is a CudaHT (portep/backends/cuda/ht.py) built from an explicit HTMemory, its buffer a torch allocation on this
GPU and its peer the other rank's buffer (direct stores, no proxies). The ops (notify + dispatch, cached dispatch,
combine) are CudaHT's own methods, each on one rank's stream; none waits for the GPU, so ht_loopback.py can queue
both ranks' kernels behind a sleep on the GPU (the first dispatch excepted: it waits for the counts)."""

import types
from concurrent.futures import ThreadPoolExecutor

import torch

from portep import native
from portep.backends.cuda.ht import CudaHT, HTMemory
from portep.backends.cuda.kernel_errors import KernelErrors

R = 2
N, H, K, E = 4096, 7168, 8, 256
AREA_BYTES = 100712960  # DeepEP's NVL hint for this shape, as python -m portep_bench gpu-ht sizes its Buffer


class _Owner:
    """What CudaHT asks its CudaEngine at call time, for a loopback rank: kernels launch on the current stream (the
    benchmark's `with torch.cuda.stream(...)`), the two ranks keep no lockstep, failures come from the rank's
    records."""

    launch_stream = None

    def __init__(self, errors):
        self.errors = errors
        self.lockstep = types.SimpleNamespace(sending=lambda: None)

    def raw_stream(self):
        return torch.cuda.current_stream().cuda_stream

    def check_error(self):
        failure = self.errors.record(0)
        if failure[0]:
            raise RuntimeError(self.errors.message(*failure))

    def synchronize(self):
        torch.cuda.synchronize()


class _Kernels:
    """A rank's native HTKernels as CudaHT calls them, recording `mark` (an event, when set) on the current stream
    right after the next notify: ht_loopback.split_times times an op's notify and data kernel apart."""

    def __init__(self, kernels):
        self.native, self.mark = kernels, None

    def notify(self, **named):
        self.native.notify(**named)
        if self.mark is not None:
            self.mark.record()
            self.mark = None

    def wait_counts(self, ticket, num_local_experts):
        return self.native.wait_counts(ticket, num_local_experts)

    def dispatch(self, **named):
        self.native.dispatch(**named)

    def combine(self, **named):
        self.native.combine(**named)


class LoopbackRank:
    """One rank: its buffer (the control area, then the normal-mode area from area_off), its CudaHT, and what a
    CudaEngine would own besides: error records, signal slots (no proxy writes them), a FIFO set (unused)."""

    def __init__(self, rank, regions, area_off):
        dev = regions[rank].device
        self.region = regions[rank]
        self.errors = KernelErrors(native, dev)
        self.signals = torch.zeros(R * native.HT_NUM_STREAMS, dtype=torch.int64, device=dev)
        self.seen = torch.zeros_like(self.signals)
        self.fifos = native.DeviceFifoSet(1, 64)
        memory = HTMemory(
            rank=rank,
            num_ranks=R,
            ranks_per_node=R,
            device=dev,
            device_sms=torch.cuda.get_device_properties(dev).multi_processor_count,
            channel=None,
            region=self.region,
            signals=self.signals,
            peers=torch.tensor([t.data_ptr() for t in regions], dtype=torch.int64, device=dev),
            place=torch.zeros(R, dtype=torch.int64, device=dev),
            ctrl_off=0,
            area_off=area_off,
            area_bytes=AREA_BYTES,
            errors=self.errors,
            peer_status=None,
            signal_seen=self.seen,
            num_streams=native.HT_NUM_STREAMS,
            stream_base=0,
            fifos=self.fifos,
            timeout_s=10.0,
        )
        self.ht = CudaHT.from_memory(_Owner(self.errors), memory)
        self.kernels = self.ht.kernels = _Kernels(self.ht.kernels)


def make_ranks():
    """Both ranks on this GPU, each buffer sized by DeepEP's NVL hint for the benchmark's shape."""
    native.cuda_load_kernels()
    ctrl_bytes = native.ht_ctrl_layout(R, R)["bytes"]
    area_off = -(-ctrl_bytes // 128) * 128  # the normal-mode area from the next 128-byte boundary
    regions = [torch.zeros(area_off + AREA_BYTES, dtype=torch.uint8, device="cuda") for _ in range(R)]
    return [LoopbackRank(r, regions, area_off) for r in range(R)]


def layout(idx, E):
    N = idx.size(0)
    in_rank = torch.zeros(N, R, dtype=torch.bool, device="cuda")
    in_rank.scatter_(1, idx // (E // R), True)
    per_expert = torch.bincount(idx.flatten(), minlength=E).to(torch.int32)
    return in_rank, per_expert


def first_dispatch(ranks, inputs, E, C, streams):
    """CudaHT.dispatch in count mode on both ranks at once, one thread each (a rank's CPU waits for the counts, which
    need the other rank's notify): the handles the timed calls reuse."""

    def dispatch(r):
        x, idx, w, in_rank, per_expert = inputs[r]
        with torch.cuda.stream(streams[r]):
            return ranks[r].ht.dispatch(x, None, idx, w, in_rank, per_expert, 1, 0, C, None)

    with ThreadPoolExecutor(R) as pool:
        results = list(pool.map(dispatch, range(R)))
    torch.cuda.synchronize()
    return [
        {"handle": handle, "rows": recv_x.size(0), "recv_x": recv_x, "recv_idx": recv_idx, "recv_w": recv_w}
        for recv_x, _, recv_idx, recv_w, _, handle in results
    ]


def failure_code(rank):
    """The code of the rank's failure record (0: none), read from its mapped host memory."""
    return rank.errors.record(0)[0]


def cached_dispatch(rk, r, inputs_r, h, C, stream, fp8, mid=None):
    """CudaHT.dispatch with h's handle on `stream`: BF16 rows, or fp8 = (FP8 rows, scales). Its outputs replace h's
    "recv_x" (or "recv_fp8" and "recv_scales"); mid: an event recorded between the notify and the data kernel."""
    data, scales = fp8 if fp8 else (inputs_r[0], None)
    rk.kernels.mark = mid
    with torch.cuda.stream(stream):
        recv, recv_scales = rk.ht.dispatch(data, scales, None, None, None, None, 1, 0, C, h["handle"])[:2]
    if fp8:
        h["recv_fp8"], h["recv_scales"] = recv, recv_scales
    else:
        h["recv_x"] = recv


def combine(rk, r, inputs_r, h, C, stream, bias=None):
    """CudaHT.combine of h["recv_x"] with h's handle on `stream`, into h["out"]; bias: DeepEP's (bias0, bias1) pair
    of BF16 [N, H] tensors, or None."""
    with torch.cuda.stream(stream):
        h["out"] = rk.ht.combine(h["recv_x"], h["handle"], None, tuple(bias or ()))[0]


def notify_flags(rk, inputs_r, C, stream):
    """The flag exchange alone (the notify of a cached dispatch or a combine) on `stream`: CudaHT.exchange_flags."""
    with torch.cuda.stream(stream):
        rk.ht.exchange_flags(C, inputs_r[3])
