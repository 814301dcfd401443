"""Per-rank bodies of the GPU tests of what an application does around portep's calls: CUDA's hardware queues as the
application left them, host reads of results right after a call (pageable copies while the receive still waits),
kernels new to the process launched while an exchange is in flight, and out-of-range expert indices in CUDA
tensors. Combines take the test experts' outputs (deepep_reference.ll_expert_outputs: distinct per expert and
source rank) and are checked against their float64 weighted sum. Each body returns its failures and the number of
comparisons it made."""

import torch
import torch.distributed as dist

import deepep_reference as ref

BF16 = torch.bfloat16


def _all_idx(idx):
    out = [torch.empty_like(idx) for _ in range(dist.get_world_size())]
    dist.all_gather(out, idx)
    return out


def _buffer(portep, T, H, E, rpn, transport, allow_nvlink, timeout_s):
    nbytes = portep.Buffer.get_low_latency_rdma_size_hint(T, H, dist.get_world_size(), E)
    return portep.Buffer(
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


class _Tally:
    """Failed checks as 'rank R: message' strings, and the number of comparisons made."""

    def __init__(self, rank):
        self.rank, self.failures, self.checks = rank, [], 0

    def true(self, cond, msg):
        self.checks += 1
        if not cond:
            self.failures.append(f"rank {self.rank}: {msg}")
        return bool(cond)

    def result(self):
        return {"failures": self.failures, "checks": self.checks}


def _check_counts(tally, counts, all_idx, E_l, what=""):
    """DeepEP's count check: each local expert's recv_count against the gathered topk_idx (CPU ints in)."""
    rank = tally.rank
    for i, got in enumerate(counts):
        want = sum(int((t == rank * E_l + i).sum()) for t in all_idx)
        tally.true(got == want, f"{what}expert {rank * E_l + i} received {got} tokens, expected {want}")


def _expert_outputs(recv_x, handle, rank):
    """The test experts' outputs of an LL dispatch's received BF16 rows (ref.ll_expert_outputs), computed on the
    CPU once the current stream's work (the dispatch's receive) is done, on the GPU."""
    torch.cuda.current_stream().synchronize()
    return ref.ll_expert_outputs(recv_x.cpu(), handle[1].cpu(), rank).cuda()


def _check_combined(tally, what, got, x, idx, w):
    """got (CPU) is the float64 weighted sum of the experts' outputs for x (ref.ll_combine_expert_ref)."""
    ref64, abs64 = ref.ll_combine_expert_ref(x, idx, w, tally.rank)
    bad = ref.combine_mismatch(got, ref64, abs64, num_terms=idx.size(1))
    where = ""
    if bad.any():
        i, j = bad.nonzero()[0].tolist()
        where = f"; first at [{i}, {j}]: got {got[i, j].item()}, expected {ref64[i, j].item():.6g}"
    tally.true(
        not bool(bad.any()),
        f"{what}: {int(bad.sum())}/{bad.numel()} elements of combined_x are not the "
        f"weighted sum of the experts' outputs{where}",
    )


def application_habits_body(rank, world, rpn, transport, allow_nvlink, seed, T, H, E, K, rounds):
    """The test sets CUDA_DEVICE_MAX_CONNECTIONS, so portep's import leaves CUDA's hardware queues as the application
    chose (as when CUDA is set up before portep is imported). Each round: an LL dispatch with async_finish (or a
    hook), then every expert's recv_count read with .item() at once (a pageable copy queued behind the receive), as
    DeepEP's test does; a kernel new to this process launched while a receive waits; then a combine of the test
    experts' outputs (computed on the CPU after those reads), read right after it and checked against their
    float64 weighted sum."""
    import portep

    torch.cuda.set_device(rank % torch.cuda.device_count())
    tally = _Tally(rank)
    tally.true(bool(portep.config.CUDA_CONNECTIONS_NOTE), "portep set CUDA's queues itself")

    g = torch.Generator().manual_seed(seed + rank)
    buf = _buffer(portep, T, H, E, rpn, transport, allow_nvlink, 30)
    E_l = E // world
    fresh = [
        lambda t: torch.special.i0e(t),
        lambda t: torch.special.erfcx(t),
        lambda t: torch.special.ndtri(t),
        lambda t: torch.special.log_ndtr(t),
        lambda t: torch.special.spherical_bessel_j0(t),
    ]
    for r in range(rounds):
        idx = torch.topk(torch.rand(T, E, generator=g), K, dim=1).indices
        idx[torch.randint(0, T, (6,), generator=g), torch.randint(0, K, (6,), generator=g)] = -1
        x = (torch.randn(T, H, generator=g) * 0.5).to(BF16)
        w = torch.rand(T, K, generator=g) + 0.1
        all_idx = [t.cpu() for t in _all_idx(idx.cuda())]
        hook_round = r % 2 == 1
        recv_x, count, handle, event, hook = buf.low_latency_dispatch(
            x.cuda(), idx.cuda(), T, E, use_fp8=False, async_finish=not hook_round, return_recv_hook=hook_round
        )
        if hook_round:
            fresh[r % len(fresh)](torch.rand(64, device="cuda"))  # first launch of this kernel mid-exchange
            hook()
        else:
            event.current_stream_wait()
        counts = [count[i].item() for i in range(E_l)]  # pageable copies, the receive possibly still running
        _check_counts(tally, counts, all_idx, E_l, f"round {r}: ")
        y = _expert_outputs(recv_x, handle, rank)  # only now: the reads above stay right behind the call
        combined, event, hook = buf.low_latency_combine(
            y, idx.cuda(), w.cuda(), handle, async_finish=not hook_round, return_recv_hook=hook_round
        )
        if hook_round:
            hook()
        else:
            fresh[(r + 1) % len(fresh)](torch.rand(64, device="cuda"))
            event.current_stream_wait()
        got = combined.float().cpu()  # pageable again
        _check_combined(tally, f"round {r}", got, x, idx, w)
    torch.cuda.synchronize()
    buf.destroy()
    return tally.result()


def bad_expert_body(rank, world, rpn, transport, allow_nvlink, seed, T, H, E, K):
    """Rank 0's topk_idx holds one entry == num_experts. get_dispatch_layout and the LL dispatch on CUDA tensors
    take it without a host synchronization and leave that selection out (every other count and row as with -1
    there); the call that reported it, or the next one, raises a DroppedInput (a ValueError) on rank 0 naming the
    token, column and value, after launching its kernels and with its results attached, so rank 0 goes on in step
    with its peer. Then both ranks go on with clean inputs, without and with a receive hook: the Buffer is usable.
    Every combine (of the test experts' outputs) against the float64 weighted sum with the entry left out."""
    import portep

    torch.cuda.set_device(rank % torch.cuda.device_count())
    g = torch.Generator().manual_seed(seed + rank)
    buf = _buffer(portep, T, H, E, rpn, transport, allow_nvlink, 30)
    E_l, tally = E // world, _Tally(rank)
    idx = torch.topk(torch.rand(T, E, generator=g), K, dim=1).indices
    bad = idx.clone()
    if rank == 0:
        bad[7, 3] = E
    x = ref.ll_struct_x(rank, T, H)
    w = torch.rand(T, K, generator=g) + 0.1
    clean = bad.clone()
    clean[clean >= E] = -1
    all_clean = [t.cpu() for t in _all_idx(clean.cuda())]
    raised = []

    def call(fn, what):
        """fn()'s results; a DroppedInput is recorded (and checked) and its attached results returned."""
        try:
            return fn()
        except portep.DroppedInput as e:
            raised.append(what)
            tally.true(f"token 7, top-k column 3, value {E}" in str(e), f"{what} raised without naming the entry: {e}")
            tally.true(e.results is not None, f"{what} raised without its results")
            return e.results

    def expect_one_notice(what):
        want = 1 if rank == 0 else 0
        tally.true(len(raised) == want, f"{what}: {len(raised)} notices raised ({raised}), expected {want}")
        raised.clear()

    layout = call(lambda: buf.get_dispatch_layout(bad.cuda(), E), "get_dispatch_layout")
    call(lambda: buf.low_latency_dispatch(x.cuda(), clean.cuda(), T, E, use_fp8=False), "the dispatch after it")
    torch.cuda.synchronize()
    expect_one_notice("get_dispatch_layout with the entry, then a clean dispatch")
    want = ref.layout_ref(clean, E, world, world)[2]
    tally.true(torch.equal(layout[2].cpu(), want), "num_tokens_per_expert counts the out-of-range entry")
    recv_x, count, handle, _, _ = call(
        lambda: buf.low_latency_dispatch(x.cuda(), bad.cuda(), T, E, use_fp8=False), "the dispatch with the entry"
    )
    torch.cuda.synchronize()
    _check_counts(tally, count.cpu().tolist(), all_clean, E_l, "the dispatch with the entry: ")
    y = _expert_outputs(recv_x, handle, rank)
    out = call(lambda: buf.low_latency_combine(y, bad.cuda(), w.cuda(), handle), "the combine after it")
    torch.cuda.synchronize()
    expect_one_notice("a dispatch with the entry, then its combine")
    _check_combined(tally, "the combine of the dispatch with the entry", out[0].cpu(), x, clean, w)
    for hook in (False, True):  # usable afterwards, on both ranks
        recv_x, count, handle, _, h = buf.low_latency_dispatch(
            x.cuda(), clean.cuda(), T, E, use_fp8=False, return_recv_hook=hook
        )
        if hook:
            h()
        y = _expert_outputs(recv_x, handle, rank)
        combined, _, h = buf.low_latency_combine(y, clean.cuda(), w.cuda(), handle, return_recv_hook=hook)
        if hook:
            h()
        torch.cuda.synchronize()
        _check_counts(tally, count.cpu().tolist(), all_clean, E_l, f"hook={hook} after the notice: ")
        _check_combined(tally, f"hook={hook} after the notice", combined.cpu(), x, clean, w)
    buf.destroy()
    return tally.result()


def profile_body(rank, world, rpn, transport, allow_nvlink, seed, T, H, E, K, iterations):
    """DeepEP's profiling conventions, which tools written for DeepEP rely on (its bench_kineto): over LL
    dispatch + combine calls, without and with a receive hook, a torch profile holds exactly one kernel name that
    contains "dispatch" and one that contains "combine", launched once per call, or twice (send and receive phase)
    with the hook. Counts the comparisons it made (a launch count only where one name matched)."""
    import portep

    torch.cuda.set_device(rank % torch.cuda.device_count())
    g = torch.Generator().manual_seed(seed + rank)
    buf = _buffer(portep, T, H, E, rpn, transport, allow_nvlink, 30)
    idx = torch.topk(torch.rand(T, E, generator=g), K, dim=1).indices.cuda()
    x = torch.randn(T, H, generator=g).to(BF16).cuda()
    w = torch.rand(T, K, generator=g).cuda()
    tally = _Tally(rank)
    for hook_mode in (False, True):

        def step():
            recv_x, _, handle, _, hook = buf.low_latency_dispatch(
                x, idx, T, E, use_fp8=True, return_recv_hook=hook_mode
            )
            if hook_mode:
                hook()
            sim = recv_x[0].float().mul(recv_x[1].repeat_interleave(128, dim=2)).to(BF16)
            _, _, hook = buf.low_latency_combine(sim, idx, w, handle, return_recv_hook=hook_mode)
            if hook_mode:
                hook()

        step()  # warm-up
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(iterations):
                step()
            torch.cuda.synchronize()
        launches = {}
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                launches.setdefault(ev.name, 0)
                launches[ev.name] += 1
        for word in ("dispatch", "combine"):
            names = [n for n in launches if word in n]
            per_call = 2 if hook_mode else 1
            if tally.true(len(names) == 1, f"hook={hook_mode}: {len(names)} kernel names contain {word!r}: {names}"):
                tally.true(
                    launches[names[0]] == per_call * iterations,
                    f"hook={hook_mode}: {names[0]} launched {launches[names[0]]} times in {iterations} calls, "
                    f"expected {per_call * iterations}",
                )
    torch.cuda.synchronize()
    buf.destroy()
    return tally.result()
