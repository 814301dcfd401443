"""Where the forced proxy path spends its time (DeepEP's LL shape, two GPUs, one per "node"): per call, the GPU
time of a fused dispatch and a fused combine (events, each call waited for), and the proxy threads' counters
over those calls: commands, bytes, polls, time inside the transport's post and poll calls, and the mean and
largest time from an operation's post to the poll that saw it complete. Per rank.
Run from the repository root: python bench/probes/ll_proxy_stats.py [TRANSPORT] [ITERATIONS]"""
import sys

sys.path.insert(0, "bench")
from portep_bench.spawn import run_ranks

COUNTERS = ("commands", "writes", "signals", "bytes", "notices", "polls", "post_ns", "poll_ns", "completed",
            "op_latency_ns")


def _totals(buf):
    stats = buf.runtime.channel.stats()
    out = {k: sum(s[k] for s in stats) for k in COUNTERS}
    out["op_latency_max_ns"] = max(s["op_latency_max_ns"] for s in stats)
    return out


def _describe(name, us, before, after, calls):
    d = {k: after[k] - before[k] for k in COUNTERS}
    per = lambda k: d[k] / calls
    lat = d["op_latency_ns"] / max(d["completed"], 1) / 1e3
    return (f"{name}: median {us:.1f} us/call; per call: {per('commands'):.0f} commands ({per('writes'):.0f} writes, "
            f"{per('signals'):.0f} signals, {per('bytes') / 1e6:.2f} MB), {per('polls'):.0f} polls, "
            f"{per('post_ns') / 1e3:.1f} us in posts, {per('poll_ns') / 1e3:.1f} us in polls (all threads); "
            f"post->complete mean {lat:.1f} us, max so far {after['op_latency_max_ns'] / 1e3:.1f} us")


def body(rank, world, transport, iters, T, H, K, E):
    import statistics

    import torch
    import torch.distributed as dist

    from portep_bench.ll_gpu import _once, cuda_ll_buffer, ll_inputs
    torch.cuda.set_device(rank)
    x, idx, w = ll_inputs(rank, T, H, K, E)
    buf = cuda_ll_buffer(world, T, H, E, 1, transport)
    sim = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)[0][0].to(torch.bfloat16)
    handle = None

    def dispatch():
        nonlocal handle
        handle = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)[2]

    def combine():
        buf.low_latency_combine(sim, idx, w, handle)

    lines = []
    for name, fn in (("dispatch", dispatch), ("combine", combine)):
        times = []
        torch.cuda.synchronize()
        dist.barrier()
        before = _totals(buf)
        for _ in range(iters):
            if name == "combine":
                dispatch()
                torch.cuda.synchronize()
                dist.barrier()
            times.append(_once(fn)[0])
            dist.barrier()
        after = _totals(buf)
        if name == "combine":  # take the dispatches' share out: they were counted between the same snapshots
            lines.append("(combine counters include one dispatch per call)")
        lines.append(_describe(name, statistics.median(times), before, after, iters))
    torch.cuda.synchronize()
    buf.destroy()
    return "\n".join(lines)


if __name__ == "__main__":
    transport = sys.argv[1] if len(sys.argv) > 1 else "shm"
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    out = run_ranks(body, 2, args=(transport, iters, 128, 7168, 8, 288), timeout=300)
    print(f"===== proxy path, transport={transport}, {iters} calls each")
    for r in sorted(out):
        print(f"--- rank {r}:\n{out[r]}", flush=True)
