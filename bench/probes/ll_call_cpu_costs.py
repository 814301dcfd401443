"""Host time of the pieces of one LL call on the CUDA backend (1 rank, one GPU): torch allocation, stream lookup,
a pybind kernel launch, validation, and whole Buffer/engine calls. Medians of a few hundred calls, microseconds.
Run from the repository root: python bench/probes/ll_call_cpu_costs.py"""
import sys

sys.path.insert(0, "bench")
from portep_bench.spawn import run_ranks
from portep_bench.stats import call_durations_us, median


def tm(fn, n=300):
    return median(call_durations_us(fn, n))


def body(rank, world):
    import torch, torch.distributed as dist, portep
    from portep import native
    torch.cuda.set_device(0)
    T, H, K, E = 128, 7168, 8, 288
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()
    idx = torch.topk(torch.randn(T, E, generator=g).abs() + 1, K, dim=-1).indices.cuda()
    w = torch.rand(T, K, generator=g).cuda()
    out = []
    s = torch.cuda.current_stream()
    out.append(f"torch.empty(int32 [144,256]) {tm(lambda: torch.empty(144, 256, dtype=torch.int32, device='cuda')):.2f} us")
    dev = torch.device("cuda", 0)
    out.append(f"torch.empty(device obj) {tm(lambda: torch.empty(144, 256, dtype=torch.int32, device=dev)):.2f} us")
    out.append(f"current_stream().cuda_stream {tm(lambda: torch.cuda.current_stream().cuda_stream):.2f} us")
    out.append(f"_cuda_getCurrentRawStream {tm(lambda: torch._C._cuda_getCurrentRawStream(0)):.2f} us")
    out.append(f"x.contiguous() {tm(lambda: x.contiguous()):.2f} us")
    out.append(f"x.data_ptr() {tm(lambda: x.data_ptr()):.2f} us")
    y = torch.empty(1, device="cuda")
    out.append(f"torch y.zero_() (1 launch) {tm(lambda: y.zero_()):.2f} us")
    nbytes = portep.Buffer.get_low_latency_rdma_size_hint(T, H, world, E)
    buf = portep.Buffer(dist.group.WORLD, 0, nbytes, low_latency_mode=True, explicitly_destroy=True, backend="cuda")
    eng = buf.runtime
    per_rank = torch.empty(1, dtype=torch.int32, device="cuda")
    per_expert = torch.empty(E, dtype=torch.int32, device="cuda")
    in_rank = torch.empty(T, 1, dtype=torch.bool, device="cuda")
    sp = s.cuda_stream
    out.append(f"pybind layout kernel call {tm(lambda: native.cuda_dispatch_layout(idx.data_ptr(), T, K, E, 1, 1, per_rank.data_ptr(), 0, per_expert.data_ptr(), in_rank.data_ptr(), sp)):.2f} us")
    out.append(f"buf.get_dispatch_layout {tm(lambda: buf.get_dispatch_layout(idx, E)):.2f} us")
    rx = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)[0]
    rt = lambda: buf.low_latency_combine(rx, idx, w, buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)[2])
    out.append(f"round trip (bf16, 1 rank) CPU {tm(rt, 100):.2f} us")
    s.synchronize()
    out.append(f"buf.low_latency_dispatch {tm(lambda: buf.low_latency_dispatch(x, idx, T, E, use_fp8=True), 100):.2f} us")
    s.synchronize()
    out.append(f"eng.low_latency_dispatch {tm(lambda: eng.low_latency_dispatch(x, idx, T, E, True, False, False, None, None, False), 100):.2f} us")
    s.synchronize()
    h = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)[2]
    s.synchronize()
    out.append(f"buf.low_latency_combine {tm(lambda: buf.low_latency_combine(rx, idx, w, h), 100):.2f} us")
    s.synchronize()
    out.append(f"eng.low_latency_combine {tm(lambda: eng.low_latency_combine(rx, idx, w, h, False, None, False, None), 100):.2f} us")
    s.synchronize()
    out.append(f"eng.check_error {tm(eng.check_error):.2f} us")
    lay = eng._layout(T, H, E)
    out.append(f"eng._shape {tm(lambda: eng._shape(lay, 0, 0)):.2f} us")
    import portep.validation as v
    out.append(f"v.check_ll_x {tm(lambda: v.check_ll_x(x, T, False, buf._device)):.2f} us")
    out.append(f"v.check_topk_idx {tm(lambda: v.check_topk_idx('topk_idx', idx, E, num_tokens=T, limit_note='', device=buf._device)):.2f} us")
    s.synchronize()
    buf.destroy()
    return "\n".join(out)


if __name__ == "__main__":
    print(run_ranks(body, 1, timeout=120)[0])
