"""Per-rank bodies of the GPU tests of what an application does around portep's calls: CUDA's hardware queues as the
application left them, host reads of results right after a call (pageable copies while the receive still waits),
kernels new to the process launched while an exchange is in flight, and out-of-range expert indices in CUDA
tensors."""

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
    return portep.Buffer(dist.group.WORLD, 0, nbytes, low_latency_mode=True, num_ranks_per_node=rpn,
                         allow_nvlink_for_low_latency_mode=allow_nvlink, transport=transport, timeout_s=timeout_s,
                         explicitly_destroy=True, backend="cuda")


def _count_failures(rank, counts, all_idx, E_l):
    """DeepEP's count check: each local expert's recv_count against the gathered topk_idx (CPU ints in)."""
    failures = []
    for i, got in enumerate(counts):
        want = sum(int((t == rank * E_l + i).sum()) for t in all_idx)
        if got != want:
            failures.append(f"rank {rank}: expert {rank * E_l + i} received {got} tokens, expected {want}")
    return failures


def application_habits_body(rank, world, rpn, transport, allow_nvlink, seed, T, H, E, K, rounds):
    """The test sets CUDA_DEVICE_MAX_CONNECTIONS, so portep's import leaves CUDA's hardware queues as the application
    chose (as when CUDA is set up before portep is imported). Each round: an LL dispatch with async_finish (or a
    hook), then every expert's recv_count read with .item() at once (a pageable copy queued behind the receive), as
    DeepEP's test does; a kernel new to this process launched while a receive waits; then a combine, checked
    against x * sum(weights)."""
    import portep

    torch.cuda.set_device(rank % torch.cuda.device_count())
    failures = [] if portep.config.CUDA_CONNECTIONS_NOTE else [f"rank {rank}: portep set CUDA's queues itself"]

    g = torch.Generator().manual_seed(seed + rank)
    buf = _buffer(portep, T, H, E, rpn, transport, allow_nvlink, 30)
    E_l = E // world
    fresh = [lambda t: torch.special.i0e(t), lambda t: torch.special.erfcx(t), lambda t: torch.special.ndtri(t),
             lambda t: torch.special.log_ndtr(t), lambda t: torch.special.spherical_bessel_j0(t)]
    for r in range(rounds):
        idx = torch.topk(torch.rand(T, E, generator=g), K, dim=1).indices
        idx[torch.randint(0, T, (6,), generator=g), torch.randint(0, K, (6,), generator=g)] = -1
        x = (torch.randn(T, H, generator=g) * 0.5).to(BF16)
        w = torch.rand(T, K, generator=g) + 0.1
        all_idx = [t.cpu() for t in _all_idx(idx.cuda())]
        hook_round = r % 2 == 1
        recv_x, count, handle, event, hook = buf.low_latency_dispatch(
            x.cuda(), idx.cuda(), T, E, use_fp8=False, async_finish=not hook_round, return_recv_hook=hook_round)
        if hook_round:
            fresh[r % len(fresh)](torch.rand(64, device="cuda"))  # first launch of this kernel mid-exchange
            hook()
        else:
            event.current_stream_wait()
        counts = [count[i].item() for i in range(E_l)]  # pageable copies, the receive possibly still running
        failures += _count_failures(rank, counts, all_idx, E_l)
        combined, event, hook = buf.low_latency_combine(recv_x, idx.cuda(), w.cuda(), handle,
                                                        async_finish=not hook_round, return_recv_hook=hook_round)
        if hook_round:
            hook()
        else:
            fresh[(r + 1) % len(fresh)](torch.rand(64, device="cuda"))
            event.current_stream_wait()
        got = combined.float().cpu()  # pageable again
        d = ref.calc_diff(got, ref.ll_combine_ref(x, idx, w))
        if not d < 1e-5:
            failures.append(f"rank {rank} round {r}: combined_x calc_diff {d:.3g} >= 1e-5")
    torch.cuda.synchronize()
    buf.destroy()
    return {"failures": failures, "checks": rounds * (E_l + 1)}


def bad_expert_body(rank, world, rpn, transport, allow_nvlink, seed, T, H, E, K):
    """Rank 0's topk_idx holds one entry == num_experts. get_dispatch_layout and the LL dispatch on CUDA tensors
    take it without a host synchronization and leave that selection out (every other count and row as with -1
    there); the call that reported it, or the next one, raises a DroppedInput (a ValueError) on rank 0 naming the
    token, column and value, after launching its kernels and with its results attached, so rank 0 goes on in step
    with its peer. Then both ranks go on with clean inputs, without and with a receive hook: the Buffer is usable."""
    import portep

    torch.cuda.set_device(rank % torch.cuda.device_count())
    g = torch.Generator().manual_seed(seed + rank)
    buf = _buffer(portep, T, H, E, rpn, transport, allow_nvlink, 30)
    E_l, failures, checks = E // world, [], 0
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
            if f"token 7, top-k column 3, value {E}" not in str(e):
                failures.append(f"rank {rank}: {what} raised without naming the entry: {e}")
            if e.results is None:
                failures.append(f"rank {rank}: {what} raised without its results")
            return e.results

    def expect_one_notice(what):
        nonlocal checks
        checks += 1
        want = 1 if rank == 0 else 0
        if len(raised) != want:
            failures.append(f"rank {rank}: {what}: {len(raised)} notices raised ({raised}), expected {want}")
        raised.clear()

    layout = call(lambda: buf.get_dispatch_layout(bad.cuda(), E), "get_dispatch_layout")
    call(lambda: buf.low_latency_dispatch(x.cuda(), clean.cuda(), T, E, use_fp8=False), "the dispatch after it")
    torch.cuda.synchronize()
    expect_one_notice("get_dispatch_layout with the entry, then a clean dispatch")
    want = ref.layout_ref(clean, E, world, world)[2]
    checks += 1
    if not torch.equal(layout[2].cpu(), want):
        failures.append(f"rank {rank}: num_tokens_per_expert counts the out-of-range entry")
    recv_x, count, handle, _, _ = call(lambda: buf.low_latency_dispatch(x.cuda(), bad.cuda(), T, E, use_fp8=False),
                                       "the dispatch with the entry")
    torch.cuda.synchronize()
    failures += _count_failures(rank, count.cpu().tolist(), all_clean, E_l)
    checks += E_l
    out = call(lambda: buf.low_latency_combine(recv_x, bad.cuda(), w.cuda(), handle), "the combine after it")
    torch.cuda.synchronize()
    expect_one_notice("a dispatch with the entry, then its combine")
    d = ref.calc_diff(out[0].float().cpu(), ref.ll_combine_ref(x, clean, w))
    checks += 1
    if not d < 1e-5:
        failures.append(f"rank {rank}: the combine of the dispatch with the entry: calc_diff {d:.3g}")
    for hook in (False, True):  # usable afterwards, on both ranks
        recv_x, count, handle, _, h = buf.low_latency_dispatch(x.cuda(), clean.cuda(), T, E, use_fp8=False,
                                                               return_recv_hook=hook)
        if hook:
            h()
        combined, _, h = buf.low_latency_combine(recv_x, clean.cuda(), w.cuda(), handle, return_recv_hook=hook)
        if hook:
            h()
        torch.cuda.synchronize()
        failures += _count_failures(rank, count.cpu().tolist(), all_clean, E_l)
        d = ref.calc_diff(combined.float().cpu(), ref.ll_combine_ref(x, clean, w))
        checks += E_l + 1
        if not d < 1e-5:
            failures.append(f"rank {rank} hook={hook} after the notice: combine calc_diff {d:.3g}")
    buf.destroy()
    return {"failures": failures, "checks": checks}


def profile_body(rank, world, rpn, transport, allow_nvlink, seed, T, H, E, K, iterations):
    """DeepEP's profiling conventions, which tools written for DeepEP rely on (its bench_kineto): over LL
    dispatch + combine calls, without and with a receive hook, a torch profile holds exactly one kernel name that
    contains "dispatch" and one that contains "combine", launched once per call, or twice (send and receive phase)
    with the hook."""
    import portep

    torch.cuda.set_device(rank % torch.cuda.device_count())
    g = torch.Generator().manual_seed(seed + rank)
    buf = _buffer(portep, T, H, E, rpn, transport, allow_nvlink, 30)
    idx = torch.topk(torch.rand(T, E, generator=g), K, dim=1).indices.cuda()
    x = torch.randn(T, H, generator=g).to(BF16).cuda()
    w = torch.rand(T, K, generator=g).cuda()
    failures = []
    for hook_mode in (False, True):
        def step():
            recv_x, _, handle, _, hook = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True,
                                                                  return_recv_hook=hook_mode)
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
            if len(names) != 1:
                failures.append(f"rank {rank} hook={hook_mode}: {len(names)} kernel names contain {word!r}: {names}")
            elif launches[names[0]] != per_call * iterations:
                failures.append(f"rank {rank} hook={hook_mode}: {names[0]} launched {launches[names[0]]} times in "
                                f"{iterations} calls, expected {per_call * iterations}")
    torch.cuda.synchronize()
    buf.destroy()
    return {"failures": failures, "checks": 4}
