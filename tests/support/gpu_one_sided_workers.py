"""Per-rank bodies of the GPU tests of one-sided failures as a DeepEP user meets them (test_gpu_one_sided.py): one
rank's LL dispatch holds an expert id equal to num_experts while its peer makes the matching good call; a peer later
than the timeout; a peer whose process dies before a call. Each rank calls the Buffer directly, as DeepEP code does
(no host synchronisation between its calls, no adapter that checks for errors after each call), and every call on
every rank is held to one rule (docs/design.md §7): it raises, or each of its outputs is exactly right, or poisoned
where the call could not complete it (NaN rows, recv_count -1); once a call failed, the next call raises on every
rank until clean_low_latency_buffer, after which every result is exact again. Each body returns its failures and
the number of comparisons it made."""

import os
import time

import torch
import torch.distributed as dist

import deepep_reference as ref
from gpu_hazard_workers import _all_idx, _buffer, _Tally

BF16 = torch.bfloat16


def gpu_expert_outputs(recv_x, layout_range, rank):
    """ref.ll_expert_outputs computed on the GPU from the dispatch's outputs, without a host synchronisation (so the
    calls follow each other as in a model): row i of local expert e from source j becomes
    bf16(float32(row) * expert_factor(rank * E_l + e) + expert_offset(rank * E_l + e, j)), two roundings as on the
    CPU. Rows past the sources' blocks are left as they came."""
    e_l, m = recv_x.size(0), recv_x.size(1)
    begins, counts = layout_range >> 32, layout_range & 0xFFFFFFFF  # [E_l, R]
    rows = torch.arange(m, device=recv_x.device)
    inside = (rows.view(1, 1, m) >= begins.unsqueeze(2)) & (rows.view(1, 1, m) < (begins + counts).unsqueeze(2))
    src = torch.where(inside.any(1), inside.int().argmax(1), -1)  # [E_l, M]: the source of each row, -1 past them
    unit = (rank * e_l + torch.arange(e_l, device=recv_x.device)).view(e_l, 1)
    factor = (1.0 + ((37 * unit) % ref.EXPERT_FACTOR_MOD + 1).float() / 256.0).view(e_l, 1, 1)
    offset = ((((11 * unit + 29 * src.clamp(min=0)) % 63).float() - 31.5) / 16.0).unsqueeze(2)
    out = (recv_x.float() * factor + offset).to(BF16)
    return torch.where((src >= 0).unsqueeze(2), out, recv_x)


class Inputs:
    """One round's inputs, every rank's topk_idx gathered (with the bad entry as sent, and as the reference reads
    it: -1, a selection the kernels drop)."""

    def __init__(self, rank, seed, T, H, E, K, bad=False):
        g = torch.Generator().manual_seed(seed * 1000 + rank)
        idx = torch.topk(torch.rand(T, E, generator=g), K, dim=1).indices
        idx[torch.randint(0, T, (T // 8,), generator=g), torch.randint(0, K, (T // 8,), generator=g)] = -1
        self.x = (torch.randn(T, H, generator=g) * 0.5).to(BF16)
        self.w = torch.rand(T, K, generator=g) + 0.1
        self.sent = idx.clone()
        if bad:
            self.sent[5, 2] = E
        self.idx = idx.clone()
        self.idx[self.sent >= E] = -1
        self.all_idx = [t.cpu() for t in _all_idx(self.idx.cuda())]
        self.all_x = [t.cpu() for t in _all_idx(self.x.cuda())]


def _attempt(fn, portep):
    """(results, error): a DroppedInput's results count as returned (its report is the error)."""
    try:
        return fn(), None
    except portep.DroppedInput as e:
        return e.results, e
    except Exception as e:  # noqa: BLE001 - checked by the caller
        return None, e


def check_dispatch(tally, what, out, inp, rank, E_l, allow_poison):
    """Each local expert exactly right (count, which tokens from which source, their rows), or poisoned (count -1,
    every row NaN) where allow_poison. Returns the number of poisoned experts."""
    recv_x, count, handle = out[0].cpu(), out[1].cpu(), out[2]
    src_info, ranges = handle[0].cpu(), handle[1].cpu()
    poisoned = 0
    for le in range(E_l):
        e = rank * E_l + le
        if int(count[le]) == -1:
            poisoned += 1
            tally.true(allow_poison, f"{what}: expert {e} poisoned (count -1) in a call that must succeed")
            tally.true(
                bool(torch.isnan(recv_x[le].float()).all()),
                f"{what}: expert {e}'s count is -1 but not every row is NaN",
            )
            continue
        want = sum(int((t == e).sum()) for t in inp.all_idx)
        tally.true(int(count[le]) == want, f"{what}: expert {e} received {int(count[le])} tokens, expected {want}")
        for j, idx_j in enumerate(inp.all_idx):
            b, n = int(ranges[le, j]) >> 32, int(ranges[le, j]) & 0xFFFFFFFF
            toks = src_info[le, b : b + n].long()
            expected = (idx_j == e).any(1).nonzero().flatten()
            if not tally.true(
                torch.equal(toks.sort().values, expected), f"{what}: expert {e} from rank {j}: tokens differ"
            ):
                continue
            tally.true(
                torch.equal(recv_x[le, b : b + n], inp.all_x[j][toks]), f"{what}: expert {e} from rank {j}: rows differ"
            )
    return poisoned


def check_combine(tally, what, got, inp, rank, allow_poison):
    """Each row the float64 weighted sum of the test experts' outputs (rounded to BF16), or all NaN where allow_poison.
    Returns the number of NaN rows."""
    got = got.cpu()
    ref64, abs64 = ref.ll_combine_expert_ref(inp.x, inp.idx, inp.w, rank)
    bad = ref.combine_mismatch(got, ref64, abs64, num_terms=inp.idx.size(1)).any(1)
    nan_rows = torch.isnan(got.float()).all(1)
    wrong = bad & ~nan_rows if allow_poison else bad
    tally.true(
        not bool(wrong.any()),
        f"{what}: {int(wrong.sum())} of {got.size(0)} rows are neither the weighted sum"
        + (" nor poisoned (all NaN)" if allow_poison else ""),
    )
    return int(nan_rows.sum())


class Rank:
    """A rank's Buffer and the calls of a round, made as a model makes them: dispatch, the experts on the GPU,
    combine (modes: 'plain', 'hook', 'async'), no host synchronisation in between."""

    def __init__(self, portep, rank, world, shape, rpn, transport, nvlink, timeout_s):
        self.portep, self.rank, self.world = portep, rank, world
        self.T, self.H, self.E, self.K = shape
        self.E_l = self.E // world
        self.buf = _buffer(portep, self.T, self.H, self.E, rpn, transport, nvlink, timeout_s)

    def round(self, inp, mode="plain"):
        """{'dispatch': (results, error), 'combine': (results, error)}; combine is (None, None) when the dispatch
        raised something other than a DroppedInput (there is no handle to combine with)."""
        hook, fin = mode == "hook", mode == "async"
        out = {}
        d, err = self._call(
            lambda: self.buf.low_latency_dispatch(
                inp.x.cuda(), inp.sent.cuda(), self.T, self.E, use_fp8=False, async_finish=fin, return_recv_hook=hook
            ),
            hook,
            fin,
        )
        out["dispatch"] = (d, err)
        if d is None:
            out["combine"] = (None, None)
            return out
        y = gpu_expert_outputs(d[0], d[2][1], self.rank)
        out["combine"] = self._call(
            lambda: self.buf.low_latency_combine(
                y, inp.sent.cuda(), inp.w.cuda(), d[2], async_finish=fin, return_recv_hook=hook
            ),
            hook,
            fin,
        )
        return out

    def _call(self, fn, hook, fin):
        """fn()'s (results, error), its receive hook called (hook) or its event waited for on the current stream (fin):
        the hook and the EventOverlap are the results' last two entries (combine) or its entries 4 and 3 (dispatch)."""
        out, err = _attempt(fn, self.portep)
        if out is None:
            return out, err
        if hook and out[-1] is not None:
            _, hook_err = _attempt(out[-1], self.portep)
            err = err or hook_err
        if fin:
            out[-2].current_stream_wait()
        return out, err

    def check(self, tally, what, inp, calls, allow_poison):
        """Checks a round's results once the GPU is done; returns (poisoned experts + NaN rows, errors raised)."""
        torch.cuda.synchronize()
        poisoned, errors = 0, []
        d, derr = calls["dispatch"]
        c, cerr = calls["combine"]
        for err in (derr, cerr):
            if err is not None:
                errors.append(err)
        if d is not None:
            poisoned += check_dispatch(tally, f"{what}: dispatch", d, inp, self.rank, self.E_l, allow_poison)
        if c is not None:
            poisoned += check_combine(tally, f"{what}: combine", c[0], inp, self.rank, allow_poison)
        return poisoned, errors


def _plain_errors(errors, portep):
    return [e for e in errors if not isinstance(e, portep.DroppedInput)]


def bad_input_body(rank, world, rpn, transport, nvlink, seed, shape):
    """Rank 0's third round dispatches an expert id equal to num_experts (its peers' are good): every call on every
    rank returns exactly right results (that selection dropped everywhere), each rank goes on calling as a model
    does, and rank 0 gets exactly one DroppedInput naming the entry, raised by a call that was made on every rank
    (its results attached); no rank ever waits out a timeout."""
    import portep

    torch.cuda.set_device(rank % torch.cuda.device_count())
    tally = _Tally(rank)
    r = Rank(portep, rank, world, shape, rpn, transport, nvlink, 20.0)
    modes = ["plain", "plain", "plain", "hook", "async", "plain"]
    inputs = [Inputs(rank, seed + i, *shape, bad=(i == 2 and rank == 0)) for i in range(len(modes))]
    dropped = []
    t0 = time.monotonic()
    results = [r.round(inp, mode) for inp, mode in zip(inputs, modes)]  # one after another, no synchronisation
    for i, (inp, calls) in enumerate(zip(inputs, results)):
        _, errors = r.check(tally, f"round {i} ({modes[i]})", inp, calls, allow_poison=False)
        tally.true(not _plain_errors(errors, portep), f"round {i}: raised {_plain_errors(errors, portep)!r:.300}")
        dropped += [(i, e) for e in errors if isinstance(e, portep.DroppedInput)]
    took = time.monotonic() - t0
    tally.true(took < 15.0, f"six rounds took {took:.1f} s: a rank waited out its 20 s timeout")
    want = 1 if rank == 0 else 0
    tally.true(len(dropped) == want, f"{len(dropped)} DroppedInput raised ({dropped!r:.300}), expected {want}")
    for i, e in dropped:
        tally.true(i >= 2, f"a DroppedInput in round {i}, before the bad input was sent")
        tally.true(f"value {shape[2]}" in str(e), f"the DroppedInput does not name the entry: {e}")
    r.buf.destroy()
    return tally.result()


def late_peer_body(rank, world, rpn, transport, nvlink, seed, shape, timeout_s, late_s):
    """The last rank makes its third round's calls late_s > timeout_s after the others. Whatever each call on each
    rank returns is exactly right or poisoned, and the on-time ranks' dispatch is poisoned (it timed out); the next
    call raises on every rank, naming the failure, and after clean_low_latency_buffer every result is exact."""
    import portep

    torch.cuda.set_device(rank % torch.cuda.device_count())
    tally = _Tally(rank)
    r = Rank(portep, rank, world, shape, rpn, transport, nvlink, timeout_s)
    inputs = [Inputs(rank, seed + i, *shape) for i in range(6)]
    for i in (0, 1):  # the second takes the fast path
        r.check(tally, f"round {i}", inputs[i], r.round(inputs[i]), allow_poison=False)
    dist.barrier()
    late = rank == world - 1
    if late:
        time.sleep(late_s)
    poisoned, errors = r.check(tally, "the late round", inputs[2], r.round(inputs[2]), allow_poison=True)
    if not late:
        tally.true(poisoned > 0 or errors, "the on-time rank's round returned no poison and raised nothing")
    dist.barrier()  # every rank's late round is over (its kernels done) before the next calls
    t0 = time.monotonic()
    calls = r.round(inputs[3])
    tally.true(calls["dispatch"][1] is not None, "the call after a failed one did not raise")
    err = calls["dispatch"][1]
    tally.true(
        err is None or "clean_low_latency_buffer" in str(err) or "failed" in str(err),
        f"the call after a failed one raised without saying what failed: {err!r:.300}",
    )
    tally.true(time.monotonic() - t0 < 2.0 + timeout_s, "the call after a failed one took longer than its timeout")
    r.check(tally, "the call after the failure", inputs[3], calls, allow_poison=True)
    r.buf.clean_low_latency_buffer(r.T, r.H, r.E)
    for i in (4, 5):
        _, errors = r.check(tally, f"round {i} after clean", inputs[i], r.round(inputs[i]), allow_poison=False)
        tally.true(not errors, f"round {i} after clean raised {errors!r:.300}")
    r.buf.destroy()
    return tally.result()


def dead_peer_body(rank, world, rpn, transport, nvlink, seed, shape):
    """The last rank's process exits between two rounds: the survivors' next round returns poisoned results (never a
    wrong one) within a few seconds though the timeout is 30 s, and the call after it raises naming the dead rank."""
    import portep

    torch.cuda.set_device(rank % torch.cuda.device_count())
    tally = _Tally(rank)
    r = Rank(portep, rank, world, shape, rpn, transport, nvlink, 30.0)
    inputs = [Inputs(rank, seed + i, *shape) for i in range(4)]
    for i in (0, 1):
        r.check(tally, f"round {i}", inputs[i], r.round(inputs[i]), allow_poison=False)
    dist.barrier()
    if rank == world - 1:
        os._exit(0)
    t0 = time.monotonic()
    poisoned, errors = r.check(tally, "the round without the dead rank", inputs[2], r.round(inputs[2]), True)
    took = time.monotonic() - t0
    tally.true(poisoned > 0 or errors, "the round without the dead rank returned no poison and raised nothing")
    tally.true(took < 5.0, f"the round without the dead rank took {took:.1f} s (timeout 30 s)")
    calls = r.round(inputs[3])
    err = calls["dispatch"][1]
    tally.true(
        err is not None and f"rank {world - 1}" in str(err),
        f"the call after the dead rank's round raised {err!r:.300}",
    )
    r.check(tally, "the call after", inputs[3], calls, allow_poison=True)
    r.buf.destroy()
    return tally.result()


def _ht_round(portep, buf, rank, world, inp, E, late_s=0.0):
    """A normal-mode dispatch (with a CPU sync: its counts come back) and, late_s seconds later, the combine of the
    test experts' outputs (ref.ht_expert_outputs). Returns (dispatch error, combine results or None, combine error,
    the dispatch's source ranks per row)."""
    x, idx, w = inp["x"].cuda(), inp["idx"].cuda(), inp["w"].cuda()
    rd = ref.ht_dispatch_ref(rank, world, E, inp["all_idx"], inp["all_w"])
    layout, err = _attempt(lambda: buf.get_dispatch_layout(idx, E), portep)
    if err is not None:
        return err, None, None, rd
    per_rank, per_rdma, per_expert, in_rank, _ = layout
    d, err = _attempt(
        lambda: buf.dispatch(
            x,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=idx,
            topk_weights=w,
        ),
        portep,
    )
    if err is not None:
        return err, None, None, rd
    y = ref.ht_expert_outputs(d[0].cpu(), rank, rd["src_rank"]).cuda()
    if late_s:
        time.sleep(late_s)
    c, cerr = _attempt(lambda: buf.combine(y, d[4], topk_weights=d[2]), portep)
    return None, c, cerr, rd


def _check_ht_combined(tally, what, c, inp, world, allow_poison):
    """combined_x: each row the BF16 rounding of the receiving ranks' expert outputs, or all NaN where allow_poison.
    Returns the number of NaN rows."""
    torch.cuda.synchronize()
    got = c[0].cpu()
    in_rank = torch.zeros(inp["idx"].size(0), world, dtype=torch.bool)
    e_l = inp["E"] // world
    for k in range(inp["idx"].size(1)):
        valid = inp["idx"][:, k] >= 0
        in_rank[valid.nonzero().flatten(), (inp["idx"][valid, k] // e_l)] = True
    ref64, abs64 = ref.ht_combine_expert_ref(inp["x"], in_rank, dist.get_rank())
    bad = ref.combine_mismatch(got, ref64, abs64, num_terms=world + 2).any(1)
    nan_rows = torch.isnan(got.float()).all(1)
    wrong = bad & ~nan_rows if allow_poison else bad
    tally.true(not bool(wrong.any()), f"{what}: {int(wrong.sum())} of {got.size(0)} combined rows are wrong")
    return int(nan_rows.sum())


def ht_late_peer_body(rank, world, rpn, transport, seed, shape, timeout_s, late_s):
    """Normal mode: the last rank makes a combine late_s > timeout_s after the others. Each combine's rows are
    exactly right or poisoned (the on-time ranks': poisoned, they timed out), the next call raises on every rank, and
    a new Buffer gives exact results again."""
    import deepep_workers as dw
    import portep

    torch.cuda.set_device(rank % torch.cuda.device_count())
    tally = _Tally(rank)
    N, H, E, K = shape

    def make():
        return portep.Buffer(
            dist.group.WORLD,
            256 << 20,
            0,
            num_ranks_per_node=rpn,
            transport=transport,
            timeout_s=timeout_s,
            explicitly_destroy=True,
            backend="cuda",
        )

    inputs = []
    for i in range(4):
        inp = dw.make_ht_inputs(rank, seed + i, N, H, K, E)
        inp["E"] = E
        inp["all_idx"] = [t.cpu() for t in _all_idx(inp["idx"].cuda())]
        inp["all_w"] = [t.cpu() for t in _all_idx(inp["w"].cuda())]
        inputs.append(inp)

    def exact_round(what, buf, inp):
        err, c, cerr, _ = _ht_round(portep, buf, rank, world, inp, E)
        tally.true(err is None and cerr is None, f"{what} raised {err or cerr!r:.300}")
        if c is not None:
            _check_ht_combined(tally, what, c, inp, world, allow_poison=False)

    buf = make()
    exact_round("the first round", buf, inputs[0])
    dist.barrier()
    late = rank == world - 1
    err, c, cerr, _ = _ht_round(portep, buf, rank, world, inputs[1], E, late_s if late else 0.0)
    tally.true(err is None, f"the dispatch before the late combine raised {err!r:.300}")
    poisoned = _check_ht_combined(tally, "the late combine", c, inputs[1], world, True) if c is not None else 0
    if not late:
        tally.true(poisoned > 0 or cerr is not None, "the on-time rank's combine returned no poison and raised nothing")
    dist.barrier()
    err, _, _, _ = _ht_round(portep, buf, rank, world, inputs[2], E)
    tally.true(err is not None, "the call after a failed combine did not raise")
    buf.destroy()
    dist.barrier()
    buf = make()
    exact_round("a new Buffer's round", buf, inputs[3])
    buf.destroy()
    return tally.result()


def bad_input_skipping_body(rank, world, rpn, transport, nvlink, seed, shape, timeout_s):
    """As bad_input_body, but each rank makes a round's dispatch and combine inside one try block and skips the rest
    of the round on any exception, a DroppedInput included (not what a caller should do: a DroppedInput's call was
    made, and its pair must follow). Rank 0 may then skip a combine its peers make: whatever any call returns on any
    rank is still exactly right or poisoned, and after clean_low_latency_buffer on every rank the results are exact."""
    import portep

    torch.cuda.set_device(rank % torch.cuda.device_count())
    tally = _Tally(rank)
    r = Rank(portep, rank, world, shape, rpn, transport, nvlink, timeout_s)
    inputs = [Inputs(rank, seed + i, *shape, bad=(i == 2 and rank == 0)) for i in range(7)]
    returned = []  # (round, what, results) of every call that returned
    for i in range(6):
        try:
            d = r.buf.low_latency_dispatch(inputs[i].x.cuda(), inputs[i].sent.cuda(), r.T, r.E, use_fp8=False)
            returned.append((i, "dispatch", d))
            y = gpu_expert_outputs(d[0], d[2][1], rank)
            c = r.buf.low_latency_combine(y, inputs[i].sent.cuda(), inputs[i].w.cuda(), d[2])
            returned.append((i, "combine", c))
        except Exception:  # noqa: BLE001 - the habit this test models
            continue
    torch.cuda.synchronize()
    for i, what, out in returned:
        if what == "dispatch":
            check_dispatch(tally, f"round {i}: dispatch", out, inputs[i], rank, r.E_l, allow_poison=True)
        else:
            check_combine(tally, f"round {i}: combine", out[0], inputs[i], rank, allow_poison=True)
    dist.barrier()
    r.buf.clean_low_latency_buffer(r.T, r.H, r.E)
    calls = r.round(inputs[6])
    _, errors = r.check(tally, "the round after clean", inputs[6], calls, allow_poison=False)
    tally.true(not errors, f"the round after clean raised {errors!r:.300}")
    r.buf.destroy()
    return tally.result()
