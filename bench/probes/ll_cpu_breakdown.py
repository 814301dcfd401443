"""Where the host time of an eager LL round trip goes, with every rank running the same loop (the back-to-back
round trip is bound by the slowest rank's host time when it exceeds the GPU's). Per rank, microseconds per round
trip over back-to-back loops (synchronized once at the end):
  buffer     Buffer.low_latency_dispatch + low_latency_combine (what applications call)
  engine     the CUDA engine's calls (no Buffer argument checks)
  launches   the two pybind kernel launches alone, with preallocated outputs
  allocs     the six torch.empty calls of a round trip, nothing else
  gpu        the round trip's GPU time (CUDA graph replay)
and `buffer` again with this rank's main thread pinned to one CPU core.
Run from the repository root: python bench/probes/ll_cpu_breakdown.py [ranks] [iterations]"""
import os
import sys
import time

sys.path.insert(0, "bench")
from portep_bench.spawn import run_ranks  # noqa: E402


def per_iteration_us(fn, iterations):
    import torch
    import torch.distributed as dist

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        fn()
    cpu = (time.perf_counter() - start) / iterations * 1e6
    torch.cuda.synchronize()
    dist.barrier()
    return cpu


def body(rank, world, iterations):
    import torch

    from portep_bench.ll_gpu import _timed, cuda_ll_buffer, ll_inputs, round_trip_allocs

    torch.cuda.set_device(rank % torch.cuda.device_count())  # ranks may share a GPU (host times only)
    T, H, K, E = 128, 7168, 8, 288
    x, idx, w = ll_inputs(rank, T, H, K, E)
    buf = cuda_ll_buffer(world, T, H, E, world, "shm")
    eng = buf.runtime
    rx = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)[0]
    out = {}

    def buffer_rt():
        buf.low_latency_combine(rx, idx, w, buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)[2])

    def engine_rt():
        h = eng.low_latency_dispatch(x, idx, T, E, True, False, False, None, None, False)[2]
        eng.low_latency_combine(rx, idx, w, h, False, None, False, None)

    out["buffer"] = per_iteration_us(buffer_rt, iterations)
    out["engine"] = per_iteration_us(engine_rt, iterations)

    lay = eng._layout(T, H, E)
    E_l, M = lay.E_l, lay.M
    dev = eng.device
    recv_x = torch.empty(E_l, M, H, dtype=torch.float8_e4m3fn, device=dev)
    scales = torch.empty(E_l, H // 128, M, dtype=torch.float32, device=dev)
    count = torch.empty(E_l, dtype=torch.int32, device=dev)
    src_info = torch.empty(E_l, M, dtype=torch.int32, device=dev)
    layout_range = torch.empty(E_l, world, dtype=torch.int64, device=dev)
    result = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    k = eng.kernels
    args = (x.data_ptr(), idx.data_ptr(), T, K, True, False, False, recv_x.data_ptr(), scales.data_ptr(),
            count.data_ptr(), src_info.data_ptr(), layout_range.data_ptr(), 0, 0)
    cargs = (rx.data_ptr(), 2 * H, False, src_info.data_ptr(), layout_range.data_ptr(), idx.data_ptr(),
             w.data_ptr(), T, K, result.data_ptr(), 2 * H, 0)

    def launches_rt():
        half = eng.ll_half
        k.dispatch(3, eng._shape(lay, half, 0), *args)
        k.combine(3, eng._shape(lay, half ^ 1, 1), *cargs)

    out["launches"] = per_iteration_us(launches_rt, iterations)

    out["allocs"] = per_iteration_us(round_trip_allocs(T, H, E_l, M, world, dev), iterations)
    out["check_error x2"] = per_iteration_us(lambda: (eng.check_error(), eng.check_error()), iterations)

    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        buffer_rt()
    torch.cuda.synchronize()
    out["gpu (graph replay, events)"] = _timed(graph.replay, iterations)
    core = sorted(os.sched_getaffinity(0))[-1 - rank]
    os.sched_setaffinity(0, {core})
    out["buffer, main thread pinned to one core"] = per_iteration_us(buffer_rt, iterations)
    torch.cuda.synchronize()
    if rank == 0 and os.environ.get("PORTEP_PROBE_CPROFILE"):  # where the Buffer path's time goes, by function
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(iterations):
            buffer_rt()
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        print(text.getvalue(), flush=True)
    else:
        for _ in range(iterations):
            buffer_rt()
    torch.cuda.synchronize()
    buf.destroy()
    return out


if __name__ == "__main__":
    ranks = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    iterations = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    results = run_ranks(body, ranks, (iterations,), timeout=300)
    for key in results[0]:
        print(f"{key:<32}" + "".join(f"  rank {r}: {results[r][key]:7.1f} us" for r in sorted(results)))
