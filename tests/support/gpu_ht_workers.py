"""Per-rank bodies of the GPU HT tests that have no host-backend twin: the CUDA backend against the host backend
on the same inputs (bit for bit), num_worst_tokens dispatch + combine captured in a CUDA graph and replayed on new
inputs, normal and LL ops on one Buffer, and a peer that never comes.

Combines take the test experts' outputs (deepep_reference.ht_expert_outputs / ll_expert_outputs: distinct per
receiving rank, or expert, and source rank) and recv_topk_weights with (rank + 1) in the other ranks' slots, and
their results are checked against float64 references too (ht_combine_expert_ref, ht_combine_weights_ref with
fill_by_rank, ll_combine_expert_ref), not only against the host backend's."""

import torch
import torch.distributed as dist

import deepep_reference as ref
import deepep_workers as w
import portep
from gpu_ll_workers import check_ll_combined, describe_mismatch

BF16 = torch.bfloat16


def _buffers(rank, world, rpn, transport, with_host=True, gpu_bytes=None, host_bytes=None):
    torch.cuda.set_device(rank % torch.cuda.device_count())
    gpu = portep.Buffer(
        dist.group.WORLD,
        gpu_bytes or w.HT_NVL_BYTES,
        0,
        num_ranks_per_node=rpn,
        transport=transport,
        timeout_s=60,
        explicitly_destroy=True,
        backend="cuda",
    )
    host = (
        portep.Buffer(
            dist.group.WORLD,
            host_bytes or w.HT_NVL_BYTES,
            0,
            num_ranks_per_node=rpn,
            transport=transport,
            timeout_s=60,
            explicitly_destroy=True,
            backend="host",
        )
        if with_host
        else None
    )
    return gpu, host


def _cpu(v):
    torch.cuda.current_stream().synchronize()
    if isinstance(v, (tuple, list)):
        return type(v)(_cpu(t) for t in v)
    return v.cpu() if torch.is_tensor(v) else v


def _gpu(v):
    if isinstance(v, tuple):
        return tuple(_gpu(t) for t in v)
    return v.cuda() if torch.is_tensor(v) else v


def _same(ck, name, got, exp):
    """Bitwise equality of tensors (or tuples of them), None with None."""
    if exp is None or got is None:
        ck.true(got is None and exp is None, f"{name}: got {type(got).__name__}, expected {type(exp).__name__}")
        return
    if isinstance(exp, tuple):
        for i, (g, e) in enumerate(zip(got, exp)):
            _same(ck, f"{name}[{i}]", g, e)
        return
    if isinstance(exp, list):
        ck.true(got == exp, f"{name}: {got!r:.120} != {exp!r:.120}")
        return
    g = _cpu(got)
    if ck.true(
        g.shape == exp.shape and g.dtype == exp.dtype,
        f"{name}: {g.dtype}{tuple(g.shape)} vs {exp.dtype}{tuple(exp.shape)}",
    ):
        ck.true(
            torch.equal(ref.dense(g).contiguous().view(torch.uint8), ref.dense(exp).contiguous().view(torch.uint8))
            if g.numel()
            else True,
            f"{name}: not bitwise equal to the host backend's",
        )


def _expert_outputs(recv_x, handle, rank):
    """The test experts' outputs (ref.ht_expert_outputs) of a normal dispatch's received BF16 rows (CPU)."""
    return ref.ht_expert_outputs(recv_x, rank, ref.ht_recv_src_ranks(handle, rank, recv_x.size(0)))


def _expert_coefficients(rank, src_ranks, num_rows):
    """The test experts' float32 factor and offset (ref.expert_output) per received row, as [num_rows, 1] tensors
    (rows past len(src_ranks) get 1 and 0): (recv_x.float() * factor + offset).to(BF16) on the GPU is then
    ref.ht_expert_outputs bit for bit (IEEE float32 mul, add)."""
    factor, offset = torch.ones(num_rows, 1), torch.zeros(num_rows, 1)
    m = src_ranks.numel()
    factor[:m] = ref.expert_factor(rank)
    offset[:m, 0] = ref.expert_offset(rank, src_ranks)
    return factor, offset


def _filled_weights(recv_w, recv_idx, rank):
    """recv_topk_weights with (rank + 1) in the slots of other ranks' experts (recv_topk_idx -1), so that each
    receiving rank's echo shows in combined_topk_weights (ref.ht_combine_weights_ref, fill_by_rank=True)."""
    return recv_w.masked_fill(recv_idx == -1, rank + 1.0)


def _check_combined_x(ck, name, got, x, is_in, rank, bias=None):
    """One check: combined_x (CPU) is the float64 sum over the receiving ranks of the experts' outputs, plus the
    bias (ref.ht_combine_expert_ref), within BF16 rounding and FP32 accumulation."""
    ref64, abs64 = ref.ht_combine_expert_ref(x, is_in, rank, bias)
    if got.shape != ref64.shape:
        return ck.true(False, f"{name}: shape {tuple(got.shape)}, expected {tuple(ref64.shape)}")
    bad = ref.combine_mismatch(got, ref64, abs64, num_terms=is_in.size(1) + 2)
    return ck.true(
        not bool(bad.any()),
        f"{name}: {describe_mismatch(bad, got, ref64)} elements are not the sum of the experts' outputs",
    )


def _check_combined_weights(ck, name, got, idx, weights, is_in, num_local_experts):
    """One check: combined_topk_weights (CPU) is the float64 sum of every receiving rank's filled echo
    (ref.ht_combine_weights_ref, fill_by_rank=True), within FP32 accumulation."""
    want = ref.ht_combine_weights_ref(idx, weights, is_in, num_local_experts, fill_by_rank=True)
    if got is None or got.shape != want.shape:
        return ck.true(False, f"{name}: not a {tuple(want.shape)} tensor")
    bound = ref.ht_combine_weights_ref(idx, weights.abs(), is_in, num_local_experts, fill_by_rank=True)
    bad = (got.double() - want).abs() > bound * (is_in.size(1) + 1) * 2.0**-23
    return ck.true(
        not bool(bad.any()),
        f"{name}: {describe_mismatch(bad, got, want)} weights are not the sum of the receiving ranks' echoes",
    )


def _check_ring_refusal(ck, gpu, num_experts):
    """Rows too large for 64 per ring are refused on every rank before any kernel, naming the bytes needed; the
    Buffer stays usable."""
    ck.step = "a dispatch whose rings do not fit is refused"
    x = torch.randn(64, 7168, device="cuda").to(BF16)
    idx = torch.randint(0, num_experts, (64, 8), device="cuda")
    lay = gpu.get_dispatch_layout(idx, num_experts)
    try:
        gpu.dispatch(
            x,
            topk_idx=idx,
            topk_weights=torch.rand(64, 8, device="cuda"),
            num_tokens_per_rank=lay[0],
            num_tokens_per_rdma_rank=lay[1],
            is_token_in_rank=lay[3],
            num_tokens_per_expert=lay[2],
            config=portep.Config(24, 6, 256, 6, 256),
        )
        ck.true(False, "a dispatch of 7168-wide rows with 12 channels on a small buffer was not refused")
    except ValueError as exc:
        ck.true("bytes" in str(exc) and "num_nvl_bytes" in str(exc), f"the refusal does not name the bytes: {exc}")


# Internode handle entries the host backend does not fill as DeepEP does (it returns zeros for
# recv_rdma_channel_prefix_matrix, which nothing reads; the CUDA backend returns each source's channel starts).
UNCOMPARED_INTERNODE_HANDLE = (3,)
# send_nvl_head with forwarders: the host keeps each row's position in its source's block at each local rank, the
# CUDA kernels its index among the source's rows of its channel there (what their combine reads). Which entries
# are -1 (the row's local ranks) must agree.
NVL_HEAD = 9


def _same_handle(ck, rpn, world, got, exp):
    for i, (hg, hh) in enumerate(zip(got, exp)):
        if rpn < world and i in UNCOMPARED_INTERNODE_HANDLE:
            continue
        if 1 < rpn < world and i == NVL_HEAD:
            _same(ck, "handle[9] >= 0 (send_nvl_head's local ranks)", hg >= 0, hh >= 0)
        else:
            _same(ck, f"handle[{i}]", hg, hh)


def cross_backend_body(
    rank,
    world,
    rpn,
    transport,
    seed,
    n_tokens,
    hidden,
    num_topk,
    num_experts,
    num_sms,
    gpu_bytes=None,
    avoid_node=None,
    topk_groups=None,
    host_bytes=None,
):
    """Every output of the CUDA backend equals the host backend's bit for bit on the same inputs; combined_x and
    combined_topk_weights also against their float64 references. gpu_bytes: the GPU Buffer's size (default 256 MiB);
    below that a small Buffer, whose rings wrap many times, on which a dispatch of rows too wide for it must be
    refused (the host backend's Buffer holds every row: host_bytes, for shapes whose rows outgrow the default);
    avoid_node: no token goes to that node; topk_groups: each token's experts on at most that many nodes."""
    ck = w.Checker(rank)
    gpu, host = _buffers(rank, world, rpn, transport, gpu_bytes=gpu_bytes, host_bytes=host_bytes)
    avoid = range(avoid_node * rpn, (avoid_node + 1) * rpn) if avoid_node is not None else ()
    inp = w.make_ht_inputs(
        rank,
        seed,
        n_tokens[rank],
        hidden,
        num_topk,
        num_experts,
        avoid_ranks=avoid,
        topk_groups=topk_groups,
        ranks_per_node=rpn,
    )
    idx, wts = inp["idx"], inp["w"]
    is_in = ref.layout_ref(idx, num_experts, world, rpn)[3]
    nodes_of_token = is_in.view(-1, world // rpn, rpn).any(2)
    assert avoid_node is None or not nodes_of_token[:, avoid_node].any()  # the inputs are what the case names
    assert topk_groups is None or (nodes_of_token.sum(1) <= topk_groups).all()
    cfg = portep.Config(num_sms, 6, 256, 6, 256)
    if gpu_bytes and gpu_bytes < w.HT_NVL_BYTES:
        _check_ring_refusal(ck, gpu, num_experts)
    ck.step = "layout"
    lay_h = host.get_dispatch_layout(idx, num_experts)
    lay_g = gpu.get_dispatch_layout(idx.cuda(), num_experts)
    for i, name in enumerate(["per_rank", "per_rdma_rank", "per_expert", "is_token_in_rank"]):
        _same(ck, name, lay_g[i], lay_h[i])
    keys = ["num_tokens_per_rank", "num_tokens_per_rdma_rank", "num_tokens_per_expert", "is_token_in_rank"]
    lay_h = dict(zip(keys, lay_h[:4]))
    lay_g = dict(zip(keys, lay_g[:4]))
    for kind, x in (("bf16", inp["x"]), ("fp8", (inp["x_fp8"], inp["s_cm"]))):
        for with_topk, align in ((True, 4), (False, 1)):
            ck.step = f"dispatch {kind} topk={with_topk} align={align}"
            targs_h = dict(topk_idx=idx, topk_weights=wts) if with_topk else {}
            targs_g = {k: v.cuda() for k, v in targs_h.items()}
            dh = host.dispatch(x, expert_alignment=align, config=cfg, **targs_h, **lay_h)
            dg = gpu.dispatch(_gpu(x), expert_alignment=align, config=cfg, **targs_g, **lay_g)
            for i, name in enumerate(["recv_x", "recv_topk_idx", "recv_topk_weights", "list"]):
                _same(ck, name, dg[i], dh[i])
            ck.true(len(dg[4]) == len(dh[4]), f"handle has {len(dg[4])} entries, the host's {len(dh[4])}")
            _same_handle(ck, rpn, world, dg[4], dh[4])
            ck.step = f"cached dispatch {kind}"
            _same(
                ck,
                "cached recv_x",
                gpu.dispatch(_gpu(x), handle=dg[4], config=cfg)[0],
                host.dispatch(x, handle=dh[4], config=cfg)[0],
            )
            if kind == "fp8":
                continue
            y = _expert_outputs(dh[0], dh[4], rank)
            cw = {"topk_weights": _filled_weights(dh[2], dh[1], rank)} if with_topk else {}
            for bias in (None, inp["b1"], (inp["b0"], inp["b1"])):
                ck.step = f"combine topk={with_topk} bias={type(bias).__name__}"
                ch = host.combine(y, dh[4], bias=bias, config=cfg, **cw)
                cg = gpu.combine(y.cuda(), dg[4], bias=_gpu(bias), config=cfg, **{k: v.cuda() for k, v in cw.items()})
                _same(ck, "combined_x", cg[0], ch[0])
                _same(ck, "combined_topk_weights", cg[1], ch[1])
                got_x, got_w = _cpu(cg[:2])
                _check_combined_x(ck, "combined_x", got_x, x, is_in, rank, bias)
                if with_topk:
                    _check_combined_weights(ck, "combined_topk_weights", got_w, idx, wts, is_in, num_experts // world)
    ck.step = "stream rules: previous_event, async_finish, allocate_on_comm_stream"
    comm = gpu.get_comm_stream()
    ck.true(
        isinstance(comm, torch.cuda.Stream) and comm != torch.cuda.current_stream(),
        f"get_comm_stream() returned {comm!r}, not a stream of its own",
    )
    dh = host.dispatch(inp["x"], topk_idx=idx, topk_weights=wts, config=cfg, **lay_h)
    torch.cuda._sleep(200_000_000)  # the current stream is busy for a while: x below is produced after that
    x_late = inp["x"].cuda() + 0
    prev = portep.Buffer.capture()
    dg = gpu.dispatch(
        x_late,
        topk_idx=idx.cuda(),
        topk_weights=wts.cuda(),
        config=cfg,
        previous_event=prev,
        async_finish=True,
        allocate_on_comm_stream=True,
        **lay_g,
    )
    dg[5].current_stream_wait()
    _same(ck, "recv_x after previous_event", dg[0], dh[0])
    y = _expert_outputs(dh[0], dh[4], rank)
    ch = host.combine(y, dh[4], config=cfg)
    torch.cuda._sleep(200_000_000)
    y_late = y.cuda() + 0
    cg = gpu.combine(y_late, dg[4], config=cfg)  # no event: the comm stream waits for the current stream
    _same(ck, "combined_x after the current stream", cg[0], ch[0])
    _check_combined_x(ck, "combined_x after the current stream", _cpu(cg[0]), inp["x"], is_in, rank)
    ck.no_kernel_failure(gpu)
    gpu.destroy()
    host.destroy()
    return {"failures": ck.failures, "checks": ck.num_checks}


def graph_body(rank, world, rpn, transport, seed, n, hidden, num_topk, num_experts, replays):
    """num_worst_tokens dispatch and combine captured once, replayed on new inputs copied into the captured
    tensors. The capture computes the test experts' outputs on the GPU from per-row factors and offsets refilled
    before each replay (from the host reference's source ranks for that replay's inputs). Each replay equals the
    host backend's eager results on the same inputs, and its combined_x and combined_topk_weights their float64
    references."""
    ck = w.Checker(rank)
    gpu, host = _buffers(rank, world, rpn, transport)
    worst = n * world
    inputs = [w.make_ht_inputs(rank, seed + 10 * r, n, hidden, num_topk, num_experts) for r in range(replays + 1)]
    static = {k: inputs[0][k].cuda() for k in ("x", "idx", "w")}
    lay = gpu.get_dispatch_layout(static["idx"], num_experts)
    keys = ["num_tokens_per_rank", "num_tokens_per_rdma_rank", "num_tokens_per_expert", "is_token_in_rank"]
    static_lay = dict(zip(keys, lay[:4]))
    factor, offset = (t.cuda() for t in _expert_coefficients(rank, torch.zeros(0, dtype=torch.int64), worst))

    def step():
        d = gpu.dispatch(
            static["x"], topk_idx=static["idx"], topk_weights=static["w"], num_worst_tokens=worst, **static_lay
        )
        y = (d[0].float() * factor + offset).to(BF16)  # the test experts' outputs, once factor and offset are set
        c = gpu.combine(y, d[4], topk_weights=_filled_weights(d[2], d[1], rank))
        return d, c

    step()  # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        d, c = step()
    for r in range(1, replays + 1):
        ck.step = f"replay {r}"
        p = inputs[r]
        lay_h = dict(zip(keys, host.get_dispatch_layout(p["idx"], num_experts)[:4]))
        dh = host.dispatch(p["x"], topk_idx=p["idx"], topk_weights=p["w"], **lay_h)
        m = dh[0].size(0)
        src_ranks = ref.ht_recv_src_ranks(dh[4], rank, m)
        for k in ("x", "idx", "w"):
            static[k].copy_(p[k])
        for t, v in zip((factor, offset), _expert_coefficients(rank, src_ranks, worst)):
            t.copy_(v)
        new_lay = gpu.get_dispatch_layout(static["idx"], num_experts)
        for k, v in zip(keys, new_lay[:4]):
            if v is not None:
                static_lay[k].copy_(v)
        graph.replay()
        ch = host.combine(
            ref.ht_expert_outputs(dh[0], rank, src_ranks), dh[4], topk_weights=_filled_weights(dh[2], dh[1], rank)
        )
        _same(ck, "recv_x[:num_recv]", d[0][:m], dh[0])
        _same(ck, "recv_topk_idx[:num_recv]", d[1][:m], dh[1])
        _same(ck, "recv_topk_weights[:num_recv]", d[2][:m], dh[2])
        ck.true(bool((_cpu(d[1][m:]) == -1).all()), "recv_topk_idx rows past the real count are not all -1")
        _same(ck, "combined_x", c[0], ch[0])
        _same(ck, "combined_topk_weights", c[1], ch[1])
        is_in = ref.layout_ref(p["idx"], num_experts, world, rpn)[3]
        got_x, got_w = _cpu(c[:2])
        _check_combined_x(ck, "combined_x", got_x, p["x"], is_in, rank)
        _check_combined_weights(ck, "combined_topk_weights", got_w, p["idx"], p["w"], is_in, num_experts // world)
    ck.no_kernel_failure(gpu)
    gpu.destroy()
    host.destroy()
    return {"failures": ck.failures, "checks": ck.num_checks}


def mixed_modes_body(rank, world, seed, rounds, split=True):
    """A low_latency_mode Buffer with both num_nvl_bytes and num_rdma_bytes alternates normal and LL ops with no
    clean_low_latency_buffer, each round started late on one rank (a GPU sleep before it) so that the other runs
    ahead into the next mode; every result equals the host backend's bit for bit, and the combined ones their float64
    references. split=False (one size holding both) is the control that shares the memory."""
    ck = w.Checker(rank)
    torch.cuda.set_device(rank % torch.cuda.device_count())
    T, H, E, K = 32, 512, 16, 4
    ll_bytes = portep.Buffer.get_low_latency_rdma_size_hint(T, H, world, E)
    sizes = (w.HT_NVL_BYTES, ll_bytes) if split else (0, w.HT_NVL_BYTES + ll_bytes)
    opts = dict(num_ranks_per_node=world, transport="shm", timeout_s=60, explicitly_destroy=True)
    gpu = portep.Buffer(dist.group.WORLD, *sizes, low_latency_mode=True, backend="cuda", **opts)
    host_ht = portep.Buffer(dist.group.WORLD, w.HT_NVL_BYTES, 0, backend="host", **opts)
    host_ll = portep.Buffer(dist.group.WORLD, 0, ll_bytes, low_latency_mode=True, backend="host", **opts)
    hin = w.make_ht_inputs(rank, seed, [300, 211][rank % 2], 1024, 8, 32)
    lin = w.make_ll_inputs(rank, seed + 1, T, H, K, E)
    lay = dict(
        zip(
            ["num_tokens_per_rank", "num_tokens_per_rdma_rank", "num_tokens_per_expert", "is_token_in_rank"],
            host_ht.get_dispatch_layout(hin["idx"], 32)[:4],
        )
    )
    dh = host_ht.dispatch(hin["x"], topk_idx=hin["idx"], topk_weights=hin["w"], **lay)
    y = _expert_outputs(dh[0], dh[4], rank)
    filled = _filled_weights(dh[2], dh[1], rank)  # the GPU's recv_topk_weights equal these (checked bitwise)
    ch = host_ht.combine(y, dh[4], topk_weights=filled)
    lh = host_ll.low_latency_dispatch(lin["x_rand"], lin["idx"], T, E, use_fp8=False)
    ll_y = ref.ll_expert_outputs(w._ll_sim_x(lh[0], lh[1], False, False), lh[2][1], rank)
    lch = host_ll.low_latency_combine(ll_y, lin["idx"], lin["w"], lh[2])[0]
    is_in = ref.layout_ref(hin["idx"], 32, world, world)[3]
    g_lay = {k: None if v is None else v.cuda() for k, v in lay.items()}
    g_in = {k: hin[k].cuda() for k in ("x", "idx", "w")}
    l_idx, l_w = lin["idx"].cuda(), lin["w"].cuda()
    for r in range(rounds):
        ck.step = f"round {r}"
        if rank == r % world:
            torch.cuda._sleep(50_000_000)  # this rank starts the round late; the other runs ahead
        dg = gpu.dispatch(g_in["x"], topk_idx=g_in["idx"], topk_weights=g_in["w"], **g_lay)
        lg = gpu.low_latency_dispatch(lin["x_rand"].cuda(), l_idx, T, E, use_fp8=False)
        cg = gpu.combine(y.cuda(), dg[4], topk_weights=filled.cuda())
        lcg = gpu.low_latency_combine(ll_y.cuda(), l_idx, l_w, lg[2])[0]
        _same(ck, "HT recv_x", dg[0], dh[0])
        _same(ck, "HT combined_x", cg[0], ch[0])
        _same(ck, "HT combined_topk_weights", cg[1], ch[1])
        got_x, got_w = _cpu(cg[:2])
        _check_combined_x(ck, "HT combined_x", got_x, hin["x"], is_in, rank)
        _check_combined_weights(ck, "HT combined_topk_weights", got_w, hin["idx"], hin["w"], is_in, 32 // world)
        _same(ck, "LL recv_count", lg[1], lh[1])
        for e in range(lh[1].numel()):
            n = int(lh[1][e])
            _same(ck, f"LL recv_x rows of expert {e}", lg[0][e, :n], lh[0][e, :n])
        _same(ck, "LL combined_x", lcg, lch)
        check_ll_combined(ck, "LL combined_x", _cpu(lcg), lin["x_rand"], lin["idx"], lin["w"], rank)
    ck.no_kernel_failure(gpu)
    for b in (gpu, host_ht, host_ll):
        b.destroy()
    return {"failures": ck.failures, "checks": ck.num_checks}


def missing_peer_body(rank, world, rpn, transport, timeout_s):
    """Rank 1 never dispatches. Rank 0's num_worst_tokens dispatch (no CPU wait) queues a notify that gives up
    after the timeout and a data kernel that must then do nothing (else each of its receiving blocks would wait out
    the timeout again); the next call raises, naming the wait. Returns (message, seconds the queued op took)."""
    import time

    torch.cuda.set_device(rank % torch.cuda.device_count())
    buf = portep.Buffer(
        dist.group.WORLD,
        w.HT_NVL_BYTES,
        0,
        num_ranks_per_node=rpn,
        transport=transport,
        timeout_s=timeout_s,
        explicitly_destroy=True,
        backend="cuda",
    )
    message, took = "", 0.0
    if rank == 0:
        N, H, E, K = 64, 512, 8, 2
        g = torch.Generator().manual_seed(7)
        x = torch.randn(N, H, generator=g).to(BF16).cuda()
        idx = torch.randperm(E, generator=g)[:K].repeat(N, 1).cuda()
        weights = torch.rand(N, K, generator=g).cuda()
        lay = buf.get_dispatch_layout(idx, E)
        cfg = portep.Config(8, 6, 256, 6, 128)
        torch.cuda.synchronize()
        start = time.monotonic()
        buf.dispatch(
            x,
            num_tokens_per_rank=lay[0],
            num_tokens_per_rdma_rank=lay[1],
            num_tokens_per_expert=lay[2],
            is_token_in_rank=lay[3],
            topk_idx=idx,
            topk_weights=weights,
            num_worst_tokens=2 * N,
            config=cfg,
        )
        torch.cuda.synchronize()
        took = time.monotonic() - start
        try:
            buf.dispatch(
                x,
                num_tokens_per_rank=lay[0],
                num_tokens_per_rdma_rank=lay[1],
                num_tokens_per_expert=lay[2],
                is_token_in_rank=lay[3],
                topk_idx=idx,
                topk_weights=weights,
                num_worst_tokens=2 * N,
                config=cfg,
            )
        except RuntimeError as e:
            message = str(e)
    dist.barrier()
    buf.destroy()
    return message, took
