"""Low-latency dispatch/combine on GPUs through portep.Buffer(backend='cuda'), DeepEP's shapes and byte counting,
with the same run's NCCL all_to_all_single baseline, for the direct NVLink path and the forced proxy path; and the
command channel through the real proxy threads (GPU pushes NOP commands into a Channel's device FIFOs).

Bytes as DeepEP's test_low_latency.py: every valid (token, expert) selection moves one message, FP8 dispatch
counts hidden + hidden/128*4 + 16 bytes per message, BF16 combine 2*hidden. Three kinds of time, rank 0
reporting: the round trip as DeepEP's bench() takes it (calls issued back to back, events around each, the
mean); CUDA events around calls that each wait for the GPU (medians); and kernel times as DeepEP's bench_kineto
takes them (launches queued behind a GPU sleep, durations from the profiler, medians). Also the command
channel's rate and its publish -> proxy latency bounds (gpu_fifo.command_latency_lines)."""

import time

from .gpu_fifo import command_latency_lines
from .report import MissingHardware, Table
from .spawn import run_ranks
from .stats import median

NOTE = (
    "two GPUs of one node: the direct path stores over NVLink, the forced proxy path (num_ranks_per_node=1) "
    "through the proxies and a host transport. Rank 0's figures; samples in us."
)

DEEPEP = {
    "round trip, back to back": 90.0,
    "dispatch kernel": 29.5,
    "combine kernel": 40.5,
    "dispatch send kernel": 20.0,
    "dispatch recv kernel": 8.2,
    "combine send kernel": 32.5,
    "combine recv kernel": 9.7,
}  # reference/gpu-machine.md, same machine


def _once(fn):
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    value = fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3, value


def _timed(fn, iterations):
    """Microseconds of each of `iterations` calls, CUDA events around each call, which waits for the GPU."""
    return [_once(fn)[0] for _ in range(iterations)]


def _back_to_back(fn, iterations):
    """DeepEP's bench(): events around each call, the calls issued back to back and synchronized once at the end
    (so each figure is the GPU's time when the host keeps ahead, else the host's); all but the first call's
    microseconds (DeepEP prints their mean)."""
    import torch

    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iterations)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iterations)]
    for i in range(iterations):
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) * 1e3 for a, b in zip(starts, ends)][1:]


def ll_inputs(rank, T, H, K, E):
    """This rank's seeded BF16 tokens, top-k expert indices and weights, on its GPU (the probes share them)."""
    import torch

    g = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()
    scores = torch.randn(T, E, generator=g).abs() + 1
    idx = torch.topk(scores, K, dim=-1).indices.cuda()
    w = torch.rand(T, K, generator=g).cuda()
    return x, idx, w


def round_trip_allocs(T, H, E_l, M, world, dev):
    """The six torch.empty calls of an FP8 LL round trip's outputs, as a function (host-time probes)."""
    import torch

    def allocs():
        torch.empty(E_l, M, H, dtype=torch.float8_e4m3fn, device=dev)
        torch.empty(E_l, H // 128, M, dtype=torch.float32, device=dev)
        torch.empty(E_l, dtype=torch.int32, device=dev)
        torch.empty(E_l, M, dtype=torch.int32, device=dev)
        torch.empty(E_l, world, dtype=torch.int64, device=dev)
        torch.empty(T, H, dtype=torch.bfloat16, device=dev)

    return allocs


def cuda_ll_buffer(world, T, H, E, ranks_per_node, transport):
    """A CUDA-backend LL Buffer of DeepEP's size hint over the WORLD group (ranks_per_node=1: the proxy path)."""
    import torch.distributed as dist

    import portep

    nbytes = portep.Buffer.get_low_latency_rdma_size_hint(T, H, world, E)
    return portep.Buffer(
        dist.group.WORLD,
        0,
        nbytes,
        low_latency_mode=True,
        num_ranks_per_node=ranks_per_node,
        transport=transport,
        explicitly_destroy=True,
        backend="cuda",
    )


def _path_times(buf, x, idx, w, T, E, iterations, hook_kernels, say):
    import torch
    import torch.distributed as dist

    def dispatch():
        return buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)

    res = dispatch()
    sim = res[0][0].to(torch.bfloat16)  # the identity expert's output, BF16 as in DeepEP's test
    handle = res[2]

    def combine():
        buf.low_latency_combine(sim, idx, w, handle)

    def round_trip():
        buf.low_latency_combine(sim, idx, w, dispatch()[2])

    for _ in range(20):
        round_trip()
    torch.cuda.current_stream().synchronize()
    dist.barrier()
    say(f"round trips back to back ({iterations})")
    out = {"round trip, back to back": _back_to_back(round_trip, iterations)}
    torch.cuda.current_stream().synchronize()
    dist.barrier()
    say("round trip, dispatch, combine, each call waited for")
    out.update(
        {
            "round trip": _timed(round_trip, iterations),
            "dispatch": _timed(dispatch, iterations),
            "combine": _timed(combine, iterations),
        }
    )
    say("CUDA graph replay and CPU time per round trip")
    out.update(_graph_and_cpu_times(round_trip, iterations))

    def hooked():
        d = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True, return_recv_hook=True)
        d[4]()
        c = buf.low_latency_combine(sim, idx, w, d[2], return_recv_hook=True)
        c[2]()

    say("kernel times from the profiler")
    out.update(kernel_times(round_trip, ("dispatch kernel", "combine kernel"), iterations))
    if hook_kernels:
        out.update(
            kernel_times(
                hooked,
                ("dispatch send kernel", "dispatch recv kernel", "combine send kernel", "combine recv kernel"),
                iterations,
            )
        )
    return out


def kernel_durations(prof):
    """Microseconds of every LL kernel the profiler saw, in start order."""
    kernels = [
        e
        for e in prof.events()
        if e.device_type.name == "CUDA" and ("dispatch_kernel" in e.name or "combine_kernel" in e.name)
    ]
    kernels.sort(key=lambda e: e.time_range.start)
    return [e.time_range.elapsed_us() for e in kernels]


def kernel_times(fn, labels, iterations):
    """GPU time of each kernel fn launches (labels name them in launch order), as DeepEP's bench_kineto does:
    the launches of `iterations` calls are queued behind a ~20 ms GPU sleep on every rank, so a kernel's
    duration is its own work and its wait for the peer's kernel, without the Python calls. Medians, the first
    two calls left out: the rest are the samples. Run last: the profiler slows later host calls."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    stream = torch.cuda.current_stream()
    for _ in range(5):
        fn()
    stream.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(40_000_000)
        for _ in range(iterations):
            fn()
        stream.synchronize()
    dist.barrier()
    durations = kernel_durations(prof)
    if len(durations) != len(labels) * iterations:
        raise RuntimeError(f"the profiler saw {len(durations)} LL kernels, expected {len(labels) * iterations}")
    return {label: durations[i + 2 * len(labels) :: len(labels)] for i, label in enumerate(labels)}


def _graph_and_cpu_times(round_trip, iterations):
    """The round trip replayed from a CUDA graph (GPU time without the Python calls), and the CPU time of each
    eager call alone (issued back to back, synchronized once at the end)."""
    import torch
    import torch.distributed as dist

    stream = torch.cuda.current_stream()
    stream.synchronize()
    dist.barrier()
    cpu = []
    for _ in range(iterations):
        start = time.perf_counter()
        round_trip()
        cpu.append((time.perf_counter() - start) * 1e6)
    stream.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        round_trip()
    stream.synchronize()
    dist.barrier()
    for _ in range(5):
        graph.replay()
    stream.synchronize()
    dist.barrier()
    replay = _timed(graph.replay, iterations)
    stream.synchronize()
    dist.barrier()
    return {"graph round trip": replay, "CPU per round trip": cpu}


def _nccl_times(x, idx, world, E, H, iterations, group):
    import torch
    import torch.distributed as dist

    E_l = E // world
    valid = idx >= 0
    dst = (idx // E_l)[valid]
    counts = torch.bincount(dst, minlength=world).cpu()
    msg_fp8, msg_bf16 = H + H // 128 * 4 + 16, 2 * H
    recv_counts = torch.empty(world, dtype=counts.dtype, device="cuda")
    dist.all_to_all_single(recv_counts, counts.cuda(), group=group)
    recv_counts = recv_counts.cpu()
    send_d = torch.empty(int(counts.sum()) * msg_fp8, dtype=torch.uint8, device="cuda")
    recv_d = torch.empty(int(recv_counts.sum()) * msg_fp8, dtype=torch.uint8, device="cuda")
    send_c = torch.empty(int(recv_counts.sum()) * msg_bf16, dtype=torch.uint8, device="cuda")
    recv_c = torch.empty(int(counts.sum()) * msg_bf16, dtype=torch.uint8, device="cuda")

    def disp():
        dist.all_to_all_single(
            recv_d, send_d, (recv_counts * msg_fp8).tolist(), (counts * msg_fp8).tolist(), group=group
        )

    def comb():
        dist.all_to_all_single(
            recv_c, send_c, (counts * msg_bf16).tolist(), (recv_counts * msg_bf16).tolist(), group=group
        )

    for _ in range(10):
        disp()
        comb()
    return {
        "dispatch": _timed(disp, iterations),
        "combine": _timed(comb, iterations),
        "round trip": _timed(lambda: (disp(), comb()), iterations),
    }


def _rank_body(rank, world, T, H, K, E, iterations, proxy_transport, with_proxy, progress):
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    nccl = dist.new_group(backend="nccl")
    x, idx, w = ll_inputs(rank, T, H, K, E)
    results = {"selections": int((idx >= 0).sum())}
    paths = [("direct NVLink", world, "shm")] + (
        [(f"proxy ({proxy_transport})", 1, proxy_transport)] if with_proxy else []
    )
    for name, rpn, transport in paths:
        say = (lambda what, name=name: progress(f"gpu-ll {name}: {what}")) if rank == 0 else (lambda what: None)
        buf = cuda_ll_buffer(world, T, H, E, rpn, transport)
        # Hook phases queued back to back on the proxy path stop until the kernels time out (not understood
        # yet; their synchronized use passes the GPU tests), so only the direct path times them.
        results[name] = _path_times(buf, x, idx, w, T, E, iterations, rpn > 1, say)
        torch.cuda.current_stream().synchronize()
        buf.destroy()
    if rank == 0:
        progress("gpu-ll: baseline, NCCL all_to_all_single of the same bytes")
    results["NCCL all_to_all_single"] = _nccl_times(x, idx, world, E, H, iterations, nccl)
    return results


def _channel_body(rank, world, warps, per_warp, threads, repeats):
    import torch

    import portep_testing
    from portep import native
    from portep.channel import Channel

    fifos = native.DeviceFifoSet(32, 4096)
    ch = Channel(None, 1 << 20, num_proxy_threads=threads, device=0, device_fifos=fifos)
    rates = []
    stream = torch.cuda.current_stream().cuda_stream
    for r in range(repeats + 1):
        before = sum(s["commands"] for s in ch.stats())
        total = warps * per_warp
        start = time.perf_counter()
        portep_testing.cuda_push_nops(fifos.device_views, fifos.count, warps, per_warp, 30.0, stream)
        while sum(s["commands"] for s in ch.stats()) - before < total:
            if time.perf_counter() - start > 60:
                raise RuntimeError("the proxies did not drain the NOP commands within 60 s")
        seconds = time.perf_counter() - start
        torch.cuda.current_stream().synchronize()
        if r:
            rates.append(total / seconds / 1e6)
    ch.destroy()
    probe = [portep_testing.cuda_fifo_probe(32, threads, warps, per_warp) for _ in range(repeats)]
    return rates, [p["popped"] / p["seconds"] / 1e6 for p in probe], portep_testing.cuda_fifo_rtt(20000)


ROWS = (
    "round trip, back to back",
    "round trip",
    "dispatch",
    "combine",
    "dispatch kernel",
    "combine kernel",
    "dispatch send kernel",
    "dispatch recv kernel",
    "combine send kernel",
    "combine recv kernel",
    "graph round trip",
    "CPU per round trip",
)


def run(
    report, ranks=2, tokens=128, hidden=7168, topk=8, experts=288, iterations=50, proxy_transport="shm", with_proxy=True
):
    import torch

    if torch.cuda.device_count() < ranks:
        raise MissingHardware(f"gpu-ll needs {ranks} GPUs, this machine has {torch.cuda.device_count()}")
    shape = f"EP{ranks}, {tokens} tokens, hidden {hidden}, top-{topk}, {experts} experts, FP8 dispatch, BF16 combine"
    report.say(f"gpu-ll: {shape}; {NOTE}")
    report.progress(f"gpu-ll: starting {ranks} rank processes")
    out = run_ranks(
        _rank_body,
        ranks,
        args=(tokens, hidden, topk, experts, iterations, proxy_transport, with_proxy, report.progress),
        timeout=600,
    )
    for t in ll_tables(out, ranks, shape, hidden, iterations):
        report.add(t)
    return out


def ll_tables(out, ranks, shape, hidden, iterations):
    """One table per path (direct, proxy), each with the NCCL baseline of the same run."""
    r0 = out[0]
    sel = sum(o["selections"] for o in out.values()) / ranks
    fp8_bytes = sel * (hidden + hidden // 128 * 4 + 16)
    bf16_bytes = sel * 2 * hidden
    nbytes = {
        "dispatch": fp8_bytes,
        "combine": bf16_bytes,
        "round trip": fp8_bytes + bf16_bytes,
        "round trip, back to back": fp8_bytes + bf16_bytes,
        "dispatch kernel": fp8_bytes,
        "combine kernel": bf16_bytes,
        "graph round trip": fp8_bytes + bf16_bytes,
    }
    note = (
        f"{NOTE} 'round trip, back to back' is DeepEP's bench() (calls issued without waiting, events around "
        f"each; DeepEP prints the mean, the method behind its 90 us); 'round trip', 'dispatch', 'combine' wait for "
        f"each call, so they add the host's launch time to the GPU's; kernel rows as DeepEP's bench_kineto "
        f"(launches queued behind a GPU sleep, profiler durations); 'CPU per round trip': host time of each eager "
        f"call. {iterations} calls per row. GB/s at the median with DeepEP's bytes."
    )
    direct = r0["direct NVLink"]
    nccl = r0["NCCL all_to_all_single"]
    tables = []
    for path in (k for k in r0 if k not in ("selections", "NCCL all_to_all_single")):
        cols = ("DeepEP V1 us (quoted)",) + (() if path == "direct NVLink" else ("proxy / direct (medians)",))
        t = Table(f"gpu-ll: {path}, {shape}", "us", note, extra_columns=cols)
        for key in (k for k in ROWS if k in r0[path]):
            extra = {"DeepEP V1 us (quoted)": f"{DEEPEP[key]:.1f}" if key in DEEPEP else "-"}
            if path != "direct NVLink":
                extra["proxy / direct (medians)"] = f"{median(r0[path][key]) / median(direct[key]):.2f}x"
            t.add(key, r0[path][key], nbytes.get(key), extra)
        for key in ("dispatch", "combine", "round trip"):
            t.add(f"baseline: NCCL all_to_all_single, {key}", nccl[key], nbytes[key])
        tables.append(t)
    return tables


def run_channel(report, warps=1024, per_warp=2000, threads=4, repeats=5):
    try:
        import portep_testing  # noqa: F401  (the probe kernels: a build with PORTEP_BUILD_TESTING=ON)
    except ImportError:
        report.progress(
            "gpu-ll: command channel skipped: it needs the test hooks, a build with "
            "pip install . -Ccmake.define.PORTEP_BUILD_TESTING=ON"
        )
        return
    report.progress(f"gpu-ll: command channel, {warps} warps push {per_warp} NOP commands each, {repeats} runs")
    rates, probe, latency = run_ranks(_channel_body, 1, args=(warps, per_warp, threads, repeats), timeout=600)[0]
    t = Table(
        f"gpu-ll: command channel through the real proxy threads, {threads} proxy threads",
        "M cmd/s",
        f"one GPU and this host's CPUs: {warps} warps push {per_warp} NOP commands each into 32 device FIFOs "
        f"(mapped host memory), {threads} proxy threads pop and handle them. Samples: one rate per run. "
        f"Baseline: the same commands popped by {threads} bare consumer threads (gpu-fifo's probe: no proxy, no "
        "Channel).",
    )
    t.add("NOP commands through the proxies", rates)
    t.add("baseline: FIFO probe, bare consumer threads", probe)
    t.line(
        "quoted, not this run: the untuned probe on the H200 machine (reference/gpu-machine.md): 57.3 M cmd/s "
        "with 32 FIFOs and 4 threads"
    )
    for line in command_latency_lines(latency):  # the proxies' FIFO consumer loop, in a thread of its own
        t.line(line)
    report.add(t)
