"""Where the HT combine's time goes, per channel: the probe patches timers into gpu_kernels/cuda/ht_combine.cu
(the reducer: time waiting for rows (await_batch) and time summing a batch (reduce_token to the barrier after it);
the sender: time until its last row is sent; printf from the first block of every fourth channel), rebuilds,
runs the loopback benchmark (python -m portep.bench gpu-ht-loopback, both EP2 ranks on one GPU), prints the
medians of the last 8 combines per (role, rank, channel) in microseconds, then restores the source and rebuilds.
The twelfth session's figures (24 SMs per rank, before the reduction was rewritten): the reducer spent 286 of its
362 us summing and 25 us waiting, the sender finished after 136 us, so the reduction bounds combine.
Run from the repository root on a GPU machine: python bench/probes/ht_combine_phases.py [sms] [build-dir]"""
import re
import statistics
import subprocess
import sys

SOURCE = "gpu_kernels/cuda/ht_combine.cu"


def insert_after(text, anchor, start, addition):
    """text with addition on the line after the first line at or after start that holds anchor."""
    at = text.index(anchor, start)
    end = text.index("\n", at) + 1
    return text[:end] + addition + text[end:]


def patched(text):
    text = "#include <cstdio>\n" + text
    reducer = text.index("PORTEP_DEVICE void reduce_channel")
    loop = text.index("for (int b = t0; b < t1; b += kHTWarps) {", reducer)
    text = text[:loop] + "uint64_t T0 = globaltimer_ns(), TW = 0, TR = 0, ta, tb;\n  " + text[loop:]
    text, n = re.subn(r"    if \(!await_batch\(a, st, ch, epoch\)\) return;\n"
                      r"    if \(t < t1\) (reduce_token\([^;]*\));\n    __syncthreads\(\);[^\n]*\n",
                      r"    ta = globaltimer_ns();\n    if (!await_batch(a, st, ch, epoch)) return;\n"
                      r"    tb = globaltimer_ns();\n    TW += tb - ta;\n    if (t < t1) \1;\n    __syncthreads();\n"
                      r"    TR += globaltimer_ns() - tb;\n", text)
    if n != 1:
        raise SystemExit(f"{SOURCE}: the reducer's batch loop is not where the probe expects it")
    text = insert_after(text, "consume_units(c, j, data_stream(c, true, ch), chunks(st.base[j]));", reducer,
                        '  if (threadIdx.x == 0 && ch % 4 == 0) printf("RED r%d ch%d total %llu wait %llu reduce '
                        '%llu\\n", c.rank, ch, (unsigned long long)(globaltimer_ns() - T0), (unsigned long long)TW, '
                        '(unsigned long long)TR);\n')
    sender = text.index("PORTEP_DEVICE void send_channel")
    epoch = text.index("const uint64_t epoch = *c.epoch;", sender)
    text = text[:epoch] + "const uint64_t T0 = globaltimer_ns();\n  " + text[epoch:]
    return insert_after(text, "if (s != c.rank && !send_to(a, ch, s, epoch, st)) return;", sender,
                        '  if (threadIdx.x == 0 && ch % 4 == 0) printf("SND r%d ch%d total %llu\\n", c.rank, ch, '
                        '(unsigned long long)(globaltimer_ns() - T0));\n')


def build(build_dir):
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "-e", ".",
                    f"-Cbuild-dir={build_dir}"], check=True)


def summarize(lines, keep=8):
    samples = {}
    for line in lines:
        m = re.match(r"(RED|SND) r(\d+) ch(\d+) total (\d+)(?: wait (\d+) reduce (\d+))?", line)
        if m:
            samples.setdefault(m.groups()[:3], []).append([int(v) for v in m.groups()[3:] if v is not None])
    for (role, rank, ch), runs in sorted(samples.items()):
        cols = [statistics.median(c) / 1000 for c in zip(*runs[-keep:])]
        names = ["total", "waiting", "summing"] if role == "RED" else ["total"]
        what = ", ".join(f"{n} {v:.1f} us" for n, v in zip(names, cols))
        print(f"{'reducer' if role == 'RED' else 'sender '} rank {rank} channel {ch:>2}: {what} ({len(runs)} combines)")


def run_probe(source, patch, summary, op):
    """Patches source (patch: text -> text), rebuilds, runs the loopback at sys.argv[1] SMs (default 24; build
    directory sys.argv[2], default build/gpu), prints the table rows of `op` and summary(stdout lines), then restores
    the source and rebuilds."""
    sms = sys.argv[1] if len(sys.argv) > 1 else "24"
    build_dir = sys.argv[2] if len(sys.argv) > 2 else "build/gpu"
    original = open(source).read()
    try:
        open(source, "w").write(patch(original))
        build(build_dir)
        run = subprocess.run([sys.executable, "-m", "portep.bench", "gpu-ht-loopback", "--sms", sms, "--iterations",
                              "8"], capture_output=True, text=True, check=True)
        print("\n".join(line for line in run.stdout.splitlines() if op in line and "|" in line))
        summary(run.stdout.splitlines())
    finally:
        open(source, "w").write(original)
        build(build_dir)


if __name__ == "__main__":
    run_probe(SOURCE, patched, summarize, "combine")
