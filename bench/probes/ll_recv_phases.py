"""GPU time of the LL hook's receive-phase kernels (dispatch recv, combine recv), measurable with every rank on
ONE GPU: all ranks run the send phases together, then each rank's receive phase runs alone while the others wait
in a host barrier, so no other context time-slices the GPU during it. A receive phase reads only this GPU's
memory (the messages already arrived), as on separate GPUs. The send phases time-slice here and store into the
same GPU instead of over NVLink; only the dispatch send phase, which waits for no peer, is run alone and reported,
as a figure to compare builds by, not with DeepEP. DeepEP shape (128 tokens, hidden 7168, top-8, 288 experts,
EP2), FP8 dispatch, BF16 combine; medians of kernel durations from torch's profiler (as DeepEP's bench_kineto).
Run from the repository root: python bench/probes/ll_recv_phases.py [iterations] [direct]"""
import sys
import time

sys.path.insert(0, "bench")
from portep_bench.spawn import run_ranks  # noqa: E402
from portep_bench.stats import median  # noqa: E402

DEEPEP_US = {"dispatch recv kernel": 8.2, "combine recv kernel": 9.7}  # reference/gpu-machine.md


def body(rank, world, iterations, ranks_per_node):
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from portep_bench.ll_gpu import cuda_ll_buffer, kernel_durations, ll_inputs

    torch.cuda.set_device(rank % torch.cuda.device_count())
    T, H, K, E = 128, 7168, 8, 288
    x, idx, w = ll_inputs(rank, T, H, K, E)
    buf = cuda_ll_buffer(world, T, H, E, ranks_per_node, "shm")
    first = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)
    sim = first[0][0].to(torch.bfloat16)
    stream = torch.cuda.current_stream()

    def settle():
        stream.synchronize()
        time.sleep(0.002)  # the proxies' copies (proxy path) land before any receive phase starts
        dist.barrier()

    def alone(hook):
        """Runs hook on this rank while every other rank waits in the barrier."""
        for r in range(world):
            if r == rank:
                hook()
                stream.synchronize()
            dist.barrier()

    def iteration():
        calls = []
        alone(lambda: calls.append(buf.low_latency_dispatch(x, idx, T, E, use_fp8=True, return_recv_hook=True)))
        d = calls[0]
        settle()
        alone(d[4])
        c = buf.low_latency_combine(sim, idx, w, d[2], return_recv_hook=True)
        settle()
        alone(c[2])

    for _ in range(3):
        iteration()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iterations):
            iteration()
    durations = kernel_durations(prof)
    buf.destroy()
    if len(durations) != 4 * iterations:
        raise RuntimeError(f"the profiler saw {len(durations)} LL kernels, expected {4 * iterations}")
    return {"dispatch send kernel": median(durations[0::4]), "dispatch recv kernel": median(durations[1::4]),
            "combine recv kernel": median(durations[3::4])}


if __name__ == "__main__":
    iterations = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    paths = ((2, "direct NVLink"), (1, "forced proxy (shm)"))
    if len(sys.argv) > 2 and sys.argv[2] == "direct":
        paths = paths[:1]
    for rpn, path in paths:
        out = run_ranks(body, 2, args=(iterations, rpn), timeout=600)
        for label, deepep in DEEPEP_US.items():
            print(f"{path:20s} {label}: " + ", ".join(f"rank {r} {out[r][label]:.1f} us" for r in sorted(out)) +
                  f" (median of {iterations}; DeepEP V1 {deepep} us)", flush=True)
        label = "dispatch send kernel"
        print(f"{path:20s} {label}, alone: " + ", ".join(f"rank {r} {out[r][label]:.1f} us" for r in sorted(out)) +
              f" (median of {iterations}; stores into this GPU, not over NVLink)", flush=True)
