"""Profile of LL dispatch + combine on two GPUs (DeepEP's shape): host time per call, event and CUDA-graph round
trips, torch profiler tables (kernel and CPU op times) and a cProfile of the Python path, per rank.
Run from the repository root: python bench/probes/ll_profile.py RANKS_PER_NODE TRANSPORT (2 shm: direct NVLink;
1 shm: forced proxy path)."""
import io
import sys
import time

sys.path.insert(0, "bench")
from portep_bench.spawn import run_ranks


def body(rank, world, rpn, transport, T, H, K, E, iters):
    import torch, torch.distributed as dist, cProfile, pstats, statistics
    from portep_bench.ll_gpu import cuda_ll_buffer, ll_inputs
    torch.cuda.set_device(rank)
    x, idx, w = ll_inputs(rank, T, H, K, E)
    buf = cuda_ll_buffer(world, T, H, E, rpn, transport)
    res = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)
    sim = res[0][0].to(torch.bfloat16)
    log = []
    def rt():
        h = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)[2]
        buf.low_latency_combine(sim, idx, w, h)
    for _ in range(20):
        rt()
    s = torch.cuda.current_stream(); s.synchronize(); dist.barrier()
    # CPU time per call
    td, tc = [], []
    for _ in range(iters):
        t0 = time.perf_counter(); h = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)[2]
        t1 = time.perf_counter(); buf.low_latency_combine(sim, idx, w, h); t2 = time.perf_counter()
        td.append((t1 - t0) * 1e6); tc.append((t2 - t1) * 1e6)
    s.synchronize()
    log.append(f"CPU us per call: dispatch {statistics.median(td):.1f}  combine {statistics.median(tc):.1f}")
    # event round trip
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); rt(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1e3)
    log.append(f"event round trip median {statistics.median(ts):.1f} us")
    dist.barrier()
    # profiler
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            rt()
        s.synchronize()
    log.append(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=50))
    log.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=50))
    dist.barrier()
    # graph
    try:
        s.synchronize(); dist.barrier()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            rt()
        s.synchronize(); dist.barrier()
        for _ in range(5):
            graph.replay()
        s.synchronize(); dist.barrier()
        ts = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); graph.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1e3)
        log.append(f"graph round trip median {statistics.median(ts):.1f} us")
    except Exception as e:
        log.append(f"graph failed: {e!r}")
    s.synchronize(); dist.barrier()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(100):
        rt()
    pr.disable()
    s.synchronize()
    sio = io.StringIO()
    pstats.Stats(pr, stream=sio).sort_stats("tottime").print_stats(25)
    log.append(sio.getvalue())
    dist.barrier()
    buf.destroy()
    return "\n".join(log)


if __name__ == "__main__":
    rpn, transport = int(sys.argv[1]), sys.argv[2]
    out = run_ranks(body, 2, args=(rpn, transport, 128, 7168, 8, 288, 50), timeout=240)
    print(f"===== rpn={rpn} transport={transport}")
    for r in sorted(out):
        print(f"--- rank {r}\n{out[r]}", flush=True)
