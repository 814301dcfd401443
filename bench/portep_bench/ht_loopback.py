"""The normal-mode (HT) kernels' own throughput on one GPU: both ranks of an EP2 exchange in one process, each with
its own buffer in the same GPU's memory and the other's buffer as its direct peer, their kernels on two streams at
once (2 x config.num_sms blocks, so up to 66 SMs per rank on an H200). The peer's stores go to local HBM instead of
across NVLink, so this is not the two-GPU figure: it tells how fast the kernels move rows when the link is not the
limit, per SM count, next to a plain device copy of the same bytes from the same run. DeepEP's shape (4096 tokens
per rank, hidden 7168, top-8, 256 experts), DeepEP's byte counting (rows received, own rows included, x row bytes),
CUDA events around both ranks' kernels (min / median / mean / max), which a sleep on the GPU holds until the CPU has
queued them all (the CPU's launch time left out; on two GPUs each rank launches from its own process), next to the
same timing with the launches inside it (the tenth to twelfth sessions' figures); combine also with DeepEP's two bias
tensors. Every output is checked against a torch reference first.
`python -m portep_bench gpu-ht-loopback [--sms 8 16 24 32 48 64] [--masks self peer none]` (the default of
`python -m portep_bench` with one GPU, before ll-host). SM counts whose 2 x 2 x num_sms blocks do not fit on the GPU
at once are left out (the kernels need every block resident). One table per SM count, each with the device copy."""

import torch

from portep import native

from .ht_gpu import ht_inputs
from .ht_loopback_ranks import (
    E,
    H,
    K,
    N,
    R,
    cached_dispatch,
    combine,
    failure_code,
    first_dispatch,
    layout,
    make_ranks,
    notify_flags,
)
from .report import MissingHardware, Table

NOTE = (
    "loopback: both EP2 ranks on one GPU, so the peer's stores go to this GPU's own memory (HBM), not over "
    "NVLink: the kernels' own throughput when the link is not the limit, not the two-GPU figure. Samples in us: "
    "CUDA events from a common start to the later rank's end; rows without 'launch incl.' have both ranks' "
    "launches queued behind a GPU sleep first (the CPU's launch time left out). GB/s per rank at the median, as "
    "DeepEP counts (rows received x row bytes). Baseline: a device-to-device copy of one rank's BF16 dispatch "
    "bytes by both ranks at once, same run."
)

STRICT = True  # --no-check: report differing outputs instead of stopping (diagnostic builds)


def expect(ok, what):
    if ok:
        return
    if STRICT:
        raise AssertionError(what)
    print(f"CHECK FAILED: {what}")


HOLD_CYCLES = 2_000_000  # about 1 ms at H200 clocks: longer than launching both ranks' kernels from Python
SLEEP_TOO_SHORT = []  # queued timings whose start event had passed before the last launch was queued


def common_start(streams, queued):
    """The event both ranks' streams start from. queued: stream 0 first sleeps, so that every launch that follows is
    queued before either rank runs and the CPU's launch time drops out of the timings."""
    start = torch.cuda.Event(enable_timing=True)
    if queued:
        with torch.cuda.stream(streams[0]):
            torch.cuda._sleep(HOLD_CYCLES)
    start.record(streams[0])
    streams[1].wait_event(start)
    return start


def check_held(start, queued):
    if queued and start.query():
        SLEEP_TOO_SHORT.append(1)


def timed_pair(launch, streams, iterations, queued=True):
    """Microseconds of both ranks' launches, from a common start to the later end, after 3 untimed; queued: launch
    time left out."""
    times = []
    for _ in range(iterations + 3):
        end, mid = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start = common_start(streams, queued)
        for r in range(R):
            launch(r, streams[r])
        check_held(start, queued)
        mid.record(streams[1])
        streams[0].wait_event(mid)
        end.record(streams[0])
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return times[3:]


def split_times(ranks, inputs, handles, C, streams, iterations, queued=True):
    """Per rank, us from the common start to its notify's end and from there to its data kernel's end (samples after
    3 untimed): {(rank, 'notify' or 'data kernel'): samples}."""
    notify, data = [[] for _ in range(R)], [[] for _ in range(R)]
    for _ in range(iterations + 3):
        mids = [torch.cuda.Event(enable_timing=True) for _ in range(R)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(R)]
        start = common_start(streams, queued)
        for r in range(R):
            cached_dispatch(ranks[r], r, inputs[r][:5], handles[r], C, streams[r], None, mids[r])
            ends[r].record(streams[r])
        check_held(start, queued)
        torch.cuda.synchronize()
        for r in range(R):
            notify[r].append(start.elapsed_time(mids[r]) * 1e3)
            data[r].append(mids[r].elapsed_time(ends[r]) * 1e3)
    return {**{(r, "notify"): notify[r][3:] for r in range(R)}, **{(r, "data kernel"): data[r][3:] for r in range(R)}}


def masked_inputs(inputs, mask):
    """The inputs with is_token_in_rank replaced: 'self' (each token to its own rank only), 'peer' (to the other
    rank only), 'none' (nowhere)."""
    out = []
    for r, (x, idx, w, in_rank, per_expert, fp8) in enumerate(inputs):
        m = torch.zeros_like(in_rank)
        if mask == "self":
            m[:, r] = True
        elif mask == "peer":
            m[:, 1 - r] = True
        out.append((x, idx, w, m, per_expert, fp8))
    return out


def check_outputs(ranks, inputs, handles, what):
    for r in range(R):
        code = failure_code(ranks[r])
        expect(code == 0, f"{what}: rank {r}: kernel error code {code}")
    for d in range(R):
        want = torch.cat([inputs[s][0][inputs[s][3][:, d]] for s in range(R)])
        expect(torch.equal(handles[d]["recv_x"], want), f"{what}: rank {d}: received rows differ")


def run(report, sms_list=(8, 16, 24, 32, 48, 64), iterations=20, masks=(), check=True):
    """Measures and prints one table per SM count; masks: also time BF16 dispatch with every token sent to its own
    rank only ('self'), the peer only ('peer'), nowhere ('none'); check=False reports differing outputs instead of
    stopping."""
    global STRICT
    STRICT = check
    SLEEP_TOO_SHORT.clear()  # a count per run
    if not torch.cuda.is_available() or not native.build_info()["cuda_built"]:
        raise MissingHardware(
            "gpu-ht-loopback needs a CUDA GPU and portep's CUDA kernels (built with nvcc); "
            f"here: GPU visible {torch.cuda.is_available()}, kernels built "
            f"{native.build_info()['cuda_built']}"
        )
    gpu_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    fitting = [s for s in sms_list if 2 * 2 * (s // 2) + 2 <= gpu_sms]  # both ranks' blocks and notifies at once
    if not fitting:
        raise ValueError(f"sms_list={list(sms_list)}: none fits this GPU's {gpu_sms} SMs twice (two ranks)")
    report.say(
        f"gpu-ht-loopback: EP2 as two ranks in one process, {N} tokens per rank, hidden {H}, top-{K}, {E} "
        f"experts, SMs per rank {fitting}; {NOTE}"
    )
    left_out = sorted(set(sms_list) - set(fitting))
    if left_out:
        report.say(f"gpu-ht-loopback: left out (more blocks than this GPU runs at once): {left_out} SMs per rank")
    report.progress("gpu-ht-loopback: making both ranks' buffers and inputs")
    ranks = make_ranks()
    inputs = []
    for r in range(R):
        x, idx, w, fp8 = ht_inputs(r, N, H, K, E)
        in_rank, per_expert = layout(idx, E)
        inputs.append((x, idx, w.float(), in_rank, per_expert, (fp8[0].contiguous(), fp8[1].contiguous())))
    gen = torch.Generator(device="cuda").manual_seed(7)
    biases = [
        tuple(torch.randn(N, H, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2)) for _ in range(R)
    ]
    streams = [torch.cuda.Stream() for _ in range(R)]
    torch.cuda.synchronize()
    rows = sum(int(inputs[s][3][:, 0].sum()) for s in range(R))  # rank 0's received rows, its own included
    report.progress("gpu-ht-loopback: baseline, device copy of the same bytes")
    copy = _device_copy_us(rows * 2 * H, streams, iterations)
    for sms in fitting:
        t = Table(f"gpu-ht-loopback: {sms} SMs per rank, EP2 on one GPU, rank 0 receives {rows} rows", "us", NOTE)
        _measure(t, report.progress, ranks, inputs, biases, streams, sms, iterations, masks)
        t.add("baseline: device copy, same bytes as BF16 dispatch (both ranks at once)", copy, rows * 2 * H)
        if SLEEP_TOO_SHORT:
            t.line(
                f"WARNING: in {len(SLEEP_TOO_SHORT)} queued timings so far the GPU's sleep ended before the last "
                "launch was queued: those include launch time"
            )
        report.add(t)


def _measure(t, progress, ranks, inputs, biases, streams, sms, iterations, masks):
    """Checks every output against torch, then adds one row per op to t (queued, then launch included)."""
    C = sms // 2
    progress(f"gpu-ht-loopback: {sms} SMs: first dispatch and checks")
    handles = first_dispatch(ranks, [i[:5] for i in inputs], E, C, streams)
    check_outputs(ranks, inputs, handles, f"first dispatch, {sms} SMs")
    rows = handles[0]["rows"]
    progress(f"gpu-ht-loopback: {sms} SMs: notify, dispatch BF16 / FP8, combine, combine + bias")
    t.add(
        "notify alone (flags)",
        timed_pair(lambda r, s: notify_flags(ranks[r], inputs[r][:5], C, s), streams, iterations),
    )
    launches = {
        "dispatch BF16": lambda r, s: cached_dispatch(ranks[r], r, inputs[r][:5], handles[r], C, s, None),
        "dispatch FP8": lambda r, s: cached_dispatch(ranks[r], r, inputs[r][:5], handles[r], C, s, inputs[r][5]),
        "combine": lambda r, s: combine(ranks[r], r, inputs[r][:5], handles[r], C, s),
    }
    nbytes = {"dispatch BF16": rows * 2 * H, "dispatch FP8": rows * (H + H // 128 * 4), "combine": rows * 2 * H}
    timed = lambda name: t.add(name, timed_pair(launches[name], streams, iterations), nbytes[name])  # noqa: E731
    timed("dispatch BF16")
    check_outputs(ranks, inputs, handles, f"cached dispatch, {sms} SMs")
    timed("dispatch FP8")
    for d in range(R):
        want = torch.cat([inputs[s][5][0][inputs[s][3][:, d]] for s in range(R)])
        expect(torch.equal(handles[d]["recv_fp8"].view(torch.uint8), want.view(torch.uint8)), "FP8 rows differ")
    timed("combine")
    for r in range(R):  # each token comes back from every rank it went to, summed in FP32 (exact here)
        x, in_rank = inputs[r][0], inputs[r][3]
        want = (x.float() * in_rank.sum(1, keepdim=True).float()).to(torch.bfloat16)
        expect(torch.equal(handles[r]["out"], want), f"combine, {sms} SMs: rank {r} differs")
    with_bias = lambda r, s: combine(ranks[r], r, inputs[r][:5], handles[r], C, s, biases[r])  # noqa: E731
    t.add("combine + bias (two BF16 [N, H])", timed_pair(with_bias, streams, iterations), nbytes["combine"])
    for r in range(R):  # the kernels' FP32 order: bias0, + bias1, then + each rank's row (all equal to x here)
        x, in_rank = inputs[r][0].float(), inputs[r][3]
        acc, count = biases[r][0].float() + biases[r][1].float(), in_rank.sum(1, keepdim=True)
        want = torch.where(count >= 1, acc + x, acc)
        want = torch.where(count == 2, want + x, want).to(torch.bfloat16)
        expect(torch.equal(handles[r]["out"], want), f"combine with bias, {sms} SMs: rank {r} differs")
    progress(f"gpu-ht-loopback: {sms} SMs: notify / data kernel split, launch-included timings")
    for queued, how in ((True, ""), (False, ", launch incl.")):
        for (r, phase), samples in split_times(ranks, inputs, handles, C, streams, iterations, queued).items():
            t.add(f"split{how}: rank {r} {phase}" + (" (from the common start)" if phase == "notify" else ""), samples)
    # the tenth to twelfth sessions' method: the CPU's launches inside the timing
    for name, launch in launches.items():
        t.add(f"{name}, launch incl.", timed_pair(launch, streams, iterations, False), nbytes[name])
    for mask in masks:
        progress(f"gpu-ht-loopback: {sms} SMs: BF16 dispatch, tokens to {mask} only")
        mi = masked_inputs(inputs, mask)
        mh = first_dispatch(ranks, [i[:5] for i in mi], E, C, streams)
        check_outputs(ranks, mi, mh, f"first dispatch, mask {mask}, {sms} SMs")
        samples = timed_pair(
            lambda r, s: cached_dispatch(ranks[r], r, mi[r][:5], mh[r], C, s, None), streams, iterations
        )
        check_outputs(ranks, mi, mh, f"cached dispatch, mask {mask}, {sms} SMs")
        t.add(f"dispatch BF16, tokens to {mask} only ({mh[0]['rows']} rows)", samples, mh[0]["rows"] * 2 * H or None)


def _device_copy_us(nbytes, streams, iterations):
    """The same bytes as one rank's BF16 dispatch, copied device to device by both ranks at once."""
    src = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(R)]
    dst = [torch.empty_like(s) for s in src]
    return timed_pair(lambda r, s: _copy_on(dst[r], src[r], s), streams, iterations)


def _copy_on(dst, src, stream):
    with torch.cuda.stream(stream):
        dst.copy_(src)
