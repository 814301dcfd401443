"""Where the HT dispatch sender's time goes, per channel: the probe patches cycle counters into
gpu_kernels/cuda/ht_dispatch.cu (measured by the thread that announces to the next rank, in warp 0: per batch of
kHTWarps tokens, the bookkeeping from the batch's start to its copies (ballot, masks, room), its own warp's copies
(send_token), the wait at the barrier after them for the slowest warp, and the announce; summed over the op and
scaled to ns by the block's globaltimer; printf from the first block of every fourth channel), rebuilds, runs the
loopback benchmark (python -m portep.bench gpu-ht-loopback, both EP2 ranks on one GPU), prints the medians over
its dispatches per (rank, channel, row bytes: BF16 or FP8) in microseconds, then restores the source and rebuilds.
Run from the repository root on a GPU machine: python bench/probes/ht_dispatch_phases.py [sms] [build-dir]"""
import re
import statistics

from ht_combine_phases import run_probe

SOURCE = "gpu_kernels/cuda/ht_dispatch.cu"
PHASES = ["book", "copy", "wait", "announce"]


def patched(text):
    text = "#include <cstdio>\n" + text
    sender = text.index("PORTEP_DEVICE void send_channel")
    loop = text.index("for (int b = t0; b < t1; b += kHTWarps) {", sender)
    text = (text[:loop] + "const uint64_t G0 = globaltimer_ns(), C0 = clock64();\n  long long P[4] = {0, 0, 0, 0}, "
            "tl, ta, tb, tc;\n  " + text[loop:])
    text = text.replace("for (int b = t0; b < t1; b += kHTWarps) {\n",
                        "for (int b = t0; b < t1; b += kHTWarps) {\n    tl = clock64();\n", 1)
    body = ("    if (t < t1) send_token(a, rec, st, t, warp);\n    __syncthreads();\n    if (d < R) {\n"
            "      st.sent[d] += st.batch[d];\n      announce(a, rec, st, ch, st.batch[d], b + kHTWarps >= t1);\n"
            "    }\n  }\n")
    if text.count(body) != 1:
        raise SystemExit(f"{SOURCE}: the sender's batch loop is not where the probe expects it")
    timed = ("    ta = clock64();\n    P[0] += ta - tl;\n    if (t < t1) send_token(a, rec, st, t, warp);\n"
             "    tb = clock64();\n    P[1] += tb - ta;\n    __syncthreads();\n"
             "    tc = clock64();\n    P[2] += tc - tb;\n"
             "    if (d < R) {\n      st.sent[d] += st.batch[d];\n"
             "      announce(a, rec, st, ch, st.batch[d], b + kHTWarps >= t1);\n    }\n"
             "    P[3] += clock64() - tc;\n  }\n"
             "  if (d == (c.rank + 1) % R && ch % 4 == 0) {\n"
             "    const double ns = double(globaltimer_ns() - G0) / double(clock64() - C0);\n"
             '    printf("SND r%d ch%d row %d total %llu %.0f %.0f %.0f %.0f\\n", c.rank, ch, a.row_bytes, '
             "(unsigned long long)(globaltimer_ns() - G0), P[0] * ns, P[1] * ns, P[2] * ns, P[3] * ns);\n  }\n")
    return text.replace(body, timed)


def summarize(lines):
    samples = {}
    for line in lines:
        m = re.match(r"SND r(\d+) ch(\d+) row (\d+) total (\d+) (\d+) (\d+) (\d+) (\d+)", line)
        if m:
            samples.setdefault(m.groups()[:3], []).append([int(v) for v in m.groups()[3:]])
    for (rank, ch, row), runs in sorted(samples.items(), key=lambda kv: tuple(int(v) for v in kv[0])):
        cols = [statistics.median(c) / 1000 for c in zip(*runs)]
        what = ", ".join(f"{n} {v:.1f} us" for n, v in zip(["total"] + PHASES, cols))
        print(f"sender rank {rank} channel {ch:>2} row bytes {row}: {what} ({len(runs)} dispatches)")


if __name__ == "__main__":
    run_probe(SOURCE, patched, summarize, "dispatch")
