"""Per-rank bodies of the tests of what a Buffer does after a failure on one side (test_robustness.py): one rank's
call refused while its peers make it, a peer late past the timeout, a peer that dies or leaves. Every result a call
returns is checked against the references (deepep_workers), so a wrong result can never pass as a recovery; every
call that must fail is timed, so a wait that runs out its timeout instead of failing fast is caught."""

import time

import torch
import torch.distributed as dist

import deepep_reference as ref
import deepep_workers as w
import portep

MiB = 1 << 20
T, H, K = 32, 512, 4


class CallerDefaults:
    """A Buffer whose every call (construction too) runs with torch's default dtype and device set as DeepEP's tests
    set them (utils.init_dist: bfloat16 and 'cuda'); on the host backend 'meta', where any tensor the library makes
    by the default device breaks loudly. The test's own inputs and references keep the CPU defaults."""

    def __init__(self, make, device):
        self._device = device
        self._buf = self._run(make)

    def _run(self, fn, *args, **kwargs):
        dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(self._device):
                return fn(*args, **kwargs)
        finally:
            torch.set_default_dtype(dtype)

    def __getattr__(self, name):
        attr = getattr(self._buf, name)
        return (lambda *a, **k: self._run(attr, *a, **k)) if callable(attr) else attr


def _buffer(world, rpn, transport, timeout_s, E, shrink=False, backend="host", defaults=None):
    """An LL-mode Buffer (with room for the normal mode); backend='cuda': on this rank's GPU, wrapped so the CPU
    checks run unchanged (gpu_ll_adapter: a kernel failure raises once the call's results are fetched).
    defaults: a device to make torch's default (and bfloat16 the default dtype) during every Buffer call."""
    ll = portep.Buffer.get_low_latency_rdma_size_hint(T, H, world, E)
    if backend == "cuda":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())

    def make():
        return portep.Buffer(
            dist.group.WORLD,
            64 * MiB,
            ll,
            low_latency_mode=True,
            num_ranks_per_node=rpn,
            transport=transport,
            timeout_s=timeout_s,
            explicitly_destroy=True,
            enable_shrink=shrink,
            backend=backend,
        )

    buf = make() if defaults is None else CallerDefaults(make, defaults)
    if backend == "cuda":
        from gpu_ll_adapter import CudaLLAdapter

        return CudaLLAdapter(buf)
    return buf


def _bad_idx(idx, bad, E, wrong_dtype):
    """topk_idx as a round sends it: as made (bad False), of a wrong dtype (bad True or "dtype"), or with an expert id
    equal to num_experts (bad "expert")."""
    if not bad:
        return idx
    if bad == "expert":
        out = idx.clone()
        out[0, 0] = E
        return out
    return wrong_dtype(idx)


class LLRound:
    """One LL dispatch + combine with inputs every rank knows (gathered before any Buffer call), checked."""

    def __init__(self, world, seed, E):
        rank = dist.get_rank()
        self.E, self.world = E, world
        self.inp = w.make_ll_inputs(rank, seed, T, H, K, E, holes=3)
        self.all_idx = w.all_gather(self.inp["idx"])
        self.lref = w.LLRef(rank, world, T, H, E, self.all_idx)
        self.xs = [ref.ll_struct_x(j, T, H) for j in range(world)]

    def run(self, ck, buf, bad=False):
        idx = _bad_idx(self.inp["idx"], bad, self.E, lambda t: t.float())  # refused by validation
        res = buf.low_latency_dispatch(self.inp["x_struct"], idx, T, self.E, use_fp8=False)
        w._check_ll_dispatch(ck, res, self.lref, self.xs, "struct", False, False, False, False, True)
        sim = w._ll_expert_y(res, dist.get_rank(), False, False)
        comb = buf.low_latency_combine(sim, self.inp["idx"], self.inp["w"], res[2])
        w._check_ll_combine(ck, comb[0], None, self.inp["x_struct"], None, self.inp["idx"], self.inp["w"], False, False)


class HTRound:
    """One normal-mode dispatch + combine, inputs gathered first, checked (deepep_workers' references)."""

    def __init__(self, world, rpn, seed, E):
        rank = dist.get_rank()
        self.E, self.world, self.rpn = E, world, rpn
        self.inp = w.make_ht_inputs(rank, seed, 64, H, K, E)
        self.layout = ref.layout_ref(self.inp["idx"], E, world, rpn)
        self.rd = ref.ht_dispatch_ref(rank, world, E, w.all_gather(self.inp["idx"]), w.all_gather(self.inp["w"]))
        self.all_x = w.all_gather(self.inp["x"])

    def run(self, ck, buf, bad=False):
        ntpr, rdma, ntpe, itir = self.layout
        idx = _bad_idx(self.inp["idx"], bad, self.E, lambda t: t.to(torch.int32))  # refused by validation
        out = buf.dispatch(
            self.inp["x"],
            num_tokens_per_rank=ntpr,
            num_tokens_per_rdma_rank=rdma,
            is_token_in_rank=itir,
            num_tokens_per_expert=ntpe,
            topk_idx=idx,
            topk_weights=self.inp["w"],
        )
        ck.equal("recv_x", out[0], ref.gather_rows(self.all_x, self.rd["src_rank"], self.rd["src_token"]))
        ck.equal("recv_topk_idx", out[1], self.rd["recv_topk_idx"].to(torch.int64))
        y = ref.ht_expert_outputs(out[0], dist.get_rank(), self.rd["src_rank"])
        c = buf.combine(y, out[4], topk_weights=out[2])
        w._check_ht_combine(
            ck,
            c,
            self.inp["x"],
            itir,
            None,
            True,
            ref.ht_combine_weights_ref(self.inp["idx"], self.inp["w"], itir, self.E // self.world),
        )


def _attempt(ck, what, fn):
    """fn() -> (exception or None, seconds)."""
    t0 = time.monotonic()
    try:
        fn()
        error = None
    except Exception as e:  # noqa: BLE001 - checked by the caller
        error = e
    return error, time.monotonic() - t0


def _expect_out_of_step(ck, what, fn, fast_s):
    """Every rank's call must raise (never return data) and fast, naming what to do."""
    error, took = _attempt(ck, what, fn)
    if error is None:
        ck.fail(f"{what}: returned a result while the ranks are out of step")
        return
    ck.true(
        "clean_low_latency_buffer" in str(error)
        or "out of step" in str(error)
        or "refused" in str(error)
        or "failed" in str(error),
        f"{what}: raised without saying the ranks are out of step: {error!r:.300}",
    )
    ck.true(took < fast_s, f"{what}: raised after {took:.2f} s, not within {fast_s} s")


def one_sided_refusal_body(rank, world, rpn, transport, mode, seed, backend="host", bad="dtype"):
    """Rank 0 passes an input its validation refuses (bad: a topk_idx of the wrong dtype, or holding an expert id
    equal to num_experts, _bad_idx) while every other rank makes the call: rank 0 raises the
    ValueError, every peer raises within a second (not after the 20 s timeout) naming rank 0's refusal; the next
    calls raise on every rank (out of step: never data); clean_low_latency_buffer resynchronises, and the calls
    after it return correct results."""
    ck = w.Checker(rank)
    E, timeout_s = 4 * world, 20.0
    buf = _buffer(world, rpn, transport, timeout_s, E, backend=backend)
    rounds = [LLRound(world, seed + i, E) if mode == "ll" else HTRound(world, rpn, seed + i, E) for i in range(6)]
    ck.step = "in step"
    rounds[0].run(ck, buf)
    ck.step = "the call rank 0 refuses"
    error, took = _attempt(ck, "refused round", lambda: rounds[1].run(ck, buf, bad=rank == 0 and bad))
    if rank == 0:
        ck.true(isinstance(error, (TypeError, ValueError)), f"rank 0's bad input gave {error!r:.300}")
    else:
        ck.true(
            isinstance(error, RuntimeError) and "rank 0" in str(error) and "refused" in str(error),
            f"a peer of the refusing rank raised {error!r:.300}",
        )
        ck.true(took < 2.0, f"a peer of the refusing rank raised after {took:.2f} s (timeout {timeout_s} s)")
    for i in range(2, 4):
        ck.step = f"call {i} after the refusal"
        _expect_out_of_step(ck, ck.step, lambda: rounds[i].run(ck, buf), 2.0)
    ck.step = "clean_low_latency_buffer"
    buf.clean_low_latency_buffer(T, H, E)
    for i in range(4, 6):
        ck.step = f"call {i} after clean_low_latency_buffer"
        rounds[i].run(ck, buf)
    buf.destroy()
    return {"failures": ck.failures, "checks": ck.num_checks}


def refused_everywhere_body(rank, world, rpn, transport, mode, seed):
    """Every rank refuses the same call: nothing moved, so the next calls go on without a resynchronisation."""
    ck = w.Checker(rank)
    E = 4 * world
    buf = _buffer(world, rpn, transport, 20.0, E)
    rounds = [LLRound(world, seed + i, E) if mode == "ll" else HTRound(world, rpn, seed + i, E) for i in range(4)]
    rounds[0].run(ck, buf)
    for i in (1, 2):
        ck.step = f"refused everywhere #{i}"
        error, took = _attempt(ck, ck.step, lambda: rounds[i].run(ck, buf, bad=True))
        ck.true(isinstance(error, (TypeError, ValueError)), f"the refused call gave {error!r:.300}")
    ck.step = "after the refusals"
    rounds[3].run(ck, buf)
    buf.destroy()
    return {"failures": ck.failures, "checks": ck.num_checks}


def late_peer_body(rank, world, rpn, transport, mode, seed, timeout_s, late_s):
    """The last rank starts its call late_s > timeout_s after the others: they raise after about timeout_s; the
    late rank's call raises too or returns correct results; the next calls raise on every rank until
    clean_low_latency_buffer, after which they are correct again."""
    ck = w.Checker(rank)
    E = 4 * world
    buf = _buffer(world, rpn, transport, timeout_s, E)
    rounds = [LLRound(world, seed + i, E) if mode == "ll" else HTRound(world, rpn, seed + i, E) for i in range(5)]
    rounds[0].run(ck, buf)
    late = rank == world - 1
    ck.step = "late peer"
    if late:
        time.sleep(late_s)
    error, took = _attempt(ck, ck.step, lambda: rounds[1].run(ck, buf))  # a returned result was checked in run()
    if not late:
        ck.true(isinstance(error, RuntimeError), f"waiting for the late rank gave {error!r:.300}")
        ck.true(timeout_s * 0.8 < took < timeout_s + 5, f"waiting for the late rank raised after {took:.2f} s")
    dist.barrier()  # every rank is past the late call before the next ones (gloo, outside the Buffer)
    for i in (2, 3):
        ck.step = f"call {i} after the late one"
        _expect_out_of_step(ck, ck.step, lambda: rounds[i].run(ck, buf), 2.0)
    ck.step = "clean_low_latency_buffer"
    buf.clean_low_latency_buffer(T, H, E)
    ck.step = "after clean_low_latency_buffer"
    rounds[4].run(ck, buf)
    buf.destroy()
    return {"failures": ck.failures, "checks": ck.num_checks}


def dead_peer_body(rank, world, rpn, transport, how, seed, backend="host", mode="ll", fast_s=1.5):
    """The last rank dies (os._exit) or destroys its Buffer instead of making a call (mode: LL, or normal mode):
    every other rank's call raises within fast_s seconds, naming it, although the timeout is 30 s."""
    ck = w.Checker(rank)
    E = 4 * world
    buf = _buffer(world, rpn, transport, 30.0, E, backend=backend)
    rounds = [LLRound(world, seed + i, E) if mode == "ll" else HTRound(world, rpn, seed + i, E) for i in range(2)]
    rounds[0].run(ck, buf)
    # A call returns once this rank has what it needs; its own last writes may still be in flight through its
    # proxy, and a process that exits loses them. Every rank is past the first round before the last one dies.
    w.all_gather(0)
    if rank == world - 1:
        if how == "exit":
            import os

            os._exit(0)
        buf.destroy()
        return {"failures": ck.failures, "checks": ck.num_checks}
    error, took = _attempt(ck, "call without the last rank", lambda: rounds[1].run(ck, buf))
    words = "process gone" if how == "exit" else "destroyed its Buffer"
    ck.true(
        isinstance(error, RuntimeError) and words in str(error) and f"rank {world - 1}" in str(error),
        f"the call without rank {world - 1} raised {error!r:.300}",
    )
    ck.true(took < fast_s, f"the call without rank {world - 1} raised after {took:.2f} s (timeout 30 s)")
    buf.destroy()
    return {"failures": ck.failures, "checks": ck.num_checks}


def modes_in_turn_body(rank, world, rpn, transport, seed):
    """DeepEP's --test-ll-compatibility on one Buffer (LL mode, NVL and RDMA bytes): normal-mode rounds across the
    nodes, then clean_low_latency_buffer, then LL rounds; every result checked against the references."""
    ck = w.Checker(rank)
    E = 4 * world
    buf = _buffer(world, rpn, transport, 30.0, E)
    for i in range(2):
        ck.step = f"normal mode, round {i}"
        HTRound(world, rpn, seed + i, E).run(ck, buf)
    ck.step = "clean_low_latency_buffer"
    buf.clean_low_latency_buffer(T, H, E)
    for i in range(2):
        ck.step = f"low-latency mode, round {i}"
        LLRound(world, seed + 10 + i, E).run(ck, buf)
    buf.destroy()
    return {"failures": ck.failures, "checks": ck.num_checks}


def zero_token_rank_body(rank, world, rpn, transport, seed, defaults=None):
    """The last rank has no tokens and top-1 routing, its empty inputs made with odd strides (an empty tensor is
    contiguous whatever its strides, e.g. [0, 1] with strides (1, 0) from an expression on it): normal-mode and LL
    dispatch + combine run on every rank and give the references' results. defaults: as _buffer's."""
    ck = w.Checker(rank)
    E, k = 4 * world, 1
    buf = _buffer(world, rpn, transport, 20.0, E, defaults=defaults)
    empty = rank == world - 1
    n = 0 if empty else T
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(n, H, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, E, (n, k), generator=g)
    wts = torch.rand(n, k, generator=g)
    if empty:
        x = torch.empty_strided((0, H), (1, 0), dtype=torch.bfloat16)
        idx = torch.empty_strided((0, k), (1, 0), dtype=torch.int64)
        wts = torch.empty_strided((0, k), (1, 0), dtype=torch.float32)
    all_idx, all_w, all_x = w.all_gather(idx.contiguous()), w.all_gather(wts.contiguous()), w.all_gather(x.contiguous())
    ck.step = "normal mode"
    ntpr, rdma, ntpe, itir = ref.layout_ref(idx.contiguous(), E, world, rpn)
    rd = ref.ht_dispatch_ref(rank, world, E, all_idx, all_w)
    out = buf.dispatch(
        x,
        num_tokens_per_rank=ntpr,
        num_tokens_per_rdma_rank=rdma,
        is_token_in_rank=itir,
        num_tokens_per_expert=ntpe,
        topk_idx=idx,
        topk_weights=wts,
    )
    ck.equal("recv_x", out[0], ref.gather_rows(all_x, rd["src_rank"], rd["src_token"]))
    ck.equal("recv_topk_weights", out[2], rd["recv_topk_weights"])
    c = buf.combine(ref.ht_expert_outputs(out[0], rank, rd["src_rank"]), out[4], topk_weights=out[2])
    w._check_ht_combine(
        ck,
        c,
        x.contiguous(),
        itir,
        None,
        True,
        ref.ht_combine_weights_ref(idx.contiguous(), wts.contiguous(), itir, E // world),
    )
    ck.step = "low-latency mode"
    lref = w.LLRef(rank, world, T, H, E, all_idx)
    xs = [ref.ll_struct_x(j, int(all_idx[j].size(0)), H) for j in range(world)]
    xl = ref.ll_struct_x(rank, n, H) if n else torch.empty_strided((0, H), (1, 0), dtype=torch.bfloat16)
    res = buf.low_latency_dispatch(xl, idx, T, E, use_fp8=False)
    w._check_ll_dispatch(ck, res, lref, xs, "struct", False, False, False, False, True)
    sim = w._ll_expert_y(res, dist.get_rank(), False, False)
    comb = buf.low_latency_combine(sim, idx, wts, res[2])
    w._check_ll_combine(ck, comb[0], None, xl.contiguous(), None, idx.contiguous(), wts.contiguous(), False, False)
    buf.destroy()
    return {"failures": ck.failures, "checks": ck.num_checks}


def view_after_destroy_body(rank, world, rpn, transport):
    """Views from get_local_buffer_tensor (both buffers) and Channel.buffer stay usable after destroy(): they
    keep the memory mapped (reads give what was written, writes land), never a SIGSEGV."""
    ck = w.Checker(rank)
    buf = _buffer(world, rpn, transport, 20.0, 4 * world)
    views = [
        buf.get_local_buffer_tensor(torch.int32, (1024,)),
        buf.get_local_buffer_tensor(torch.float32, (8, 16), offset=4096, use_rdma_buffer=True),
    ]
    for i, v in enumerate(views):
        v.fill_(7 + i)
    raw = buf.runtime.channel.buffer[8192:8256]  # past both views
    raw.fill_(3)
    buf.destroy()
    import gc

    gc.collect()
    for i, v in enumerate(views):
        ck.true(bool((v == 7 + i).all()), f"view {i} after destroy() does not hold what was written")
        v.add_(1)
        ck.true(bool((v == 8 + i).all()), f"view {i} after destroy() did not take a write")
    ck.true(bool((raw == 3).all()), "Channel.buffer's view after destroy() does not hold what was written")
    try:
        buf.get_local_buffer_tensor(torch.int32, (4,))
        ck.fail("get_local_buffer_tensor on a destroyed Buffer did not raise")
    except RuntimeError as e:
        ck.true("destroyed" in str(e), f"get_local_buffer_tensor after destroy raised {e!r}")
    return {"failures": ck.failures, "checks": ck.num_checks}


def hook_after_destroy_body(rank, world, rpn, transport):
    """A receive hook outliving its Buffer (destroy() before it was called) raises naming that, never touching the
    freed memory; a hook called twice raises too, and the Buffer goes on in step."""
    ck = w.Checker(rank)
    E = 4 * world
    buf = _buffer(world, rpn, transport, 20.0, E)
    inp = w.make_ll_inputs(rank, 13, T, H, K, E)
    res = buf.low_latency_dispatch(inp["x_struct"], inp["idx"], T, E, use_fp8=False, return_recv_hook=True)
    res[4]()
    w.check_hook_runs_once(ck, res[4])
    LLRound(world, 17, E).run(ck, buf)  # in step: a good round after the refused second call
    hook = buf.low_latency_dispatch(inp["x_struct"], inp["idx"], T, E, use_fp8=False, return_recv_hook=True)[4]
    dist.barrier()
    buf.destroy()
    try:
        hook()
        ck.fail("a receive hook called after destroy() did not raise")
    except RuntimeError as e:
        ck.true("destroyed" in str(e), f"a receive hook called after destroy() raised {e!r}")
    return {"failures": ck.failures, "checks": ck.num_checks}


def killed_while_building_body(rank, world):
    """The last rank is killed while it builds its Buffer (its segments exist, nobody has mapped them yet): returns
    what that rank held and what /dev/shm had then, for the test."""
    import os
    import signal

    from shm_probe import named_segments, shared_memfds

    pids = w.all_gather(os.getpid())
    if rank == world - 1:
        # blocks in the bootstrap's exchange, which the others never join
        portep.Buffer(dist.group.WORLD, 1 * MiB, 0, num_ranks_per_node=world, timeout_s=60, explicitly_destroy=True)
        return None
    victim = pids[world - 1]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not shared_memfds(victim):
        time.sleep(0.05)
    held = shared_memfds(victim)
    named_then = named_segments(victim)
    os.kill(victim, signal.SIGKILL)
    while os.path.exists(f"/proc/{victim}/fd") and time.monotonic() < deadline + 30:
        time.sleep(0.05)
    return {
        "victim": victim,
        "held": held,
        "named_while_building": named_then,
        "left_after": named_segments(victim) + shared_memfds(victim),
    }


def _gathered_inputs(world, seeds, E):
    """{seed: (this rank's inputs, every rank's topk_idx)}, gathered now, while every rank is there."""
    rank = dist.get_rank()
    mine = {s: w.make_ll_inputs(rank, s, T, H, K, E, holes=3) for s in seeds}
    every = w.all_gather({s: inp["idx"] for s, inp in mine.items()})
    return {s: (mine[s], [every[j][s] for j in range(world)]) for s in seeds}


def _ll_checked_round(ck, buf, world, inputs, E, masked, tag):
    """An LL dispatch + combine in shrink mode, checked as if the masked ranks held no tokens and no experts:
    returns nothing; a wrong count, row or sum is a failed check."""
    rank = dist.get_rank()
    inp, all_idx = inputs
    E_l = E // world
    live_idx = [torch.full_like(t, -1) if j in masked else t for j, t in enumerate(all_idx)]
    lref = w.LLRef(rank, world, T, H, E, live_idx)
    xs = [ref.ll_struct_x(j, T, H) for j in range(world)]
    ck.step = f"{tag}: dispatch"
    res = buf.low_latency_dispatch(inp["x_struct"], inp["idx"], T, E, use_fp8=False)
    w._check_ll_dispatch(ck, res, lref, xs, "struct", False, False, False, False, True)
    ck.step = f"{tag}: combine"
    sim = w._ll_expert_y(res, dist.get_rank(), False, False)
    comb = buf.low_latency_combine(sim, inp["idx"], inp["w"], res[2])[0]
    own = inp["idx"].clone()
    own[(own >= 0) & torch.isin(own.clamp(min=0) // E_l, torch.tensor(sorted(masked), dtype=torch.int64))] = -1
    w._check_ll_combine(ck, comb, None, inp["x_struct"], None, own, inp["w"], False, False)


def _expect_mask(ck, buf, world, masked, tag):
    status = torch.zeros(world, dtype=torch.int32)
    buf.low_latency_query_mask_buffer(status)
    got = {int(i) for i in torch.nonzero(status).flatten()}
    ck.true(got == set(masked), f"{tag}: mask {sorted(got)}, expected {sorted(masked)}")


def shrink_body(rank, world, rpn, transport, seed, rounds, backend="host", defaults=None):
    """DeepEP's shrink mode: rank 1 leaves (destroys its Buffer) when it first dispatches, rank 3 when it first
    combines, rank 5 when it first cleans (where the group has them). The others' calls complete without them,
    mask them (query_mask_buffer shows exactly the ranks gone so far), their results count a masked rank's tokens
    and experts as absent, checked against the references, and each masking takes well under the 30 s timeout;
    clean_low_latency_buffer keeps the mask. Every rank that leaves waits in a gloo barrier for the end.
    defaults: as _buffer's."""
    ck = w.Checker(rank)
    E = 4 * world
    buf = _buffer(world, rpn, transport, 30.0, E, shrink=True, backend=backend, defaults=defaults)
    fails = {r: api for r, api in ((1, "dispatch"), (3, "combine"), (5, "clean")) if r < world}
    inputs = _gathered_inputs(world, [seed + i for i in range(rounds)] + [seed + 99], E)
    masked = set()
    for i in range(rounds):
        for api in ("dispatch", "combine", "clean"):
            leaving = {r for r, a in fails.items() if a == api and r not in masked}
            masked |= leaving
            if rank in masked:
                if rank in leaving:
                    buf.destroy()
                dist.barrier()
                return {"failures": ck.failures, "checks": max(ck.num_checks, 1)}
            if api == "dispatch":
                t0 = time.monotonic()
                _ll_checked_round(ck, buf, world, inputs[seed + i], E, masked, f"round {i}")
                ck.true(time.monotonic() - t0 < 10, f"round {i} took {time.monotonic() - t0:.1f} s")
                _expect_mask(ck, buf, world, masked, f"round {i} after dispatch and combine")
            elif api == "clean":
                buf.clean_low_latency_buffer(T, H, E)
                _expect_mask(ck, buf, world, masked, f"round {i} after clean")
    buf.low_latency_clean_mask_buffer()
    _expect_mask(ck, buf, world, set(), "after clean_mask_buffer")
    for r in sorted(masked):
        buf.low_latency_update_mask_buffer(r, True)
    _expect_mask(ck, buf, world, masked, "after update_mask_buffer")
    _ll_checked_round(ck, buf, world, inputs[seed + 99], E, masked, "after the mask functions")
    buf.destroy()
    dist.barrier()
    return {"failures": ck.failures, "checks": ck.num_checks}


def shrink_silent_rank_body(rank, world, rpn, transport, seed, timeout_s):
    """A rank that stays alive but stops calling (it neither leaves nor answers) is masked once the timeout passes:
    the others' call completes without it, checked."""
    ck = w.Checker(rank)
    E = 4 * world
    buf = _buffer(world, rpn, transport, timeout_s, E, shrink=True)
    inputs = _gathered_inputs(world, [seed, seed + 1], E)
    _ll_checked_round(ck, buf, world, inputs[seed], E, set(), "all answering")
    silent = world - 1
    w.all_gather(0)  # every rank is past the first round
    if rank != silent:
        t0 = time.monotonic()
        _ll_checked_round(ck, buf, world, inputs[seed + 1], E, {silent}, "one rank silent")
        took = time.monotonic() - t0
        ck.true(timeout_s * 0.8 < took < timeout_s * 3 + 5, f"masking the silent rank took {took:.1f} s")
        _expect_mask(ck, buf, world, {silent}, "after the silent rank's timeout")
    dist.barrier()
    buf.destroy()
    return {"failures": ck.failures, "checks": max(ck.num_checks, 1)}


_KEPT = []  # Buffers left alive until the process exits


def left_alive_body(rank, world, rpn, transport, out_dir):
    """A Buffer created with explicitly_destroy=True, used once, and kept alive without destroy() until the process
    exits (as one whose worker raised, or held in a reference cycle). An atexit handler registered before the Buffer
    (so that it runs after portep's, atexit's order being the reverse) writes how many proxy threads still run then:
    portep must have stopped them, or they would poll memory the process is tearing down. Returns the count while
    the Buffer lives."""
    import atexit
    import os

    from portep import native

    path = os.path.join(out_dir, f"rank{rank}.txt")

    def record():
        with open(path, "w") as f:
            f.write(str(native.live_proxy_threads()))

    atexit.register(record)
    buf = w.make_ll_buffer(rank, world, rpn, transport, T, H, 2 * world)
    inp = w.make_ll_inputs(rank, 3, T, H, K, 2 * world)
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(inp["x_rand"], inp["idx"], T, 2 * world, use_fp8=False)
    buf.low_latency_combine(recv_x, inp["idx"], inp["w"], handle)
    w.all_gather(None)
    _KEPT.append(buf)
    return native.live_proxy_threads()
