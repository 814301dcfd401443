"""The normal-mode (HT) kernels' own throughput on one GPU: both ranks of an EP2 exchange in one process, each with
its own buffer in the same GPU's memory and the other's buffer as its direct peer, their kernels on two streams at
once (2 x config.num_sms blocks, so up to 66 SMs per rank on an H200). The peer's stores go to local HBM instead of
across NVLink, so this is not the two-GPU figure: it tells how fast the kernels move rows when the link is not the
limit, per SM count, next to a plain device copy of the same bytes from the same run. DeepEP's shape (4096 tokens
per rank, hidden 7168, top-8, 256 experts), DeepEP's byte counting (rows received, own rows included, x row bytes),
medians of CUDA events around both ranks' kernels, which a sleep on the GPU holds until the CPU has queued them all
(the CPU's launch time left out; on two GPUs each rank launches from its own process), next to the same timing with
the launches inside it (the tenth to twelfth sessions' figures); combine also with DeepEP's two bias tensors. Every
output is checked against a torch reference first.
`python -m portep.bench gpu-ht-loopback [--sms 8 16 24 32 48 64] [--masks self peer none]` (the default of
`python -m portep.bench` with one GPU). SM counts whose 2 x 2 x num_sms blocks do not fit on the GPU at once are
left out (the kernels need every block resident)."""
import statistics

import torch

from portep import native

from .ht_gpu import ht_inputs
from .ht_loopback_ranks import (E, H, K, N, R, cached_dispatch, combine, ctypes_u32, first_dispatch,
                                layout, make_ranks)
from .stats import table

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
    """Median ms of both ranks' launches, from a common start to the later end; queued: launch time left out."""
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
        times.append(start.elapsed_time(end))
    return statistics.median(times[3:])


def split_times(ranks, inputs, handles, C, streams, iterations, queued=True):
    """Per rank, median us from the common start to its notify's end and from there to its data kernel's end."""
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
    med = lambda v: statistics.median(v[3:])  # noqa: E731
    return ", ".join(f"rank {r}: notify {med(notify[r]):.1f}, data kernel {med(data[r]):.1f}" for r in range(R))


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
        code = ctypes_u32(ranks[r].error_host)
        expect(code == 0, f"{what}: rank {r}: kernel error code {code}")
    for d in range(R):
        want = torch.cat([inputs[s][0][inputs[s][3][:, d]] for s in range(R)])
        expect(torch.equal(handles[d]["recv_x"], want), f"{what}: rank {d}: received rows differ")


def run(sms_list=(8, 16, 24, 32, 48, 64), iterations=20, masks=(), check=True, printer=print):
    """Measures and prints the table; masks: also time BF16 dispatch with every token sent to its own rank only
    ('self'), the peer only ('peer'), nowhere ('none'); check=False reports differing outputs instead of stopping."""
    global STRICT
    STRICT = check
    SLEEP_TOO_SHORT.clear()  # a count per run
    if not torch.cuda.is_available() or not native.build_info()["cuda_built"]:
        raise RuntimeError("gpu-ht-loopback needs a CUDA GPU and portep's CUDA kernels (built with nvcc); "
                           f"here: GPU visible {torch.cuda.is_available()}, kernels built "
                           f"{native.build_info()['cuda_built']}")
    gpu_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    fitting = [s for s in sms_list if 2 * 2 * (s // 2) + 2 <= gpu_sms]  # both ranks' blocks and notifies at once
    if not fitting:
        raise ValueError(f"sms_list={list(sms_list)}: none fits this GPU's {gpu_sms} SMs twice (two ranks)")
    ranks = make_ranks()
    inputs = []
    for r in range(R):
        x, idx, w, fp8 = ht_inputs(r, N, H, K, E)
        in_rank, per_expert = layout(idx, E)
        inputs.append((x, idx, w.float(), in_rank, per_expert, (fp8[0].contiguous(), fp8[1].contiguous())))
    gen = torch.Generator(device="cuda").manual_seed(7)
    biases = [tuple(torch.randn(N, H, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
              for _ in range(R)]
    streams = [torch.cuda.Stream() for _ in range(R)]
    torch.cuda.synchronize()
    rows_out = []
    for sms in fitting:
        C = sms // 2
        handles = first_dispatch(ranks, [i[:5] for i in inputs], E, C, streams)
        check_outputs(ranks, inputs, handles, f"first dispatch, {sms} SMs")
        for r in range(R):
            h = handles[r]
            h["recv_fp8"] = torch.empty(h["rows"], H, dtype=torch.float8_e4m3fn, device="cuda")
            h["recv_scales"] = torch.empty(h["rows"], H // 128, dtype=torch.float32, device="cuda")
            h["out"] = torch.empty(N, H, dtype=torch.bfloat16, device="cuda")
        t_notify = timed_pair(lambda r, s: ranks[r].kernels.notify(C, s.cuda_stream, False, inputs[r][3].data_ptr(),
                                                                   0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), streams,
                              iterations)
        rows_out.append(["notify alone (flags)", sms, f"{t_notify * 1e3:.1f}", "-", "-", "-"])
        launches = {
            "dispatch BF16": lambda r, s: cached_dispatch(ranks[r], r, inputs[r][:5], handles[r], C, s, None),
            "dispatch FP8": lambda r, s: cached_dispatch(ranks[r], r, inputs[r][:5], handles[r], C, s, inputs[r][5]),
            "combine": lambda r, s: combine(ranks[r], r, inputs[r][:5], handles[r], C, s)}
        t_bf16 = timed_pair(launches["dispatch BF16"], streams, iterations)
        check_outputs(ranks, inputs, handles, f"cached dispatch, {sms} SMs")
        t_fp8 = timed_pair(launches["dispatch FP8"], streams, iterations)
        for d in range(R):
            want = torch.cat([inputs[s][5][0][inputs[s][3][:, d]] for s in range(R)])
            expect(torch.equal(handles[d]["recv_fp8"].view(torch.uint8), want.view(torch.uint8)), "FP8 rows differ")
        t_comb = timed_pair(launches["combine"], streams, iterations)
        for r in range(R):  # each token comes back from every rank it went to, summed in FP32 (exact here)
            x, in_rank = inputs[r][0], inputs[r][3]
            want = (x.float() * in_rank.sum(1, keepdim=True).float()).to(torch.bfloat16)
            expect(torch.equal(handles[r]["out"], want), f"combine, {sms} SMs: rank {r} differs")
        t_bias = timed_pair(lambda r, s: combine(ranks[r], r, inputs[r][:5], handles[r], C, s, biases[r]), streams,
                            iterations)
        for r in range(R):  # the kernels' FP32 order: bias0, + bias1, then + each rank's row (all equal to x here)
            x, in_rank = inputs[r][0].float(), inputs[r][3]
            acc, count = biases[r][0].float() + biases[r][1].float(), in_rank.sum(1, keepdim=True)
            want = torch.where(count >= 1, acc + x, acc)
            want = torch.where(count == 2, want + x, want).to(torch.bfloat16)
            expect(torch.equal(handles[r]["out"], want), f"combine with bias, {sms} SMs: rank {r} differs")
        rows_out.append(["  split: " + split_times(ranks, inputs, handles, C, streams, iterations), sms, "-",
                         "-", "-", "-"])
        rows_out.append(["  split, launch included: " + split_times(ranks, inputs, handles, C, streams, iterations,
                                                                    False), sms, "-", "-", "-", "-"])
        # the tenth to twelfth sessions' method: the CPU's launches inside the timing
        launched = {name: timed_pair(launch, streams, iterations, False) for name, launch in launches.items()}
        for mask in masks:
            mi = masked_inputs(inputs, mask)
            mh = first_dispatch(ranks, [i[:5] for i in mi], E, C, streams)
            check_outputs(ranks, mi, mh, f"first dispatch, mask {mask}, {sms} SMs")
            t = timed_pair(lambda r, s: cached_dispatch(ranks[r], r, mi[r][:5], mh[r], C, s, None), streams,
                           iterations)
            check_outputs(ranks, mi, mh, f"cached dispatch, mask {mask}, {sms} SMs")
            gbs = f"{mh[0]['rows'] * 2 * H / t / 1e6:.1f}" if mh[0]["rows"] else "-"
            rows_out.append([f"dispatch BF16, tokens to {mask} only ({mh[0]['rows']} rows)", sms, f"{t * 1e3:.1f}",
                             gbs, "-", "-"])
        rows = handles[0]["rows"]
        for name, t, row_bytes in (("dispatch BF16", t_bf16, 2 * H), ("dispatch FP8", t_fp8, H + H // 128 * 4),
                                   ("combine", t_comb, 2 * H), ("combine + bias (two BF16 [N, H])", t_bias, 2 * H)):
            cells = [[f"{v * 1e3:.1f}", f"{rows * row_bytes / v / 1e6:.1f}"] if v else ["-", "-"]
                     for v in (t, launched.get(name))]  # queued, then launch included (where timed)
            rows_out.append([name, sms] + cells[0] + cells[1])
    # the same bytes as one rank's BF16 dispatch, copied device to device by both ranks at once
    nbytes = handles[0]["rows"] * 2 * H
    src = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(R)]
    dst = [torch.empty_like(s) for s in src]
    t_copy = timed_pair(lambda r, s: _copy_on(dst[r], src[r], s), streams, iterations)
    rows_out.append(["device copy, same bytes (both ranks at once)", "all", f"{t_copy * 1e3:.1f}",
                     f"{nbytes / t_copy / 1e6:.1f}", "-", "-"])
    left_out = sorted(set(sms_list) - set(fitting))
    if left_out:
        printer(f"left out (more blocks than this GPU runs at once): {left_out} SMs per rank")
    printer(f"HT loopback on one GPU: EP2 as two ranks in one process, {N} tokens per rank, hidden {H}, top-{K}, "
          f"{E} experts; rank 0 receives {handles[0]['rows']} rows; medians of {iterations}; GB/s per rank "
          "as DeepEP counts (rows received x row bytes); peer stores go to this GPU's HBM, not NVLink. Main columns: "
          "both ranks' kernels queued behind a sleep on the GPU before they start (the CPU's launch time left out); "
          "'launch incl.': timed from before the CPU launches rank 0's kernels, then rank 1's")
    if SLEEP_TOO_SHORT:
        printer(f"WARNING: in {len(SLEEP_TOO_SHORT)} queued timings the GPU's sleep ended before the last launch was "
                "queued: those include launch time")
    printer(table(["op", "SMs per rank", "us", "GB/s per rank", "us, launch incl.", "GB/s, launch incl."], rows_out))


def _copy_on(dst, src, stream):
    with torch.cuda.stream(stream):
        dst.copy_(src)

