"""Rank body of the LL fast path's GPU test (tests/gpu/test_gpu_ll_fast_path.py): the fast path's outputs against
the full Python path's on the same inputs, bit for bit, for every dispatch flag combination, zero-copy and out=
combines, and both paths' combined rows against the float64 weighted sum of the test experts' outputs
(deepep_reference.ll_combine_expert_ref); calls on a side stream ordered behind that stream's work; torch's
deterministic mode handed to the full path; outputs that share one allocation outliving each other; calls it must
hand to the full path, which refuses them on every rank, after which it takes calls again; a dropped expert index
reported through it as a DroppedInput carrying the results; hooked (return_recv_hook=True) and async_finish calls
through it as through the full path, a hook called twice or after destroy() raising."""

import torch
import torch.distributed as dist

import deepep_reference as ref
import portep
from gpu_ll_workers import describe_mismatch, experts_view

BF16 = torch.bfloat16
FLAGS = [(False, False, False), (True, False, False), (True, True, False), (True, True, True)]
COMBINES = [(False, False), (True, False), (False, True)]  # (zero_copy, out=)


class Calls:
    def __init__(self, buf, T, E, x, idx, weights, y):
        self.buf, self.T, self.E, self.x, self.idx, self.weights, self.y = buf, T, E, x, idx, weights, y

    def round_trip(self, flags, zero_copy=False, with_out=False, idx=None):
        """Every output of one dispatch + combine, copied (FP8 as bytes)."""
        use_fp8, round_scale, use_ue8m0 = flags
        idx = self.idx if idx is None else idx
        recv_x, count, handle, _, _ = self.buf.low_latency_dispatch(
            self.x, idx, self.T, self.E, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0
        )
        if zero_copy:
            self.buf.get_next_low_latency_combine_buffer(handle)[:] = self.y
        out = torch.empty(self.x.shape, dtype=BF16, device="cuda") if with_out else None
        combined = self.buf.low_latency_combine(self.y, idx, self.weights, handle, zero_copy=zero_copy, out=out)[0]
        if with_out and combined is not out:
            raise AssertionError("combine with out= returned another tensor")
        torch.cuda.current_stream().synchronize()
        return _valid_parts(recv_x if use_fp8 else (recv_x, None), count, handle, combined)

    def dispatch(self, flags, **mode):
        """low_latency_dispatch of the inputs with these (use_fp8, round_scale, use_ue8m0) and mode's keywords."""
        use_fp8, round_scale, use_ue8m0 = flags
        return self.buf.low_latency_dispatch(
            self.x, self.idx, self.T, self.E, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0, **mode
        )

    def hooked_round_trip(self, flags, zero_copy=False):
        """round_trip with return_recv_hook=True on both calls, each hook called before the next call, as DeepEP's
        overlap mode calls them; the hooks are also returned."""
        recv_x, count, handle, event, hook = self.dispatch(flags, return_recv_hook=True)
        if event.event is not None or not callable(hook):
            raise AssertionError(f"a hooked dispatch returned event {event.event!r} and hook {hook!r}")
        hook()
        if zero_copy:
            self.buf.get_next_low_latency_combine_buffer(handle)[:] = self.y
        combined, event, combine_hook = self.buf.low_latency_combine(
            self.y, self.idx, self.weights, handle, zero_copy=zero_copy, return_recv_hook=True
        )
        combine_hook()
        torch.cuda.current_stream().synchronize()
        return _valid_parts(recv_x if flags[0] else (recv_x, None), count, handle, combined), (hook, combine_hook)

    def async_round_trip(self, flags):
        """round_trip with async_finish=True, each event waited on as DeepEP's test does; the events' extra tensors
        are checked to be the call's own (DeepEP's keep-alive list)."""
        recv_x, count, handle, event, hook = self.dispatch(flags, async_finish=True)
        data, scales = recv_x if flags[0] else (recv_x, None)
        _check_extra(event, (self.x, self.idx, data, scales, count, handle[0], handle[1], None), hook)
        event.current_stream_wait()
        combined, event, hook = self.buf.low_latency_combine(self.y, self.idx, self.weights, handle, async_finish=True)
        _check_extra(event, (self.y, self.idx, self.weights, handle[0], handle[1], combined), hook)
        event.current_stream_wait()
        torch.cuda.current_stream().synchronize()
        return _valid_parts((data, scales), count, handle, combined)

    def event_waits_for_its_call(self, path):
        """An async_finish dispatch queued behind a GPU sleep: its event (portep._ll_torch.Event on the fast path,
        CudaEvent on the full path) is not complete before the GPU got to the call, and is after synchronize();
        what went wrong, else None."""
        torch.cuda._sleep(200_000_000)  # about a tenth of a second of GPU time ahead of the call
        event = self.dispatch(FLAGS[0], async_finish=True)[3].event
        kind = type(event).__module__ + "." + type(event).__name__
        want = "portep._ll_torch.Event" if path == "fast" else "portep.backends.cuda.engine.CudaEvent"
        if kind != want:
            return f"{path} path: an async_finish call's event is a {kind}, not a {want}"
        if event.query():
            return f"{path} path: the event was complete before the GPU reached the call"
        event.synchronize()
        if not event.query():
            return f"{path} path: the event was not complete after synchronize()"
        return None

    def use_expert_outputs(self, flags, rank):
        """y := the test experts' outputs (ref.ll_expert_outputs: distinct per expert and source rank) of the rows
        that a full-path round trip with these flags receives; idx is fixed, so every later dispatch with these
        flags receives the same rows in the same places."""
        use_fp8, round_scale, use_ue8m0 = flags
        enabled, self.buf._ll_fast.enabled = self.buf._ll_fast.enabled, False
        try:
            recv_x, _, handle, _, _ = self.buf.low_latency_dispatch(
                self.x, self.idx, self.T, self.E, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0
            )
            self.buf.low_latency_combine(self.y, self.idx, self.weights, handle)
        finally:
            self.buf._ll_fast.enabled = enabled
        torch.cuda.current_stream().synchronize()
        rows = ref.per_token_cast_back(recv_x[0].cpu(), recv_x[1].cpu()).to(BF16) if use_fp8 else recv_x.cpu()
        self.y = ref.ll_expert_outputs(rows, handle[1].cpu(), rank).cuda()

    def dispatch_then_combine(self, idx):
        """An FP8 round trip that goes on with a DroppedInput's results, as a caller must; the DroppedInputs."""
        dropped = []
        try:
            dispatched = self.buf.low_latency_dispatch(self.x, idx, self.T, self.E, use_fp8=True)
        except portep.DroppedInput as e:
            dropped.append(e)
            dispatched = e.results
        try:
            self.buf.low_latency_combine(self.y, idx, self.weights, dispatched[2])
        except portep.DroppedInput as e:
            dropped.append(e)
        return dropped

    def on_both_paths(self, **kwargs):
        self.buf._ll_fast.enabled = False
        full = self.round_trip(**kwargs)
        self.buf._ll_fast.enabled = True
        self.round_trip(**kwargs)  # a new signature: the full path checks it and marks it for the fast path
        return full, self.round_trip(**kwargs)


def _check_extra(event, expected, hook):
    """An async_finish call's EventOverlap: an event, and as extra tensors the call's own (the same objects, None where
    the call had none); no hook."""
    extra = event.extra_tensors
    if event.event is None or hook is not None or extra is None or len(extra) != len(expected):
        raise AssertionError(f"async_finish: event {event.event!r}, hook {hook!r}, extra tensors {extra!r}")
    for i, (got, want) in enumerate(zip(extra, expected)):
        if got is not want and not (
            isinstance(got, torch.Tensor)
            and isinstance(want, torch.Tensor)
            and got.data_ptr() == want.data_ptr()
            and got.shape == want.shape
        ):
            raise AssertionError(f"async_finish: extra tensor {i} is not the call's own")


def _valid_parts(recv, count, handle, combined):
    """What a dispatch + combine defines: per local expert its first count[e] slots of recv_x, scales and
    src_info (the rest of those tensors is never written), layout_range, the counts and the combined rows."""
    data, scales = recv
    parts = [count.clone(), handle[1].clone(), combined.clone()]
    for e, n in enumerate(count.tolist()):
        parts.append((data[e, :n].view(torch.uint8) if data.dtype == torch.float8_e4m3fn else data[e, :n]).clone())
        parts.append(handle[0][e, :n].clone())
        if scales is not None:
            parts.append(scales[e, :n].clone())
    return parts


def _not_the_experts_sum(combined, ref64, abs64, num_topk):
    """An error if combined (BF16, GPU) is not ref64 (ref.ll_combine_expert_ref: the float64 weighted sum of the
    test experts' outputs) within BF16 rounding and FP32 accumulation, else None."""
    got = combined.cpu()
    bad = ref.combine_mismatch(got, ref64, abs64, num_terms=num_topk)
    if not bad.any():
        return None
    return f"{describe_mismatch(bad, got, ref64)} combined elements are not the weighted sum of the experts' outputs"


def _setup(rank, world, rpn, transport, seed, T, H, E, K):
    torch.cuda.set_device(rank % torch.cuda.device_count())
    nbytes = portep.Buffer.get_low_latency_rdma_size_hint(T, H, world, E)
    buf = portep.Buffer(
        dist.group.WORLD,
        0,
        nbytes,
        low_latency_mode=True,
        num_ranks_per_node=rpn,
        transport=transport,
        timeout_s=60,
        explicitly_destroy=True,
        backend="cuda",
    )
    if buf._ll_fast is None:
        raise AssertionError(f"the fast path is off: {buf.ll_fast_path_off}")
    if buf.low_latency_dispatch != buf._ll_fast.dispatch or buf.low_latency_combine != buf._ll_fast.combine:
        raise AssertionError("the Buffer's LL methods are not the fast path's native entries")
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(T - 3, H, generator=g).to(BF16)  # fewer tokens than T, as DeepEP's tests send
    idx = torch.topk(torch.rand(T - 3, E, generator=g), K, dim=1).indices
    idx[torch.rand(T - 3, K, generator=g) < 0.1] = -1  # dropped selections, as masked routing makes
    weights = torch.rand(T - 3, K, generator=g)
    y = torch.randn(E // world, world * T, H, generator=g).to(BF16)
    return Calls(buf, T, E, x.cuda(), idx.cuda(), weights.cuda(), y.cuda())


def _hooks_and_events(calls, counter, rank, x_cpu, idx_cpu, weights_cpu, K):
    """Hooked (return_recv_hook=True) and async_finish round trips through the fast path, bit for bit the full path's,
    for every dispatch flag combination (and a zero-copy hooked combine), their combined rows the experts' weighted
    sum; each taken natively; a hook called twice raises without launching, and the Buffer goes on in step."""
    errors = []
    for flags in FLAGS:
        calls.use_expert_outputs(flags, rank)
        ref64, abs64 = ref.ll_combine_expert_ref(experts_view(x_cpu, flags[0], flags[1]), idx_cpu, weights_cpu, rank)
        for mode in ("hook", "hook zero-copy", "async_finish"):
            run = {
                "hook": lambda: calls.hooked_round_trip(flags)[0],
                "hook zero-copy": lambda: calls.hooked_round_trip(flags, zero_copy=True)[0],
                "async_finish": lambda: calls.async_round_trip(flags),
            }[mode]
            calls.buf._ll_fast.enabled = False
            full = run()
            calls.buf._ll_fast.enabled = True
            taken = counter.taken
            fast = run()
            case = f"{mode}, flags {flags}"
            if counter.taken != taken + 2:
                errors.append(f"{case}: the fast path took {counter.taken - taken} of the 2 calls")
            if any(not torch.equal(a, b) for a, b in zip(full, fast)):
                errors.append(f"{case}: the fast path's outputs differ from the full path's")
            for path, parts in (("full", full), ("fast", fast)):
                error = _not_the_experts_sum(parts[2], ref64, abs64, K)
                if error:
                    errors.append(f"{case}, {path} path: {error}")
    overlapped = {}
    for path in ("full", "fast"):
        calls.buf._ll_fast.enabled = path == "fast"
        error = calls.event_waits_for_its_call(path)
        if error:
            errors.append(error)
        taken = counter.taken
        overlapped[path] = _two_batches_overlapped(calls)
        if path == "fast" and counter.taken != taken + 4:
            errors.append(f"two batches overlapped: the fast path took {counter.taken - taken} of the 4 calls")
    if any(not torch.equal(a, b) for a, b in zip(overlapped["full"], overlapped["fast"])):
        errors.append("two batches overlapped: the fast path's outputs differ from the full path's")
    for path in ("full", "fast"):
        calls.buf._ll_fast.enabled = path == "fast"
        reference, hooks = calls.hooked_round_trip(FLAGS[1])
        for hook in hooks:
            error = _refused_at_runtime(hook, "already called")
            if error:
                errors.append(f"{path} path, a hook called twice: {error}")
        if any(not torch.equal(a, b) for a, b in zip(reference, calls.hooked_round_trip(FLAGS[1])[0])):
            errors.append(f"{path} path: the round trip after a hook called twice differs")
    calls.buf._ll_fast.enabled = True
    return errors


def _two_batches_overlapped(calls):
    """Two calls in flight, each hook called after the other call sent: dispatch A, dispatch B (each only sending),
    A's hook, B's hook, then their combines the same way; batch B routes the tokens in reverse order. A's and B's
    outputs (BF16 dispatch), copied. Each hook must launch its own call's receive phase (its half and number), not
    the latest call's.

    Every rank finishes its calls before the pair begins (synchronize, then a barrier): with two halves, call k+2
    reuses call k's receive area, and a rank sends k+2 once it received k+1, which its peers sent before their hook
    of call k ran; without the barrier a slow peer may still be reading call k when call k+2's rows land (DeepEP's
    double buffering has the same bound; on 2026-12-07 the proxy case without it failed on an H100, the out-of-step
    check naming the rows' bytes as a call number)."""
    x, idx, weights, T, E = calls.x, calls.idx, calls.weights, calls.T, calls.E
    batches = [(x, idx, weights), (x.flip(0).contiguous(), idx.flip(0).contiguous(), weights.flip(0).contiguous())]
    _every_rank_done()
    sent = [calls.buf.low_latency_dispatch(b[0], b[1], T, E, use_fp8=False, return_recv_hook=True) for b in batches]
    for res in sent:
        res[4]()
    _every_rank_done()
    combined = [
        calls.buf.low_latency_combine(calls.y, b[1], b[2], res[2], return_recv_hook=True)
        for b, res in zip(batches, sent)
    ]
    for res in combined:
        res[2]()
    _every_rank_done()
    parts = []
    for res, out in zip(sent, combined):
        parts += _valid_parts((res[0], None), res[1], res[2], out[0])
    return parts


def _every_rank_done():
    """This rank's GPU work finished, then every rank's (a barrier)."""
    torch.cuda.current_stream().synchronize()
    dist.barrier()


def _refused_at_runtime(call, expect):
    try:
        call()
    except RuntimeError as e:
        return None if expect in str(e) else f"raised, but the message lacks {expect!r}: {e}"
    return f"returned ({expect} expected)"


def _side_stream_round_trip(calls, counter, x2):
    """A fast round trip on a side stream whose queued work (a GPU sleep, then writing x2 into the input) must come
    first: the call allocates and launches on torch's current stream, so it reads x2, not the input's old rows.
    Returns (errors, its outputs)."""
    x_in = (x2.float() * 0.5).to(BF16)  # other rows, overwritten with x2 on the side stream
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    taken, x_before = counter.taken, calls.x
    calls.x = x_in
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)  # about 10 ms: a launch on another stream would read x_in before the copy
        x_in.copy_(x2)
        parts = calls.round_trip(FLAGS[1])
    calls.x = x_before
    torch.cuda.synchronize()
    return ([] if counter.taken == taken + 2 else ["the side stream's round trip did not go the fast way"]), parts


def _deterministic_mode_round_trip(calls, counter):
    """With torch's deterministic mode filling new memory, the fast path declines (the full path's torch.empty
    fills the outputs); the outputs stay the same. Returns (errors, its outputs)."""
    declined = counter.declined
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        parts = calls.round_trip(FLAGS[1])
    finally:
        torch.use_deterministic_algorithms(False)
    return ([] if counter.declined == declined + 2 else ["the fast path took calls in deterministic mode"]), parts


def _outputs_outlive_each_other(calls):
    """The dispatch outputs share one allocation: each stays valid while any lives. recv_x kept alone, then the
    handle kept alone, across a later round trip whose fresh outputs would reuse freed memory."""

    def dispatch():
        out = calls.buf.low_latency_dispatch(calls.x, calls.idx, calls.T, calls.E, use_fp8=False)
        calls.buf.low_latency_combine(calls.y, calls.idx, calls.weights, out[2])
        torch.cuda.synchronize()
        return out

    errors = []
    recv_x, count = dispatch()[:2]
    n = int(count[0])
    del count
    kept = recv_x[0, :n].clone()
    calls.round_trip(FLAGS[0])
    if not torch.equal(recv_x[0, :n], kept):
        errors.append("recv_x changed once the other outputs were dropped")
    del recv_x
    _, count, handle, _, _ = dispatch()
    n = int(count[0])
    del count
    kept = handle[0][0, :n].clone(), handle[1].clone()
    calls.round_trip(FLAGS[0])
    if not torch.equal(handle[0][0, :n], kept[0]) or not torch.equal(handle[1], kept[1]):
        errors.append("the handle's tensors changed once recv_x was dropped")
    return errors


def _refused(call, expect):
    try:
        call()
    except (TypeError, ValueError) as e:
        return None if expect in str(e) else f"refused, but the message lacks {expect!r}: {e}"
    return f"accepted a call that must be refused ({expect})"


def fast_path_body(rank, world, rpn, transport, seed, T, H, E, K):
    calls = _setup(rank, world, rpn, transport, seed, T, H, E, K)
    counter = calls.buf._ll_fast  # its counters: calls launched natively (taken), handed to the Python methods
    errors = []
    x_cpu, idx_cpu, weights_cpu = calls.x.cpu(), calls.idx.cpu(), calls.weights.cpu()
    for flags in FLAGS:
        calls.use_expert_outputs(flags, rank)
        x_seen = experts_view(x_cpu, flags[0], flags[1])
        ref64, abs64 = ref.ll_combine_expert_ref(x_seen, idx_cpu, weights_cpu, rank)
        for zero_copy, with_out in COMBINES:
            case = f"flags {flags}, zero_copy {zero_copy}, out {with_out}"
            full, fast = calls.on_both_paths(flags=flags, zero_copy=zero_copy, with_out=with_out)
            for i, (a, b) in enumerate(zip(full, fast)):
                if not torch.equal(a, b):
                    errors.append(f"{case}: output {i} differs")
            for path, parts in (("full", full), ("fast", fast)):
                error = _not_the_experts_sum(parts[2], ref64, abs64, K)  # parts[2]: the combined rows
                if error:
                    errors.append(f"{case}, {path} path: {error}")
    errors += _hooks_and_events(calls, counter, rank, x_cpu, idx_cpu, weights_cpu, K)
    runs = len(FLAGS) * len(COMBINES)
    if counter.taken < 2 * runs:  # at least each case's last round trip (dispatch and combine) went the fast way
        errors.append(f"the fast path launched {counter.taken} calls, expected at least {2 * runs}")

    errors += _outputs_outlive_each_other(calls)
    x2 = (calls.x.float() * -2).to(BF16)  # exact in BF16; other FP8 scales
    x_before, calls.x = calls.x, x2
    calls.buf._ll_fast.enabled = False
    full = calls.round_trip(FLAGS[1])
    calls.buf._ll_fast.enabled = True
    for what, check in (
        ("on a side stream", lambda: _side_stream_round_trip(calls, counter, x2)),
        ("in deterministic mode", lambda: _deterministic_mode_round_trip(calls, counter)),
    ):
        more, parts = check()
        errors += more
        if any(not torch.equal(a, b) for a, b in zip(full, parts)):
            errors.append(f"a round trip {what}: outputs differ from the full path's")
    calls.x = x_before

    taken = counter.taken
    x, idx = calls.x, calls.idx
    bad = {
        "x has dtype": lambda: calls.buf.low_latency_dispatch(x.float(), idx, T, E),
        "topk_idx has dtype": lambda: calls.buf.low_latency_dispatch(x, idx.int(), T, E),
        "num_max_dispatch_tokens_per_rank": lambda: calls.buf.low_latency_dispatch(x, idx, float(T), E),
    }
    errors += [e for e in (_refused(call, expect) for expect, call in bad.items()) if e]
    if counter.taken != taken:
        errors.append(f"the fast path launched {counter.taken - taken} of the {len(bad)} bad calls")
    again = calls.round_trip(FLAGS[1])  # refused everywhere, then settled: the Buffer is in step
    if any(not torch.equal(a, b) for a, b in zip(again, calls.round_trip(FLAGS[1]))):
        errors.append("round trips after the refusals differ")

    bad_idx = idx.clone()
    if rank == 0:
        bad_idx[0, 0] = E + 5
    dropped = calls.dispatch_then_combine(bad_idx)
    torch.cuda.current_stream().synchronize()
    dropped += calls.dispatch_then_combine(idx)  # a notice comes with the call that finds it: this one at the latest
    expected = 1 if rank == 0 else 0
    if len(dropped) != expected or any(str(E + 5) not in str(e) or e.results is None for e in dropped):
        errors.append(f"rank {rank}: expected {expected} DroppedInput naming expert {E + 5}, got {dropped}")
    pending = None
    if world == 1:  # a hook outliving its Buffer: with peers, their receive phases would wait for this rank's
        pending = calls.buf.low_latency_dispatch(x, idx, T, E, return_recv_hook=True)[4]
        torch.cuda.synchronize()
    calls.buf.destroy()
    if pending is not None:
        error = _refused_at_runtime(pending, "destroyed")
        if error:
            errors.append(f"a hook called after destroy(): {error}")
    if "low_latency_dispatch" in vars(calls.buf) or "low_latency_combine" in vars(calls.buf):
        errors.append("destroy() left the fast path's entries on the Buffer")
    try:
        calls.buf.low_latency_dispatch(x, idx, T, E)
        errors.append("a destroyed Buffer took a dispatch")
    except RuntimeError:
        pass
    return errors


def _with_graphs(calls, on, **kwargs):
    kernels = calls.buf.runtime.kernels
    before, kernels.graph_launch = kernels.graph_launch, on
    try:
        return calls.round_trip(**kwargs)
    finally:
        kernels.graph_launch = before


def _differs(a, b):
    return any(not torch.equal(p, q) for p, q in zip(a, b))


def _captured_round_trips(calls, reference):
    """A round trip captured in a CUDA graph (launched as kernels: captured launches leave the sequence-number chain
    alone) and replayed twice, then eager round trips, which launch as graphs again once an eager kernel launch has
    rewritten the chain. Errors."""
    errors = []
    for _ in range(2):  # warm-up on the capture's stream: both halves, every allocation seen once
        calls.round_trip(flags=FLAGS[1])
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dispatched = calls.buf.low_latency_dispatch(calls.x, calls.idx, calls.T, calls.E, use_fp8=True)
        combined = calls.buf.low_latency_combine(calls.y, calls.idx, calls.weights, dispatched[2])[0]
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        if not torch.equal(combined, reference[2]):
            errors.append("a replayed round trip's combined rows differ")
    counts = calls.buf.runtime.kernels.graph_counts
    for i in range(3):
        if _differs(calls.round_trip(flags=FLAGS[1]), reference):
            errors.append(f"eager round trip {i} after the replays differs")
    if calls.buf.runtime.kernels.graph_counts["launches"] <= counts["launches"]:
        errors.append("eager calls after a capture never launched as graphs again")
    return errors


def graph_launch_body(rank, world, rpn, transport, seed, T, H, E, K):
    """Graph launches (gpu_kernels/cuda/graph_cache.h) against kernel launches, bit for bit: each flag combination;
    graph and kernel launches mixed call by call, differently on each rank (the sequence-number chain and the host's
    numbers agree); more distinct inputs than the cache holds (its entries re-parameterised); a receive hook (kernel
    launches) between graph launches; a CUDA-graph capture and its replays between eager calls; after
    clean_low_latency_buffer."""
    calls = _setup(rank, world, rpn, transport, seed, T, H, E, K)
    kernels = calls.buf.runtime.kernels
    errors = [] if kernels.graph_launch else ["graph launches are off on a CUDA build"]
    references = {}
    x_cpu, idx_cpu, weights_cpu = calls.x.cpu(), calls.idx.cpu(), calls.weights.cpu()
    for flags in FLAGS:
        calls.use_expert_outputs(flags, rank)
        references[flags] = _with_graphs(calls, False, flags=flags)
        ref64, abs64 = ref.ll_combine_expert_ref(experts_view(x_cpu, flags[0], flags[1]), idx_cpu, weights_cpu, rank)
        error = _not_the_experts_sum(references[flags][2], ref64, abs64, K)  # [2]: the combined rows
        if error:
            errors.append(f"flags {flags}, kernel launches: {error}")
        for i in range(3):  # the first call of a signature goes the full path; every eager call may use graphs
            if _differs(references[flags], calls.round_trip(flags=flags)):
                errors.append(f"flags {flags}: graph-launched round trip {i} differs from kernel launches")
    if kernels.graph_counts["launches"] < 2 * len(FLAGS):
        errors.append(f"too few graph launches: {kernels.graph_counts}")

    baseline = references[FLAGS[1]]
    calls.use_expert_outputs(FLAGS[1], rank)  # the outputs the baseline combined
    for i in range(12):  # each rank its own pattern of graph and kernel launches
        if _differs(baseline, _with_graphs(calls, (i + rank) % 3 != 0, flags=FLAGS[1])):
            errors.append(f"mixed launches, round trip {i}: differs")

    x_before, g = calls.x, torch.Generator().manual_seed(seed + rank)
    inputs = [torch.randn(calls.x.shape, generator=g).to(BF16).cuda() for _ in range(20)]  # > kEntries (16)
    for j, x in enumerate(inputs):
        calls.x = x
        if _differs(_with_graphs(calls, False, flags=FLAGS[1]), calls.round_trip(flags=FLAGS[1])):
            errors.append(f"input {j} of the cache churn: graph launch differs")
    calls.x = x_before
    if kernels.graph_counts["updates"] == 0:
        errors.append(f"the cache churn re-parameterised no graph: {kernels.graph_counts}")

    recv_x, count, handle, _, hook = calls.buf.low_latency_dispatch(
        calls.x, calls.idx, T, E, use_fp8=False, return_recv_hook=True
    )
    hook()
    calls.buf.low_latency_combine(calls.y, calls.idx, calls.weights, handle)
    if _differs(baseline, calls.round_trip(flags=FLAGS[1])):
        errors.append("the round trip after a hooked call differs")

    errors += _captured_round_trips(calls, baseline)
    torch.cuda.synchronize()
    calls.buf.clean_low_latency_buffer(T, H, E)
    for i in range(3):
        if _differs(baseline, calls.round_trip(flags=FLAGS[1])):
            errors.append(f"round trip {i} after clean_low_latency_buffer differs")
    if kernels.graph_counts["error"]:
        errors.append(f"a graph launch failed: {kernels.graph_counts}")
    calls.buf.destroy()
    return errors
