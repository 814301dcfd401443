"""GPU benchmarks of this stage: the command channel, and the get_dispatch_layout kernel.

Command channel: commands per second from probe kernels through mapped FIFOs to host consumer threads (the proxies'
drain loop), and the round trip of one command (GPU publish -> host pop -> tail visible to the GPU). The probe is the
bottom layer, so nothing below it runs as a baseline: the untuned probe's figures on the H200 machine
(reference/gpu-machine.md) are quoted under the table. The layout kernel runs next to torch ops computing the same
layout."""

from .report import MissingHardware, Table
from .stats import median, percentile

NOTE = (
    "one GPU and this host's CPUs: probe kernels push commands into FIFOs in mapped host memory (across PCIe), "
    "host consumer threads pop and check them (no transport, no peer). Samples: one per repeat of a "
    "configuration."
)
QUOTED = (
    "quoted baseline, not this run: the untuned probe on the H200 machine (reference/gpu-machine.md) gave 21.0 "
    "M cmd/s with 1 FIFO and 1 thread, 42.8 with 8 and 1, 57.3 with 32 and 4, 83.9 with 128 and 16; round "
    "trip 3.3 us"
)


def run(
    report,
    configs=((1, 1, 64, 20000), (8, 1, 256, 5000), (32, 4, 1024, 2000), (128, 16, 4096, 500)),
    rtt_iterations=20000,
    repeats=5,
):
    import portep_testing
    from portep import native

    if not native.build_info()["gpu_built"] or native.cuda_devices()[0] == 0:
        raise MissingHardware(f"gpu-fifo needs a CUDA GPU and portep's CUDA kernels: {native.cuda_devices()[1]}")
    report.say(f"gpu-fifo: {NOTE}")
    t = Table(
        "gpu-fifo: command rate, probe kernels -> host consumer threads",
        "M cmd/s",
        NOTE,
        extra_columns=("commands per run", "all in order"),
    )
    for fifos, threads, warps, per_warp in configs:
        report.progress(f"gpu-fifo: {fifos} FIFOs, {threads} consumer threads, {warps} warps, {repeats} runs")
        portep_testing.cuda_fifo_probe(fifos, threads, warps, min(per_warp, 100))  # warm-up
        runs = [portep_testing.cuda_fifo_probe(fifos, threads, warps, per_warp) for _ in range(repeats)]
        bad = [r for r in runs if r["popped"] != warps * per_warp or r["out_of_order"] or r["producer_timeout"]]
        t.add(
            f"{fifos} FIFOs, {threads} consumer threads, {warps} warps",
            [r["popped"] / r["seconds"] / 1e6 for r in runs],
            extra={"commands per run": warps * per_warp, "all in order": "yes" if not bad else f"NO ({bad[0]})"},
        )
    report.progress(f"gpu-fifo: {rtt_iterations} single-command round trips")
    for line in command_latency_lines(portep_testing.cuda_fifo_rtt(rtt_iterations)):
        t.line(line)
    t.line(QUOTED)
    report.add(t)
    report.progress("gpu-fifo: get_dispatch_layout kernel")
    layout = Table(
        "gpu-fifo: get_dispatch_layout kernel, 4096 tokens, top-8, 256 experts, EP2",
        "us",
        "one GPU: the layout kernel alone, CUDA events around each launch (the output memsets included); "
        "baseline: torch ops computing the same counts and mask, same run.",
    )
    kernel, with_torch = _layout_times_us()
    layout.add("get_dispatch_layout kernel", kernel)
    layout.add("baseline: the same layout from torch ops (scatter_, sum, bincount)", with_torch)
    layout.line("quoted, not this run: DeepEP V1 on the H200 machine (reference/gpu-machine.md): 52 us")
    report.add(layout)


def command_latency_lines(t, skip=100):
    """The round trip of one command and the one-way publish -> proxy-sees-it latency, from cuda_fifo_rtt's
    clocks. One-way latency needs one clock: the GPU's globaltimer and the host's CLOCK_REALTIME are offset by
    an unknown d (hundreds of us on the H200 host), so we bound it two ways. (1) Causality: every command's
    publish -> pop (true + d) and release -> seen (true - d) legs are positive, which bounds d. (2) The return
    leg, host release -> GPU sees the tail, is one GPU read of host memory after the store lands: between half
    and one and a half read round trips R (R timed on the GPU clock alone), so publish -> pop = round trip - host
    part - return leg."""
    pub, pop, rel, seen = (t[k][skip:] for k in ("publish_ns", "pop_ns", "release_ns", "seen_ns"))
    rtt = [s - p for p, s in zip(pub, seen)]
    fwd_raw = [o - p for p, o in zip(pub, pop)]
    back_raw = [s - r for r, s in zip(rel, seen)]
    host = [r - o for o, r in zip(pop, rel)]
    read = median(t["host_read_ns"][10:])
    base = median(rtt) - median(host)  # publish -> pop plus the return leg
    lo_c, hi_c = median(fwd_raw) - min(fwd_raw), median(fwd_raw) + min(back_raw)
    lo_r, hi_r = max(base - 1.5 * read, 0), base - 0.5 * read
    if lo_c <= hi_c:
        lo, hi, how = (
            max(lo_c, lo_r),
            min(hi_c, hi_r),
            ("causality bounds the leg exactly, the read time only if a read's return half takes at least half a read"),
        )
    else:  # the offset moved during the run (the clocks drift or step): only the read-time bounds are left
        lo, hi, how = (
            lo_r,
            hi_r,
            (
                f"the causality bounds came out empty ({lo_c / 1e3:.2f} > {hi_c / 1e3:.2f} us: "
                f"the clocks' offset moved during the run), so these are the read-time bounds"
            ),
        )
    p99_hi = percentile([x - h for x, h in zip(rtt, host)], 99) - 0.5 * read
    lines = []
    if t.get("host_clock_before_ns"):  # one clock: the host's, read by the GPU just before each publish
        upper = [o - c for o, c in zip(pop, t["host_clock_before_ns"][skip:])]
        lines.append(
            f"publish -> the proxy loop pops it, on the host clock alone: median at most "
            f"{median(upper) / 1e3:.2f} us, p99 at most {percentile(upper, 99) / 1e3:.2f} us (pop time minus "
            f"the host clock the GPU read just before publishing, which was older than the publish; an upper "
            f"bound by that read's return leg; target median <= 1.5 us)"
        )
    return lines + [
        f"round trip of one command (GPU publish -> proxy loop pops it -> tail seen by the GPU): median "
        f"{median(rtt) / 1e3:.2f} us, p99 {percentile(rtt, 99) / 1e3:.2f} us over {len(rtt)} commands (baseline "
        f"probe on this machine: 3.3 us); host pop -> tail published {median(host) / 1e3:.2f} us; one GPU read "
        f"of host memory {read / 1e3:.2f} us",
        f"publish -> the proxy loop sees the command: median between {lo / 1e3:.2f} and {hi / 1e3:.2f} us, p99 "
        f"about {p99_hi / 1e3:.2f} us at most (round trip - host part - return leg; {how}; target median "
        f"<= 1.5 us)",
    ]


def _event_times_us(fn, iterations, warmup=20):
    """Microseconds of each of `iterations` calls of fn, CUDA events around each, after `warmup` untimed calls."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iterations):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return times


def _layout_times_us(tokens=4096, topk=8, experts=256, ranks=2, iterations=200):
    """The layout kernel's launches (output memsets included), and the same layout from torch ops as the baseline."""
    import torch

    from portep import native
    from portep.backends.cuda.kernel_errors import KernelErrors

    g = torch.Generator().manual_seed(0)
    idx = torch.topk(torch.rand(tokens, experts, generator=g), topk, dim=1).indices.cuda()
    per_rank = torch.empty(ranks, dtype=torch.int32, device="cuda")
    per_expert = torch.empty(experts, dtype=torch.int32, device="cuda")
    in_rank = torch.empty(tokens, ranks, dtype=torch.bool, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    errors = KernelErrors(native, torch.device("cuda"))

    def kernel():
        native.cuda_dispatch_layout(
            idx,
            tokens,
            topk,
            experts,
            ranks,
            ranks,
            per_rank,
            None,
            per_expert,
            in_rank,
            stream,
            0,
            errors.words,
            errors.records,
        )

    def with_torch():
        mask = torch.zeros(tokens, ranks, dtype=torch.bool, device="cuda")
        mask.scatter_(1, idx // (experts // ranks), True)
        return mask.sum(0), torch.bincount(idx.flatten(), minlength=experts)

    return _event_times_us(kernel, iterations), _event_times_us(with_torch, iterations)
