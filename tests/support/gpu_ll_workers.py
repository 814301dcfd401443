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
    gpu = portep.Buffer(
        dist.group.WORLD,
        0,
        nbytes,
        low_latency_mode=True,
        num_ranks_per_node=rpn,
        allow_nvlink_for_low_latency_mode=allow_nvlink,
        transport=transport,
        timeout_s=timeout_s,
        explicitly_destroy=True,
        backend="cuda",
    )
    host = (
        portep.Buffer(
            dist.group.WORLD,
            0,
            nbytes,
            low_latency_mode=True,
            num_ranks_per_node=rpn,
            transport=transport,
            timeout_s=timeout_s,
            explicitly_destroy=True,
            backend="host",
        )
        if with_host
        else None
    )
    return gpu, host


def _cpu(t):
    # Synchronize first: a blocking copy to pageable memory would hold up the proxies' copy-engine work (see
    # cuda_backend's caveat) that a still-running receive kernel waits for.
    torch.cuda.current_stream().synchronize()
    return t.cpu()


def _bytes(t):
    return ref.dense(_cpu(t)).contiguous().view(torch.uint8)


def experts_view(x, use_fp8, round_scale):
    """x [N, H] (BF16, CPU) as an LL dispatch hands it to the experts: itself, or its FP8 round trip through
    DeepEP's kernel cast (ref.ll_fp8_round_trip). UE8M0 packing changes no value."""
    return ref.ll_fp8_round_trip(x, round_scale) if use_fp8 else x


def check_ll_combined(ck, name, got, x_seen, idx, weights, rank):
    """One check: got (BF16, CPU) is the float64 combine of the test experts' outputs for this rank's tokens
    (ref.ll_combine_expert_ref of x as the experts saw it), within BF16 rounding and FP32 accumulation."""
    ref64, abs64 = ref.ll_combine_expert_ref(x_seen, idx, weights, rank)
    if got.shape != ref64.shape:
        return ck.true(False, f"{name}: shape {tuple(got.shape)}, expected {tuple(ref64.shape)}")
    bad = ref.combine_mismatch(got, ref64, abs64, num_terms=idx.size(1))
    return ck.true(
        not bool(bad.any()),
        f"{name}: {describe_mismatch(bad, got, ref64)} elements are not the weighted sum of the experts' outputs",
    )


def describe_mismatch(bad, got, ref64):
    """'n/total (first at [i, j]: got g, expected e)' for a 2-D mask of bad elements; '0' when none is."""
    if not bad.any():
        return "0"
    i, j = bad.nonzero()[0].tolist()
    return (
        f"{int(bad.sum())}/{bad.numel()} (first at [{i}, {j}]: got {got[i, j].item()}, expected "
        f"{ref64[i, j].item():.6g})"
    )


def expert_coefficients(layout_range, rank, num_rows):
    """Per received row of an LL dispatch, the test experts' float32 factor and offset (ref.expert_output): two
    [E_l, num_rows, 1] tensors; rows past the sources' blocks (never combined) get 1 and 0. On the GPU,
    (recv_x.float() * factor + offset).to(BF16) is then ref.ll_expert_outputs bit for bit (IEEE float32 mul, add)."""
    e_l = layout_range.size(0)
    factor, offset = torch.ones(e_l, num_rows, 1), torch.zeros(e_l, num_rows, 1)
    for e in range(e_l):
        for j in range(layout_range.size(1)):
            begin, count = int(layout_range[e, j]) >> 32, int(layout_range[e, j]) & 0xFFFFFFFF
            factor[e, begin : begin + count] = ref.expert_factor(rank * e_l + e)
            offset[e, begin : begin + count] = ref.expert_offset(rank * e_l + e, j)
    return factor, offset


def cross_backend_body(rank, world, rpn, transport, allow_nvlink, seed, T, H, E, K, timeout_s=60):
    """Every LL output of the CUDA backend equals the host backend's bit for bit on the same inputs (rows past
    recv_count are undefined in both, as in DeepEP). Both combine the test experts' outputs of the host's received
    rows (ref.ll_expert_outputs: distinct per expert and source rank), and the CUDA combined_x is checked against
    their float64 weighted sum too (ref.ll_combine_expert_ref)."""
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
        y = ref.ll_expert_outputs(w._ll_sim_x(res_h[0], counts, fp8, False), res_h[2][1], rank)
        comb_h = host.low_latency_combine(y, idx, wts, res_h[2])[0]
        comb_g = _cpu(gpu.low_latency_combine(y.cuda(), idx.cuda(), wts.cuda(), res_g[2])[0])
        ck.equal("combined_x", comb_g, comb_h)
        check_ll_combined(ck, "combined_x", comb_g, experts_view(x, fp8, rnd), idx, wts, rank)
    ck.no_kernel_failure(gpu)
    gpu.destroy()
    host.destroy()
    return {"failures": ck.failures, "checks": ck.num_checks}


def graph_body(rank, world, rpn, transport, allow_nvlink, seed, T, H, E, K):
    """LL dispatch + combine captured in one CUDA graph, the test experts' outputs computed on the GPU between them
    (from each row's expert and source, read once from an eager call's layout_range: idx is fixed, so the rows land
    in the same places every call); replays on new inputs keep that layout_range, match eager calls bit for bit
    and are the float64 weighted sum of the experts' outputs (ref.ll_combine_expert_ref)."""
    ck = w.Checker(rank)
    gpu, _ = _buffers(rank, world, rpn, transport, T, H, E, allow_nvlink, with_host=False)
    inp = w.make_ll_inputs(rank, seed, T, H, K, E)
    x = inp["x_rand"].cuda()
    idx, wts = inp["idx"].cuda(), inp["w"].cuda()
    coefficients = []  # [factor, offset] on the GPU, from the first call's layout_range
    layout = []

    def step():
        recv_x, _, handle, _, _ = gpu.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        if not coefficients:  # the first call, eager
            layout.append(_cpu(handle[1]))
            coefficients.extend(t.cuda() for t in expert_coefficients(layout[0], rank, recv_x.size(1)))
        y = (recv_x.float() * coefficients[0] + coefficients[1]).to(BF16)
        return gpu.low_latency_combine(y, idx, wts, handle)[0], handle[1]

    step()  # warm-up outside the capture (both halves get used once)
    step()
    torch.cuda.current_stream().synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_graph, layout_graph = step()
    torch.cuda.current_stream().synchronize()
    dist.barrier()
    for r in range(4):
        ck.step = f"replay {r}"
        fresh = w.make_ll_inputs(rank, seed + 100 + r, T, H, K, E)["x_rand"]
        x.copy_(fresh)
        graph.replay()
        torch.cuda.current_stream().synchronize()
        got = _cpu(out_graph)
        ck.equal("replayed layout_range vs the first call's", _cpu(layout_graph), layout[0])
        check_ll_combined(ck, "replayed combined_x", got, fresh, inp["idx"], inp["w"], rank)
        ck.equal("replay vs eager", got, _cpu(step()[0]))
    ck.no_kernel_failure(gpu)
    gpu.destroy()
    return {"failures": ck.failures, "checks": ck.num_checks}


def missing_peer_body(rank, world, transport, allow_nvlink):
    """Rank 1 never dispatches: rank 0's kernel gives up after the timeout and the next call raises."""
    T, H, E = 8, 512, 4
    gpu, _ = _buffers(
        rank, world, 1 if not allow_nvlink else world, transport, T, H, E, allow_nvlink, with_host=False, timeout_s=2
    )
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
        "too many tokens": lambda: gpu.low_latency_dispatch(
            torch.cat([x, x]), torch.cat([idx, idx]), T, E, use_fp8=False
        ),
        "int32 topk_idx": lambda: gpu.low_latency_dispatch(x, idx.int(), T, E, use_fp8=False),
        "float T": lambda: gpu.low_latency_dispatch(x, idx, float(T), E, use_fp8=False),
        "strided x": lambda: gpu.low_latency_dispatch(
            torch.randn(T, 2 * H).to(BF16).cuda()[:, ::2], idx, T, E, use_fp8=False
        ),
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
