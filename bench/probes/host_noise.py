"""Why the host's mean time per LL call is about twice its median (bench/results/RESULTS.md, fifth session).
One rank, one GPU. Per-call durations (median, mean, p90, p99, max in microseconds) of:
  python     a fixed piece of pure-Python work (the host's own noise, nothing CUDA)
  allocs     the six torch.empty calls of an LL round trip
  rt-synced  a Buffer round trip (dispatch + combine) started with the GPU idle (host time of the calls alone)
  rt-b2b     back-to-back Buffer round trips (DeepEP's bench loop), each call timed
first without portep, then with a Buffer alive (its proxy threads running), then with the main thread pinned to
one core. Also prints the CPU topology the process may use and each thread's CPU time over an idle second (do
idle proxy threads burn cores?). Run from the repository root: python bench/probes/host_noise.py [calls]"""
import os
import statistics
import sys
import time

sys.path.insert(0, "bench")
from portep_bench.spawn import run_ranks  # noqa: E402
from portep_bench.stats import call_durations_us, median, percentile  # noqa: E402


def summary(values):
    return (f"median {median(values):7.2f}  mean {statistics.fmean(values):7.2f}  p90 {percentile(values, 90):7.2f}  "
            f"p99 {percentile(values, 99):8.2f}  max {max(values):8.2f}")


def thread_cpu_seconds():
    """{thread id: (name, user + system CPU seconds)} of this process."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[tid] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def idle_thread_load(seconds=1.0):
    before = thread_cpu_seconds()
    time.sleep(seconds)
    after = thread_cpu_seconds()
    loads = sorted(((after[t][1] - before[t][1]) / seconds, after[t][0]) for t in after if t in before)
    return [f"{name}:{load:.2f}" for load, name in reversed(loads) if load > 0.01] or ["none above 1% of a core"]


def cpu_topology():
    cpus = sorted(os.sched_getaffinity(0))
    siblings = set()
    for c in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list") as f:
                siblings.add(f.read().strip())
        except OSError:
            pass
    return f"{len(cpus)} CPUs allowed ({cpus[0]}..{cpus[-1]}); SMT sibling groups: {sorted(siblings)[:6]}..."


def body(rank, world, calls):
    import torch

    from portep_bench.ll_gpu import cuda_ll_buffer, ll_inputs, round_trip_allocs

    T, H, K, E = 128, 7168, 8, 288
    lines = [cpu_topology()]
    dev = torch.device("cuda", 0)
    E_l, M = E, T * world  # one rank holds every expert

    def python_work():
        s = 0
        for i in range(300):
            s += i * i
        return s

    allocs = round_trip_allocs(T, H, E_l, M, world, dev)

    lines.append(f"threads busy over an idle second, before the Buffer: {idle_thread_load()}")
    lines.append(f"python     no Buffer  {summary(call_durations_us(python_work, calls))}")
    lines.append(f"allocs     no Buffer  {summary(call_durations_us(allocs, calls))}")
    x, idx, w = ll_inputs(rank, T, H, K, E)
    buf = cuda_ll_buffer(world, T, H, E, world, "shm")
    rx = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)[0]
    torch.cuda.synchronize()
    lines.append(f"threads busy over an idle second, Buffer alive: {idle_thread_load()}")

    def round_trip():
        buf.low_latency_combine(rx, idx, w, buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)[2])

    def synced_round_trip():
        torch.cuda.synchronize()
        t = time.perf_counter_ns()
        round_trip()
        return (time.perf_counter_ns() - t) / 1e3

    for label in ("Buffer", "Buffer, main thread pinned"):
        lines.append(f"python     {label:26s} {summary(call_durations_us(python_work, calls))}")
        lines.append(f"allocs     {label:26s} {summary(call_durations_us(allocs, calls))}")
        lines.append(f"rt-synced  {label:26s} {summary([synced_round_trip() for _ in range(calls // 4)])}")
        lines.append(f"rt-b2b     {label:26s} {summary(call_durations_us(round_trip, calls // 4))}")
        torch.cuda.synchronize()
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    buf.destroy()
    return lines


if __name__ == "__main__":
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    for line in run_ranks(body, 1, args=(calls,), timeout=600)[0]:
        print(line, flush=True)
