"""Per-rank bodies of the two-GPU LL tests that have no host-backend twin: the CUDA backend against the host
backend on the same inputs, CUDA-graph capture and replay, and a peer that never arrives."""

import torch
import torch.distributed as dist

import deepep_reference as ref
import deepep_workers as w
import portep

BF16 = torch.bfloat16


def _buffers(rank, world, rpn, transport, T, H, E, allow_nvlink=True, with_host=True, timeout_s=60):
    torch.cuda.set_device(rank % torch.cuda.device_count())
    nbytes = portep.Buffer.get_low_latency_rdma_size_hint(T, H, world, E)
    gpu = portep.Buffer(dist.group.WORLD, 0, nbytes, low_latency_mode=True, num_ranks_per_node=rpn,
                        allow_nvlink_for_low_latency_mode=allow_nvlink, transport=transport, timeout_s=timeout_s,
                        explicitly_destroy=True, backend="cuda")
    host = portep.Buffer(dist.group.WORLD, 0, nbytes, low_latency_mode=True, num_ranks_per_node=rpn,
                         transport=transport, timeout_s=timeout_s, explicitly_destroy=True,
                         backend="host") if with_host else None
    return gpu, host


def _cpu(t):
    # Synchronize first: a blocking copy to pageable memory would hold up the proxies' copy-engine work (see
    # cuda_backend's caveat) that a still-running receive kernel waits for.
    torch.cuda.current_stream().synchronize()
    return t.cpu()


def _bytes(t):
    return ref.dense(_cpu(t)).contiguous().view(torch.uint8)


def cross_backend_body(rank, world, rpn, transport, allow_nvlink, seed, T, H, E, K, timeout_s=60):
    """Every LL output of the CUDA backend equals the host backend's bit for bit on the same inputs (rows past
    recv_count are undefined in both, as in DeepEP)."""
    ck = w.Checker(rank)
    gpu, host = _buffers(rank, world, rpn, transport, T, H, E, allow_nvlink, timeout_s=timeout_s)
    inp = w.make_ll_inputs(rank, seed, T, H, K, E)
    x, idx, wts = inp["x_rand"], inp["idx"], inp["w"]
    for fp8, rnd, ue in ((False, False, False), (True, False, False), (True, True, False), (True, True, True)):
        ck.step = f"fp8={fp8} round_scale={rnd} ue8m0={ue}"
        res_h = host.low_latency_dispatch(x, idx, T, E, use_fp8=fp8, round_scale=rnd, use_ue8m0=ue)
        res_g = gpu.low_latency_dispatch(x.cuda(), idx.cuda(), T, E, use_fp8=fp8, round_scale=rnd, use_ue8m0=ue)
        torch.cuda.current_stream().synchronize()
        parts_h = list(res_h[0]) if fp8 else [res_h[0]]
        parts_g = list(res_g[0]) if fp8 else [res_g[0]]
        counts = res_h[1]
        for name, a, b in [("recv_count", res_g[1], res_h[1]), ("layout_range", res_g[2][1], res_h[2][1])]:
            ck.equal(name, _cpu(a), b)
        for e in range(counts.numel()):
            n = int(counts[e])
            ck.equal(f"src_info of expert {e}", _cpu(res_g[2][0][e, :n]), res_h[2][0][e, :n])
            for i, (pg, ph) in enumerate(zip(parts_g, parts_h)):
                ck.equal(f"recv_x[{i}] rows of expert {e}", _bytes(pg[e, :n]), _bytes(ph[e, :n]))
        sim = w._ll_sim_x(res_h[0], counts, fp8, False)
        comb_h = host.low_latency_combine(sim, idx, wts, res_h[2])[0]
        comb_g = gpu.low_latency_combine(sim.cuda(), idx.cuda(), wts.cuda(), res_g[2])[0]
        ck.equal("combined_x", _cpu(comb_g), comb_h)
    ck.no_kernel_failure(gpu)
    gpu.destroy()
    host.destroy()
    return {"failures": ck.failures, "checks": ck.num_checks}


def graph_body(rank, world, rpn, transport, allow_nvlink, seed, T, H, E, K):
    """LL dispatch + combine captured in one CUDA graph; replays on new inputs match eager calls bit for bit."""
    ck = w.Checker(rank)
    gpu, _ = _buffers(rank, world, rpn, transport, T, H, E, allow_nvlink, with_host=False)
    inp = w.make_ll_inputs(rank, seed, T, H, K, E)
    x = inp["x_rand"].cuda()
    idx, wts = inp["idx"].cuda(), inp["w"].cuda()

    def step():
        recv_x, count, handle, _, _ = gpu.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        return gpu.low_latency_combine(recv_x, idx, wts, handle)[0]

    step()  # warm-up outside the capture (both halves get used once)
    step()
    torch.cuda.current_stream().synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_graph = step()
    torch.cuda.current_stream().synchronize()
    dist.barrier()
    for r in range(4):
        ck.step = f"replay {r}"
        fresh = w.make_ll_inputs(rank, seed + 100 + r, T, H, K, E)["x_rand"]
        x.copy_(fresh)
        graph.replay()
        torch.cuda.current_stream().synchronize()
        got = _cpu(out_graph)
        ck.diff_below("replayed combine vs x * sum(w)", got, ref.ll_combine_ref(fresh, inp["idx"], inp["w"]), 1e-5)
        ck.equal("replay vs eager", got, _cpu(step()))
    ck.no_kernel_failure(gpu)
    gpu.destroy()
    return {"failures": ck.failures, "checks": ck.num_checks}


def missing_peer_body(rank, world, transport, allow_nvlink):
    """Rank 1 never dispatches: rank 0's kernel gives up after the timeout and the next call raises."""
    T, H, E = 8, 512, 4
    gpu, _ = _buffers(rank, world, 1 if not allow_nvlink else world, transport, T, H, E, allow_nvlink,
                      with_host=False, timeout_s=2)
    message = ""
    if rank == 0:
        x = torch.randn(T, H).to(BF16).cuda()
        idx = torch.arange(T * 2).view(T, 2).remainder(E).cuda()
        gpu.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        torch.cuda.current_stream().synchronize()
        try:
            gpu.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        except RuntimeError as e:
            message = str(e)
    dist.barrier()
    gpu.destroy()
    return message


def validation_cache_body(rank, world):
    """A call signature that passed validation is not checked again, but any change of shape, dtype, layout
    or option is, and a bad call still raises after good ones."""
    T, H, E = 16, 512, 8
    gpu, _ = _buffers(rank, world, world, "shm", T, H, E, with_host=False)
    x = torch.randn(T, H).to(BF16).cuda()
    idx = torch.arange(T * 2).view(T, 2).remainder(E).cuda()
    errors = []
    for _ in range(2):
        gpu.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    bad_calls = {
        "float32 x": lambda: gpu.low_latency_dispatch(x.float(), idx, T, E, use_fp8=False),
        "too many tokens": lambda: gpu.low_latency_dispatch(torch.cat([x, x]), torch.cat([idx, idx]), T, E,
                                                            use_fp8=False),
        "int32 topk_idx": lambda: gpu.low_latency_dispatch(x, idx.int(), T, E, use_fp8=False),
        "float T": lambda: gpu.low_latency_dispatch(x, idx, float(T), E, use_fp8=False),
        "strided x": lambda: gpu.low_latency_dispatch(torch.randn(T, 2 * H).to(BF16).cuda()[:, ::2], idx, T, E,
                                                      use_fp8=False),
    }
    for name, call in bad_calls.items():
        try:
            call()
            errors.append(f"{name}: accepted")
        except (TypeError, ValueError):
            pass
    recv_x, _, handle, _, _ = gpu.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    gpu.low_latency_combine(recv_x, idx, torch.rand(T, 2).cuda(), handle)
    try:
        gpu.low_latency_combine(recv_x, idx, torch.rand(T, 3).cuda(), handle)
        errors.append("combine with [T, 3] topk_weights: accepted")
    except ValueError:
        pass
    torch.cuda.current_stream().synchronize()
    gpu.destroy()
    return errors
