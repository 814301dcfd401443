"""GPU time of each LL kernel with the host out of the way (DeepEP's shape, two GPUs), per rank: fused launches
(send + receive) and hook phases (send, then receive), queued behind a GPU sleep (portep_bench.ll_gpu's
kernel_times). On the proxy path the queued hook phases stop until the kernels time out; run it with
PORTEP_TIMEOUT_S=5 to see the error. Run from the repository root:
python bench/probes/ll_kernel_times.py RANKS_PER_NODE TRANSPORT"""
import sys

sys.path.insert(0, "bench")
from portep_bench.spawn import run_ranks


def body(rank, world, rpn, transport, T, H, K, E, reps):
    import torch
    from portep_bench.ll_gpu import cuda_ll_buffer, kernel_times, ll_inputs
    torch.cuda.set_device(rank)
    x, idx, w = ll_inputs(rank, T, H, K, E)
    buf = cuda_ll_buffer(world, T, H, E, rpn, transport)
    sim = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)[0][0].to(torch.bfloat16)

    def fused():
        buf.low_latency_combine(sim, idx, w, buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)[2])

    def hooked():
        d = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True, return_recv_hook=True)
        d[4]()
        c = buf.low_latency_combine(sim, idx, w, d[2], return_recv_hook=True)
        c[2]()

    out = kernel_times(fused, ("dispatch", "combine"), reps)
    out.update(kernel_times(hooked, ("dispatch send", "dispatch recv", "combine send", "combine recv"), reps))
    torch.cuda.current_stream().synchronize()
    buf.destroy()
    return ", ".join(f"{k} {v:.1f} us" for k, v in out.items())


if __name__ == "__main__":
    rpn, transport = int(sys.argv[1]), sys.argv[2]
    out = run_ranks(body, 2, args=(rpn, transport, 128, 7168, 8, 288, 30), timeout=240)
    print(f"===== rpn={rpn} transport={transport}")
    for r in sorted(out):
        print(f"--- rank {r}: {out[r]}", flush=True)
