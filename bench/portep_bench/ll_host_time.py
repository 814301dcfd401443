"""Host time of the low-latency calls on one GPU with one rank, at DeepEP's shape (128 tokens, hidden 7168, top-8,
288 experts, FP8 dispatch): the CPU time from entering low_latency_dispatch to returning from low_latency_combine,
for `calls` round trips issued back to back. The GPU is held by a sleep kernel queued before each batch of round
trips, so every sample is the host's own time and never a wait for a full launch queue (a round trip's kernels take
longer on the GPU than its host time); a batch whose sleep ended before its last launch is reported. The rows are
measured a batch each in turn, so that they share the machine's state. Next to it from the same run: the same round
trip launching kernels instead of cached CUDA graphs (graph_launch off), the round trip with receive hooks
(return_recv_hook=True) and with async_finish=True, which the fast path takes too, the plain and the hooked round
trip through the full Python path (PORTEP_LL_FAST_PATH=0's route), each call alone, and the baseline, one
torch.empty plus one empty kernel launch (torch.cuda._sleep(0)), and for scale two empty launches. The outputs of
the fast path are checked bit for bit against the full path's first."""

import contextlib
import cProfile
import io
import pstats
import time

from .spawn import one_rank_group

T, H, K, E = 128, 7168, 8, 288
BATCH = 100  # round trips behind one sleep: 200 launches, well inside the launch queue
HOLD_CYCLES = 10_000_000  # 5-7 ms at the clocks of an H100/H200: longer than a batch's host time


def _inputs(torch):
    g = torch.Generator().manual_seed(2026)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()
    idx = torch.topk(torch.rand(T, E, generator=g), K, dim=1).indices.cuda()
    weights = torch.rand(T, K, generator=g).cuda()
    return x, idx, weights


def _round_trip(buf, x, idx, weights, y):
    """One dispatch and one combine, as an MoE layer calls them (y: its expert outputs, made once: the benchmark
    times the communication calls, not expert compute)."""
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)
    return buf.low_latency_combine(y, idx, weights, handle)[0], recv_x, handle


def _hooked_round_trip(buf, x, idx, weights, y):
    """_round_trip with receive hooks (return_recv_hook=True), each called right away: DeepEP's overlap mode."""
    _, _, handle, _, hook = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True, return_recv_hook=True)
    hook()
    _, _, hook = buf.low_latency_combine(y, idx, weights, handle, return_recv_hook=True)
    hook()


def _async_round_trip(buf, x, idx, weights, y):
    """_round_trip with async_finish=True, as DeepEP's LL test and SGLang call without hooks (events not waited)."""
    _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True, async_finish=True)
    buf.low_latency_combine(y, idx, weights, handle, async_finish=True)


def _held_batch(fn, n, sleep_cycles, torch):
    """Host microseconds of each of n fn() calls issued behind a GPU sleep; and whether the sleep ended before the
    last of them (later calls could then have waited for the GPU)."""
    samples = []
    torch.cuda.synchronize()
    torch.cuda._sleep(sleep_cycles)
    end_of_hold = torch.cuda.Event()
    end_of_hold.record()
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    short = end_of_hold.query()
    torch.cuda.synchronize()
    return samples, short


def _interleaved(rows, calls, torch, progress):
    """Each row's `calls` samples, taken in rounds of one batch per row, so that a machine whose speed drifts
    during the run (these VMs' does, by tens of percent) moves every row alike and the ratios hold. A row is
    (what, fn, sleep cycles) or (what, fn, sleep cycles, a context manager's factory that wraps its batches)."""
    out = [{"what": row[0], "samples_us": [], "short": 0} for row in rows]
    rounds = -(-calls // BATCH)
    for r in range(rounds):
        progress(f"ll-host: round {r + 1} of {rounds} (one batch of {BATCH} calls per row)")
        n = min(BATCH, calls - r * BATCH)
        for (_, fn, cycles, *around), row in zip(rows, out):
            with around[0]() if around else contextlib.nullcontext():
                samples, short = _held_batch(fn, n, cycles, torch)
            row["samples_us"] += samples
            row["short"] += short
    for row in out:
        short = row.pop("short")
        if short:
            row["what"] += f"; in {short} of {rounds} batches the GPU's hold ended early"
    return out


def _check_fast_equals_full(buf, x, idx, weights, y, torch):
    """One round trip with the fast path, one without: the same combined rows and counts (the kernels are
    deterministic; tests/gpu/test_gpu_ll_fast_path.py compares every output)."""
    results = []
    for enabled in (True, False):
        buf._ll_fast.enabled = enabled
        combined, _, handle = _round_trip(buf, x, idx, weights, y)
        torch.cuda.synchronize()
        results.append((combined.clone(), handle[1].clone()))
    buf._ll_fast.enabled = True
    for a, b in zip(*results):
        if not torch.equal(a, b):
            raise AssertionError("the LL fast path's outputs differ from the full path's")


def _graph_note(graphs_on, counts):
    """What the Buffer's graph cache did over the run (gpu_kernels/cuda/graph_cache.h): in a steady loop the calls
    hit the graphs built first, so builds stay at a few and re-parameterisations at none."""
    if not graphs_on:
        return "graph launches off (PORTEP_LL_GRAPH_LAUNCH=0, or a build without them)"
    note = (
        f"{counts['launches']} graph launches of {counts['builds']} cached graphs "
        f"({counts['updates']} re-parameterised)"
    )
    return note + (f"; graph launches turned off by error {counts['error']}" if counts["error"] else "")


def measure(calls=1000, progress=print, profile_calls=0):
    """The rows' samples and the note; profile_calls > 0: also cProfile's report of that many full-path round
    trips ("profile")."""
    import torch

    import portep

    if not torch.cuda.is_available() or not portep.native.build_info()["gpu_built"]:
        raise RuntimeError(
            "ll-host needs a GPU and portep's GPU kernels (GPU visible: "
            f"{torch.cuda.is_available()}, kernels built: {portep.native.build_info()['gpu_built']})"
        )
    torch.cuda.set_device(0)
    group = one_rank_group()
    nbytes = portep.Buffer.get_low_latency_rdma_size_hint(T, H, 1, E)
    buf = portep.Buffer(group, 0, nbytes, low_latency_mode=True, explicitly_destroy=True, backend="cuda")
    try:
        x, idx, weights = _inputs(torch)
        if buf._ll_fast is None:
            raise RuntimeError(f"the LL fast path is off here ({buf.ll_fast_path_off})")
        y = torch.randn(E, T, H, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16).cuda()
        for _ in range(20):  # the first call of a signature goes the full way and marks it checked
            _round_trip(buf, x, idx, weights, y)
        _check_fast_equals_full(buf, x, idx, weights, y, torch)
        fast = buf._ll_fast
        _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)

        def round_trip():
            _round_trip(buf, x, idx, weights, y)

        def full_path(fn):
            def run():
                fast.enabled = False
                try:
                    fn(buf, x, idx, weights, y)
                finally:
                    fast.enabled = True

            return run

        full_round_trip = full_path(_round_trip)

        kernels = buf.runtime.kernels
        graphs_on = kernels.graph_launch

        @contextlib.contextmanager
        def kernel_launches():
            kernels.graph_launch = False
            try:
                yield
            finally:
                kernels.graph_launch = graphs_on

        rows = _interleaved(
            [
                ("portep LL round trip (dispatch + combine), one native call per phase", round_trip, HOLD_CYCLES),
                (
                    "portep LL round trip launching kernels instead of cached graphs",
                    round_trip,
                    HOLD_CYCLES,
                    kernel_launches,
                ),
                ("portep LL dispatch alone", lambda: buf.low_latency_dispatch(x, idx, T, E, use_fp8=True), HOLD_CYCLES),
                ("portep LL combine alone", lambda: buf.low_latency_combine(y, idx, weights, handle), HOLD_CYCLES),
                (
                    "portep LL round trip with receive hooks (return_recv_hook=True)",
                    lambda: _hooked_round_trip(buf, x, idx, weights, y),
                    HOLD_CYCLES,
                ),
                (
                    "portep LL round trip with async_finish=True",
                    lambda: _async_round_trip(buf, x, idx, weights, y),
                    HOLD_CYCLES,
                ),
                (
                    "portep LL round trip through the full Python path (each call validated in Python)",
                    full_round_trip,
                    8 * HOLD_CYCLES,
                ),
                (
                    "portep LL round trip with receive hooks through the full Python path",
                    full_path(_hooked_round_trip),
                    8 * HOLD_CYCLES,
                ),
                (
                    "baseline: torch.empty + one empty kernel launch (torch.cuda._sleep(0))",
                    lambda: (torch.empty(E, dtype=torch.int32, device="cuda"), torch.cuda._sleep(0)),
                    HOLD_CYCLES,
                ),
                (
                    "for scale: two empty kernel launches"
                    " (torch.cuda._sleep(0) twice; a round trip launches two kernels)",
                    lambda: (torch.cuda._sleep(0), torch.cuda._sleep(0)),
                    HOLD_CYCLES,
                ),
            ],
            calls,
            torch,
            progress,
        )
        graphs = _graph_note(graphs_on, kernels.graph_counts)
        profile = _profile(full_round_trip, profile_calls, torch) if profile_calls else ""
    finally:
        torch.cuda.synchronize()
        buf.destroy()
    note = (
        f"host time per call on {torch.cuda.get_device_name()}, 1 rank, {T} tokens, hidden {H}, top-{K}, "
        f"{E} experts, FP8 dispatch; calls in batches of {BATCH} behind a GPU sleep (host time only), one batch "
        f"per row in turn; {graphs}"
    )
    return {"rows": rows, "note": note, "profile": profile}


def _profile(fn, calls, torch, top=30):
    """cProfile's report of `calls` fn() calls, the functions with the most cumulative time first: the host's own
    time, as in the timed rows (_held_batch: batches of BATCH calls, each issued behind its own GPU sleep; the
    profiler on only during each call); batches whose sleep ended before their last call are counted in the title."""
    profiler = cProfile.Profile()

    def profiled():
        profiler.enable()
        try:
            fn()
        finally:
            profiler.disable()

    short = sum(_held_batch(profiled, min(BATCH, calls - s), 8 * HOLD_CYCLES, torch)[1] for s in range(0, calls, BATCH))
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(top)
    batches = -(-calls // BATCH)
    held = f"; in {short} of {batches} batches the GPU's hold ended early" if short else ""
    return f"cProfile of {calls} round trips through the full Python path{held}:\n" + text.getvalue()
