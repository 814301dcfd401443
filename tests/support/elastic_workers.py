"""Rank bodies of the ElasticBuffer (DeepEP V2 API) tests: each run makes one ElasticBuffer and goes through a list
of modes, checking every output bit for bit against elastic_ref.py."""

import torch
import torch.distributed as dist

import elastic_ref as ref
import portep
from deepep_workers import Checker

Tensor = torch.Tensor


def make_buffer(
    rank, world, rpn, transport, max_tokens, hidden, num_topk, hybrid, multi, backend="host", deterministic=False
):
    if backend == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    return portep.ElasticBuffer(
        dist.group.WORLD,
        num_max_tokens_per_rank=max_tokens,
        hidden=hidden,
        num_topk=num_topk,
        use_fp8_dispatch=True,
        allow_hybrid_mode=hybrid,
        allow_multiple_reduction=multi,
        deterministic=deterministic,
        explicitly_destroy=True,
        num_ranks_per_node=rpn,
        transport=transport,
        timeout_s=60,
        backend=backend,
    )


def _host(t):
    if isinstance(t, tuple):
        return tuple(_host(u) for u in t)
    return t.cpu() if torch.is_tensor(t) else t


def _stream_args(buf, events):
    if events == "async":
        return {"async_with_compute_stream": True}
    if events == "previous":
        return {"previous_event": buf.capture(), "allocate_on_comm_stream": True}
    return {}


def _check_event(ck, tag, event, events):
    if events == "async":
        if ck.true(event.event is not None, f"{tag}: async_with_compute_stream=True returned no event"):
            event.current_stream_wait()
        return
    ck.true(event.event is None, f"{tag}: an event without async_with_compute_stream")
    try:
        event.current_stream_wait()
        ck.true(False, f"{tag}: current_stream_wait() on an event-less EventOverlap did not raise")
    except AssertionError:
        ck.true(True, "")


def _check_counts(ck, tag, handle, exp, expand, cpu_sync, num_rows):
    ck.equal(
        f"{tag} num_unaligned",
        _host(handle.num_unaligned_recv_tokens_per_expert),
        torch.tensor(exp.counts, dtype=torch.int32),
    )
    ck.equal(
        f"{tag} psum scaleup",
        _host(handle.psum_num_recv_tokens_per_scaleup_rank),
        torch.tensor(exp.psum_scaleup, dtype=torch.int32),
    )
    aligned = torch.tensor(exp.aligned, dtype=torch.int32)
    psum = torch.cumsum(aligned, 0, dtype=torch.int32)
    if expand:
        psum = (psum - aligned + torch.tensor(exp.counts, dtype=torch.int32)).to(torch.int32)
    ck.equal(f"{tag} psum per expert", _host(handle.psum_num_recv_tokens_per_expert), psum)
    ck.true(
        handle.num_recv_tokens_per_expert_list == (exp.aligned if cpu_sync else []),
        f"{tag}: num_recv_tokens_per_expert_list {handle.num_recv_tokens_per_expert_list}, expected {exp.aligned}",
    )
    ck.true(handle.num_recv_tokens == num_rows, f"{tag}: num_recv_tokens {handle.num_recv_tokens} != {num_rows}")


def check_plain(ck, tag, out, exp, mine, with_weights, num_rows, scaleup, x_factor=1.0):
    recv_x, recv_idx, recv_w, handle, _ = _host(out)
    R = exp.num_rows
    x_exp = (exp.x.float() * x_factor).to(exp.x.dtype)
    if exp.sf is not None:
        ck.tensor(f"{tag} recv_x", recv_x[0], shape=(num_rows, exp.x.size(1)))
        ck.equal(f"{tag} recv_x", recv_x[0][:R], x_exp)
        ck.equal(f"{tag} recv_sf", recv_x[1][:R], exp.sf)
    else:
        ck.tensor(f"{tag} recv_x", recv_x, shape=(num_rows, exp.x.size(1)))
        ck.equal(f"{tag} recv_x", recv_x[:R], x_exp)
    ck.equal(f"{tag} recv_topk_idx", recv_idx[:R], exp.topk_idx)
    if with_weights:
        ck.equal(f"{tag} recv_topk_weights", recv_w[:R], exp.weights)
    else:
        ck.true(recv_w is None, f"{tag}: recv_topk_weights without topk_weights is not None")
    meta = _host(handle.recv_src_metadata)
    ck.tensor(f"{tag} recv_src_metadata", meta, torch.int32, (num_rows, exp.K + 2))
    ck.equal(f"{tag} global index", meta[:R, 0], torch.tensor(exp.global_index, dtype=torch.int32))
    col1 = [g * exp.K + s for g, s in zip(exp.scaleup_of, exp.last_slot)]
    ck.equal(f"{tag} metadata col 1", meta[:R, 1], torch.tensor(col1, dtype=torch.int32))
    idx = mine["topk_idx"]
    owner = torch.where(idx >= 0, idx // exp.E_l, torch.full_like(idx, -1)).to(torch.int32)
    ck.equal(f"{tag} dst_buffer_slot_idx", _host(handle.dst_buffer_slot_idx), owner)
    if num_rows > R:  # V2's worst-case rows without a CPU sync: the padding past the received tokens
        ck.true(bool((recv_idx[R:] == -1).all()), f"{tag}: recv_topk_idx of padding rows is not all -1")
        ck.true(bool((meta[R:] == -1).all()), f"{tag}: recv_src_metadata of padding rows is not all -1")
        if with_weights:
            ck.true(bool((recv_w[R:] == 0).all()), f"{tag}: recv_topk_weights of padding rows are not zero")


def check_expanded(ck, tag, out, exp, with_weights, num_rows, zero_padding, x_factor=1.0):
    recv_x, recv_idx, recv_w, handle, _ = _host(out)
    ck.true(recv_idx is None, f"{tag}: recv_topk_idx of an expanded dispatch is not None")
    data, sf = recv_x if exp.sf is not None else (recv_x, None)
    ck.tensor(f"{tag} recv_x", data, shape=(num_rows, exp.x.size(1)))
    valid = exp.expanded_row >= 0
    rows, src = exp.expanded_row[valid], valid.nonzero()[:, 0]
    x_exp = (exp.x.float() * x_factor).to(exp.x.dtype)
    ck.equal(f"{tag} expanded rows", data[rows], x_exp[src])
    pad = torch.ones(num_rows, dtype=torch.bool)
    pad[rows] = False
    if with_weights:
        ck.tensor(f"{tag} recv_topk_weights", recv_w, torch.float32, (num_rows,))
        ck.equal(f"{tag} expanded weights", recv_w[rows], exp.weights[valid])
        ck.true(bool((recv_w[pad] == 0).all()), f"{tag}: padding weights are not zero")
    else:
        ck.true(recv_w is None, f"{tag}: recv_topk_weights without topk_weights is not None")
    if zero_padding:
        ck.true(bool((data[pad].view(torch.uint8) == 0).all()), f"{tag}: padding rows are not zero")
        if sf is not None:
            ck.true(bool((sf[pad].view(torch.int32) == 0).all()), f"{tag}: padding scale factors are not zero")
    if sf is not None:
        ck.equal(f"{tag} expanded sf", sf[rows], exp.sf[src])
        if num_rows:  # (an empty tensor's strides say nothing)
            tma = (1, (num_rows + 3) // 4 * 4)
            ck.true(sf.stride() == tma, f"{tag}: recv_sf strides {sf.stride()} are not TMA col-major {tma}")
    meta = _host(handle.recv_src_metadata)
    ck.equal(f"{tag} metadata expanded rows", meta[: exp.num_rows, 2:].long(), exp.expanded_row)


def _expanded_input(handle, exp, hidden, salt, rows):
    x = torch.full((rows, hidden), 1.0e4, dtype=torch.bfloat16)  # padding rows: values no sum may include
    meta = _host(handle.recv_src_metadata)
    for i in range(exp.num_rows):
        y = ref.expert_rows(int(meta[i, 0]), exp.K, hidden, salt)
        for k in range(exp.K):
            if meta[i, 2 + k] >= 0:
                x[int(meta[i, 2 + k])] = y[k]
    return x


def _check_combine(ck, tag, got, mine, exp_args, bias, salt, weights_back, levels):
    combined, weights, _ = _host(got)
    rank, max_tokens, num_experts, world = exp_args[:4]
    expected = ref.expected_combine(mine, rank, max_tokens, num_experts, world, _host(bias), salt, *exp_args[4:])
    ck.equal(f"{tag} combined_x", combined, expected)
    exact, magnitude = ref.exact_combine(mine, rank, max_tokens, _host(bias), salt)
    ck.true(
        ref.within_rounding(combined, exact, magnitude, levels),
        f"{tag}: combined_x is not the sum within {levels} roundings",
    )
    if weights_back:
        ck.equal(f"{tag} combined_topk_weights", weights, mine["topk_weights"])
    else:
        ck.true(weights is None, f"{tag}: combined_topk_weights without topk_weights")


def run_mode(ck, buf, world, rank, mode, shape, seed, device):
    """One mode: dispatch (plain, expanded, cached, cached expanded with zero padding), then combines."""
    n_tokens, hidden, K, E = shape
    max_tokens = buf.num_max_tokens_per_rank
    inputs = [
        ref.make_inputs(
            s,
            seed,
            n_tokens,
            hidden,
            K,
            E,
            mode["fp8"],
            mode.get("sf", "float"),
            nodes=mode.get("nodes"),
            skew=mode.get("skew", False),
            world=world,
        )
        for s in range(world)
    ]
    mine = inputs[rank]
    S = buf.num_scaleup_ranks
    exp = ref.Expected(inputs, rank, max_tokens, E, S, mode["alignment"], grouped=not buf.deterministic)
    dev = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in mine.items()}
    x = (dev["x"], dev["sf"]) if mode["fp8"] else dev["x"]
    weights = dev["topk_weights"] if mode["weights"] else None
    cpu_sync = mode.get("cpu_sync", True)
    events = mode.get("events", "sync")
    tag = ",".join(f"{k}={v}" for k, v in mode.items() if k != "nodes")
    common = dict(num_experts=E, expert_alignment=mode["alignment"], do_cpu_sync=cpu_sync)
    stats = torch.zeros(E // world, dtype=torch.int32, device=device)
    out = buf.dispatch(
        x,
        dev["topk_idx"],
        weights,
        cumulative_local_expert_recv_stats=stats,
        do_handle_copy=mode.get("copy", True),
        **common,
        **_stream_args(buf, events),
    )
    _check_event(ck, tag, out[4], events)
    rows = exp.num_rows if cpu_sync else world * max_tokens
    check_plain(ck, f"{tag} dispatch", out, exp, mine, mode["weights"], rows, S)
    _check_counts(ck, f"{tag} dispatch", out[3], exp, False, cpu_sync, rows)
    ck.equal(f"{tag} stats", stats.cpu(), torch.tensor(exp.counts, dtype=torch.int32))
    handle = out[3]
    ck.true((handle.topk_idx is dev["topk_idx"]) != mode.get("copy", True), f"{tag}: do_handle_copy not honoured")
    ex = buf.dispatch(x, dev["topk_idx"], weights, do_expand=True, use_tma_aligned_col_major_sf=True, **common)
    local_experts = E // world
    x_rows = (
        exp.num_expanded if cpu_sync else ref_worst_expanded(world, max_tokens, K, local_experts, mode["alignment"])
    )
    check_expanded(ck, f"{tag} expand", ex, exp, mode["weights"], x_rows, False)
    _check_counts(ck, f"{tag} expand", ex[3], exp, True, cpu_sync, rows)
    x2 = ((dev["x"].float() * -2).to(dev["x"].dtype), dev["sf"]) if mode["fp8"] else (dev["x"] * -2)
    cached = buf.dispatch(x2, handle=handle, **_stream_args(buf, events))
    ck.true(cached[3] is handle, f"{tag}: a cached dispatch returned another handle")
    check_plain(ck, f"{tag} cached", cached, exp, mine, False, rows, S, x_factor=-2.0)
    cex = buf.dispatch(
        x2, topk_weights=weights, handle=ex[3], do_expand=True, do_zero_padding=True, use_tma_aligned_col_major_sf=True
    )
    check_expanded(ck, f"{tag} cached expand", cex, exp, mode["weights"], x_rows, True, x_factor=-2.0)

    bias = ref.bias_tensors(rank, seed, mode["bias"], n_tokens[rank], hidden)
    bias_dev = (
        None if bias is None else tuple(b.to(device) for b in bias) if isinstance(bias, tuple) else bias.to(device)
    )
    multi = buf.allow_multiple_reduction
    node_ranks = S if multi and buf.num_scaleout_ranks > 1 else None
    args = (rank, max_tokens, E, world)
    for salt in (0, 1):  # the second combine takes the cached return trip
        plain_in = torch.full((rows, hidden), 1.0e4, dtype=torch.bfloat16)
        plain_in[: exp.num_rows] = ref.combine_input_rows(exp.global_index, exp.topk_idx, hidden, salt)
        back_w = out[2] if mode["weights"] else None
        got = buf.combine(plain_in.to(device), handle, topk_weights=back_w, bias=bias_dev, **_stream_args(buf, events))
        _check_combine(
            ck,
            f"{tag} combine salt={salt}",
            got,
            mine,
            args + (False, multi, node_ranks),
            bias,
            salt,
            mode["weights"],
            3,
        )
        exp_in = _expanded_input(ex[3], exp, hidden, salt, x_rows)
        w_in = ex[2] if mode["weights"] and multi else None
        got = buf.combine(exp_in.to(device), ex[3], topk_weights=w_in, bias=bias_dev)
        _check_combine(
            ck,
            f"{tag} expand combine salt={salt}",
            got,
            mine,
            args + (True, multi, node_ranks),
            bias,
            salt,
            w_in is not None,
            4,
        )


def _expanded_input_of(exp, hidden, salt, rows):
    """_expanded_input from the reference's layout (before the dispatch that makes the handle has run)."""
    x = torch.full((rows, hidden), 1.0e4, dtype=torch.bfloat16)
    for i in range(exp.num_rows):
        y = ref.expert_rows(exp.global_index[i], exp.K, hidden, salt)
        for k in range(exp.K):
            if exp.expanded_row[i, k] >= 0:
                x[int(exp.expanded_row[i, k])] = y[k]
    return x


def graph_body(rank, world, rpn, transport, hybrid, multi, shape, seed, backend="cuda", replays=2):
    """Dispatches without CPU sync (plain and expanded, alignment 8) and their combines, captured once in a CUDA
    graph and replayed on new inputs (tokens, routing, weights) copied into the captured tensors; the experts'
    outputs are static tensors refilled before each replay from the reference's layout of that replay's inputs.
    Every replay's outputs bitwise against elastic_ref.py. On the host backend the same calls run again for each
    replay instead (the same fixed-capacity tensors, no graph). Returns {"failures", "checks"}."""
    n_tokens, hidden, K, E = shape
    ck = Checker(rank)
    device = "cuda" if backend == "cuda" else "cpu"
    buf = make_buffer(rank, world, rpn, transport, max(n_tokens) + 3, hidden, K, hybrid, multi, backend)
    T, S, alignment = buf.num_max_tokens_per_rank, buf.num_scaleup_ranks, 8
    rows, x_rows = world * T, ref_worst_expanded(world, T, K, E // world, alignment)
    rounds = [
        [ref.make_inputs(s, seed + 7 * r, n_tokens, hidden, K, E, 0, "float", world=world) for s in range(world)]
        for r in range(replays + 1)
    ]
    static = {k: rounds[0][rank][k].to(device) for k in ("x", "topk_idx", "topk_weights")}
    plain_in = torch.zeros(rows, hidden, dtype=torch.bfloat16, device=device)
    expanded_in = torch.zeros(x_rows, hidden, dtype=torch.bfloat16, device=device)
    node_ranks = S if multi and buf.num_scaleout_ranks > 1 else None
    common = dict(num_experts=E, expert_alignment=alignment, do_cpu_sync=False)

    def step():
        out = buf.dispatch(static["x"], static["topk_idx"], static["topk_weights"], **common)
        ex = buf.dispatch(static["x"], static["topk_idx"], static["topk_weights"], do_expand=True, **common)
        comb = buf.combine(plain_in, out[3], topk_weights=out[2])
        w_in = ex[2] if multi else None
        return out, ex, comb, buf.combine(expanded_in, ex[3], topk_weights=w_in)

    try:
        out, ex, comb, ecomb = step()  # warm-up, outside the graph
        graph = None
        if device == "cuda":
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out, ex, comb, ecomb = step()
        for r in range(1, replays + 1):
            ck.step = f"replay {r}"
            inputs = rounds[r]
            mine = inputs[rank]
            exp = ref.Expected(inputs, rank, T, E, S, alignment, grouped=not buf.deterministic)
            for k in static:
                static[k].copy_(mine[k])
            y = torch.full((rows, hidden), 1.0e4, dtype=torch.bfloat16)
            y[: exp.num_rows] = ref.combine_input_rows(exp.global_index, exp.topk_idx, hidden, r)
            plain_in.copy_(y)
            expanded_in.copy_(_expanded_input_of(exp, hidden, r, x_rows))
            if graph is None:
                out, ex, comb, ecomb = step()
            else:
                graph.replay()
                torch.cuda.synchronize()
            check_plain(ck, "dispatch", out, exp, mine, True, rows, S)
            _check_counts(ck, "dispatch", out[3], exp, False, False, rows)
            check_expanded(ck, "expand", ex, exp, True, x_rows, False)
            _check_counts(ck, "expand", ex[3], exp, True, False, rows)
            args = (rank, T, E, world)
            _check_combine(ck, "combine", comb, mine, args + (False, multi, node_ranks), None, r, True, 3)
            _check_combine(ck, "expand combine", ecomb, mine, args + (True, multi, node_ranks), None, r, multi, 4)
    finally:
        buf.destroy()
    return {"failures": ck.failures, "checks": ck.num_checks}


def ref_worst_expanded(world, max_tokens, K, local_experts, alignment):
    rows = world * max_tokens * min(K, local_experts) + (alignment - 1) * local_experts
    return (rows + alignment - 1) // alignment * alignment


def elastic_body(rank, world, rpn, transport, hybrid, multi, shape, modes, seed, backend="host", deterministic=False):
    """Returns {"failures", "checks"}."""
    n_tokens, hidden, K, E = shape
    ck = Checker(rank)
    device = "cuda" if backend == "cuda" else "cpu"
    buf = make_buffer(rank, world, rpn, transport, max(n_tokens) + 3, hidden, K, hybrid, multi, backend, deterministic)
    nodes = world // rpn
    ck.true(buf.get_physical_domain_size() == (nodes, rpn), f"physical domain {buf.get_physical_domain_size()}")
    logical = (nodes, rpn) if hybrid else (1, world)
    ck.true(buf.get_logical_domain_size() == logical, f"logical domain {buf.get_logical_domain_size()} != {logical}")
    ck.true((buf.scaleout_rank_idx, buf.scaleup_rank_idx) == (rank // logical[1], rank % logical[1]), "rank indices")
    try:
        for i, mode in enumerate(modes):
            ck.step = f"mode {i}"
            run_mode(ck, buf, world, rank, mode, shape, seed + i, device)
    finally:
        buf.destroy()
    return {"failures": ck.failures, "checks": ck.num_checks}


def _expect(ck, what, fn, exc, text):
    try:
        fn()
    except exc as e:
        ck.true(text in str(e), f"{what}: message {str(e)!r} does not name {text!r}")
        return
    except Exception as e:  # noqa: BLE001 - reported as a failed check
        ck.true(False, f"{what}: raised {type(e).__name__}: {e}, expected {exc.__name__}")
        return
    ck.true(False, f"{what}: did not raise {exc.__name__}")


def refusal_body(rank, world, transport):
    """Every rank makes the same calls with the same mistakes (each refused locally), then rank 0 alone makes a
    mistake its peers do not: they raise at once naming it, the next call raises out of step on every rank (never
    data), and a new buffer works."""
    import time

    from portep import OutOfStep

    ck = Checker(rank)
    shape = ([30, 26, 21, 33][:world], 128, 4, 8 * world)
    buf = make_buffer(rank, world, world, transport, 40, 128, 4, True, True)
    inp = ref.make_inputs(rank, 3, shape[0], 128, 4, shape[3], False)
    x, idx, wts = inp["x"], inp["topk_idx"], inp["topk_weights"]
    E = shape[3]
    bad_idx = idx.clone()
    bad_idx[0, 1] = bad_idx[0, 0] = 5
    cases = [
        ("num_experts missing", lambda: buf.dispatch(x, idx, wts), ValueError, "num_experts is required"),
        ("num_experts", lambda: buf.dispatch(x, idx, wts, num_experts=E + 1), ValueError, f"num_experts={E + 1}"),
        (
            "repeated expert",
            lambda: buf.dispatch(x, bad_idx, wts, num_experts=E),
            ValueError,
            "selects an expert twice",
        ),
        (
            "too many tokens",
            lambda: buf.dispatch(x, idx, wts, num_experts=E, num_max_tokens_per_rank=4),
            ValueError,
            "num_max_tokens_per_rank=4 is the limit",
        ),
        (
            "zero padding",
            lambda: buf.dispatch(x, idx, wts, num_experts=E, do_zero_padding=True),
            ValueError,
            "do_zero_padding=True needs do_expand=True",
        ),
        (
            "previous_event",
            lambda: buf.dispatch(x, idx, wts, num_experts=E, previous_event=buf.capture()),
            ValueError,
            "allocate_on_comm_stream=True",
        ),
        ("num_qps", lambda: buf.dispatch(x, idx, wts, num_experts=E, num_qps=10**6), ValueError, "num_qps=1000000"),
        ("fp32 x", lambda: buf.dispatch(x.float(), idx, wts, num_experts=E), TypeError, "x has dtype torch.float32"),
    ]
    for what, fn, exc, text in cases:
        ck.step = what
        _expect(ck, what, fn, exc, text)
    ck.step = "valid after refusals"
    recv, _, _, handle, _ = buf.dispatch(x, idx, wts, num_experts=E)
    ck.true(recv.size(0) == handle.num_recv_tokens, "a valid dispatch after refusals")
    handle_cases = [
        ("handle and topk_idx", lambda: buf.dispatch(x, idx, handle=handle), ValueError, "topk_idx must be None"),
        ("handle cpu sync", lambda: buf.dispatch(x, handle=handle, do_cpu_sync=True), ValueError, "do_cpu_sync=True"),
        (
            "handle alignment",
            lambda: buf.dispatch(x, handle=handle, expert_alignment=4),
            ValueError,
            "expert_alignment=4 differs",
        ),
        ("combine rows", lambda: buf.combine(recv[:-1], handle), ValueError, "num_recv_tokens"),
        ("combine bias", lambda: buf.combine(recv, handle, bias=x[:-1]), ValueError, "bias has shape"),
    ]
    for what, fn, exc, text in handle_cases:
        ck.step = what
        _expect(ck, what, fn, exc, text)
    ck.step = "one rank refuses"
    started = time.monotonic()
    if rank == 0:
        _expect(
            ck, "rank 0's bad call", lambda: buf.dispatch(x, idx, wts, num_experts=E + 1), ValueError, "num_experts"
        )
    else:
        _expect(
            ck,
            "a peer of the refusing rank",
            lambda: buf.dispatch(x, idx, wts, num_experts=E),
            RuntimeError,
            "rank 0 refused",
        )
    ck.true(time.monotonic() - started < 5, f"the refusal took {time.monotonic() - started:.1f} s to reach the peers")
    ck.step = "the next call: out of step, on every rank"
    _expect(ck, ck.step, lambda: buf.dispatch(x, idx, wts, num_experts=E), OutOfStep, "out of step")
    buf.destroy()
    ck.step = "a new buffer"
    buf = make_buffer(rank, world, world, transport, 40, 128, 4, True, True)
    recv, recv_idx, _, handle, _ = buf.dispatch(x, idx, wts, num_experts=E)
    combined, weights, _ = buf.combine(ref.combine_input_rows(handle.recv_src_metadata[:, 0], recv_idx, 128, 0), handle)
    expected = ref.expected_combine(inp, rank, 40, E, world, None, 0, False, True, None)
    ck.equal("combine after a refusal", combined, expected)
    buf.destroy()
    return {"failures": ck.failures, "checks": ck.num_checks}


def size_hint_body(rank, world, rpn):
    """A buffer sized by get_buffer_size_hint runs the worst case (every token of every rank to every rank, top-k >=
    ranks, so that a combine's return trip between nodes is as large as it gets); one an eighth of that size is
    refused alike on every rank, naming the bytes needed."""
    from portep import AgreedRefusal

    ck = Checker(rank)
    T, H, K, E = 512, 2048, 4, 8 * world
    group = dist.group.WORLD
    nodes = world // rpn
    ck.true(portep.get_physical_domain_size(group) == (1, world), "get_physical_domain_size")  # (no env override)
    ck.true(portep.get_logical_domain_size(group, False) == (1, world), "get_logical_domain_size")
    hint = portep.ElasticBuffer.get_buffer_size_hint(group, T, H, K, num_ranks_per_node=rpn, backend="host")
    ck.true(hint % (2 << 20) == 0, f"the hint {hint} is not a multiple of 2 MiB")
    idx = torch.stack([torch.arange(K) * (E // K) for _ in range(T)])  # each token to every rank
    x = torch.randn(T, H).to(torch.bfloat16)
    buf = portep.ElasticBuffer(
        group,
        num_max_tokens_per_rank=T,
        hidden=H,
        num_topk=K,
        explicitly_destroy=True,
        num_ranks_per_node=rpn,
        backend="host",
    )
    ck.true(buf.num_bytes == hint, f"num_bytes {buf.num_bytes} != the hint {hint}")
    ck.true(buf.get_physical_domain_size() == (nodes, rpn), f"nodes {buf.get_physical_domain_size()}")
    recv, _, _, handle, _ = buf.dispatch(x, idx, num_experts=E)
    ck.true(recv.size(0) == world * T, f"received {recv.size(0)} rows, expected {world * T}")
    combined, _, _ = buf.combine(recv, handle)
    ck.true(combined.shape == (T, H), "combine at the hint's size")
    buf.destroy()
    small = portep.ElasticBuffer(
        group, num_bytes=hint // 8 // 128 * 128, explicitly_destroy=True, num_ranks_per_node=rpn, backend="host"
    )
    _expect(
        ck,
        "an eighth of the hint",
        lambda: small.dispatch(x, idx, num_experts=E, num_max_tokens_per_rank=T),
        AgreedRefusal,
        "bytes",
    )
    small.destroy()
    return {"failures": ck.failures, "checks": ck.num_checks}


def default_dtype_body(rank, world):
    """DeepEP's tests make BF16 the default dtype: the same calls under it give the same bits as under float32."""
    ck = Checker(rank)
    T, H, K, E = 33, 128, 4, 8 * world
    inp = ref.make_inputs(rank, 9, [T] * world, H, K, E, False)
    buf = make_buffer(rank, world, world, "shm", T, H, K, True, True)
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        torch.set_default_dtype(dtype)
        try:
            recv, recv_idx, recv_w, handle, _ = buf.dispatch(
                inp["x"], inp["topk_idx"], inp["topk_weights"], num_experts=E
            )
            torch.set_default_dtype(torch.float32)  # (the reference's own arithmetic)
            y = ref.combine_input_rows(handle.recv_src_metadata[:, 0], recv_idx, H, 0)
            torch.set_default_dtype(dtype)
            combined, weights, _ = buf.combine(y, handle, topk_weights=recv_w, bias=(inp["x"], inp["x"]))
            unweighted = buf.dispatch(inp["x"], inp["topk_idx"], num_experts=E)  # (V1 gets float32 ones)
            ck.true(unweighted[2] is None and torch.equal(unweighted[0], recv), f"{dtype}: a dispatch without weights")
            results.append((recv, recv_w, combined, weights))
        finally:
            torch.set_default_dtype(torch.float32)
    for name, a, b in zip(("recv_x", "recv_topk_weights", "combined_x", "combined_topk_weights"), *results):
        ck.equal(f"{name} under default dtype bfloat16", b, a)
    ck.true(results[0][1].dtype == torch.float32, "recv_topk_weights is float32")
    buf.destroy()
    return {"failures": ck.failures, "checks": ck.num_checks}


def default_device_body(rank, world):
    """A user's torch.set_default_device changes nothing: ElasticBuffer creates every tensor on its inputs' device,
    never on the default one (the 'meta' device here: a tensor made there would fail the call or come back empty).
    Dispatch in four modes (exact and worst-case shapes, plain and expanded), BF16 and FP8, cached, and combine with
    two biases: bitwise what the same calls give under the default device 'cpu'."""
    ck = Checker(rank)
    T, H, K, E = 33, 256, 4, 8 * world
    bf16 = ref.make_inputs(rank, 11, [T] * world, H, K, E, False)
    fp8 = ref.make_inputs(rank, 11, [T] * world, H, K, E, True)
    idx, weights = bf16["topk_idx"], bf16["topk_weights"]
    expand = dict(do_expand=True, expert_alignment=4)
    modes = [{}, {"do_cpu_sync": False}, dict(expand, do_zero_padding=True), dict(expand, do_cpu_sync=False)]
    buf = make_buffer(rank, world, world, "shm", T, H, K, True, True)
    results = {}
    try:
        for device in ("cpu", "meta"):
            torch.set_default_device(device)
            try:
                results[device] = [
                    _default_device_mode(buf, m, bf16["x"], (fp8["x"], fp8["sf"]), idx, weights, E) for m in modes
                ]
            finally:
                torch.set_default_device("cpu")
    finally:
        buf.destroy()
    for i, (want, got) in enumerate(zip(results["cpu"], results["meta"])):
        for name in want:
            ck.true(got[name].device.type == "cpu", f"mode {i} {name}: on {got[name].device}, not the inputs' cpu")
            ck.equal(f"mode {i} {name} under default device meta", got[name], want[name])
        ck.true(want["combined_x"].abs().sum() > 0, f"mode {i}: combined rows are not all zero")
    return {"failures": ck.failures, "checks": ck.num_checks}


def _default_device_mode(buf, mode, x, x_fp8, idx, weights, num_experts):
    """One mode's outputs that do not depend on uninitialized rows (worst-case shapes leave rows past the real ones
    unwritten, and so does an expanded layout without zero padding): the real rows of the BF16 dispatch and of a
    cached FP8 dispatch (data and scales), the combined rows and weights."""
    recv, recv_idx, recv_w, handle, _ = buf.dispatch(x, idx, weights, num_experts=num_experts, **mode)
    cached = {k: v for k, v in mode.items() if k in ("do_expand", "expert_alignment", "do_zero_padding")}
    (recv8, sf8), _, _, _, _ = buf.dispatch(x_fp8, handle=handle, topk_weights=weights, **cached)
    combined, combined_w, _ = buf.combine(recv, handle, topk_weights=recv_w, bias=(x, x))
    if not mode.get("do_expand"):
        real = (recv_idx >= 0).any(1)
    else:  # every expanded row is written (padding zeroed) only with zero padding and exact shapes
        written = mode.get("do_zero_padding", False) and mode.get("do_cpu_sync", True)
        real = torch.full((recv.size(0),), written, dtype=torch.bool, device=recv.device)
    return {
        "recv_x": recv[real],
        "recv_fp8": recv8[real].view(torch.uint8),
        "recv_sf": sf8[real],
        "real_rows": real,
        "combined_x": combined,
        "combined_topk_weights": combined_w,
    }
