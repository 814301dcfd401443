"""The LL host time of two trees side by side (bench/ll_host_ab.sh): the --json files of `python -m portep_bench
ll-host` runs made with each tree in turn on one machine, summarised. Per run: the round trip's median (dispatch +
combine, the fast path with graph launches) and the baseline's (torch.empty + one empty launch) from that run; then,
for each run of the second tree, its round trip over the round trip of the first tree's run next to it in time (the
machine drifts between runs; neighbours share its state), and the same for the round trip over its own run's baseline
(which also takes out what drifts between two neighbouring runs). Issue 35's bound is these at or below 1: the host
time has not grown since the first tree.

    python -m portep_bench.ll_host_ab FIRST_NAME SECOND_NAME RUN.json ...   (each file named NAME-K.json, in run order)
"""

import json
import os
import statistics
import sys

ROUND_TRIP = "portep LL round trip (dispatch + combine), one native call per phase"
BASELINE = "baseline: torch.empty + one empty kernel launch (torch.cuda._sleep(0))"


def medians(path):
    """(round trip median us, baseline median us) of one ll-host --json file."""
    with open(path) as f:
        report = json.load(f)
    rows = {r["what"]: r["samples"] for t in report["tables"] for r in t["samples"]}
    found = []
    for what in (ROUND_TRIP, BASELINE):  # a row's name may go on: "; in 1 of 10 batches the GPU's hold ended early"
        named = [name for name in rows if name == what or name.startswith(what + ";")]
        if len(named) != 1:
            raise ValueError(f"{path}: {len(named)} rows named {what!r} (rows: {sorted(rows)})")
        found.append(statistics.median(rows[named[0]]))
    return tuple(found)


def summarize(first, second, paths):
    """The summary's lines: paths in run order, each named FIRST-K.json or SECOND-K.json."""
    runs = []
    for path in paths:
        tree = os.path.basename(path).rsplit("-", 1)[0]
        if tree not in (first, second):
            raise ValueError(f"{path}: its name names neither tree ({first!r}, {second!r})")
        runs.append((tree, *medians(path)))  # (tree, round trip, baseline)
    if not any(r[0] == first for r in runs) or not any(r[0] == second for r in runs):
        raise ValueError(f"runs of both trees are needed, got {[r[0] for r in runs]}")
    lines = ["run | tree | round trip median us | baseline median us | round trip / baseline"]
    for i, (tree, trip, base) in enumerate(runs):
        lines.append(f"{i + 1} | {tree} | {trip:.2f} | {base:.2f} | {trip / base:.3f}")
    pairs, scaled = [], []  # each second-tree run over the first tree's run next to it: round trips; their ratios
    for i, (tree, trip, base) in enumerate(runs):
        if tree != second:
            continue
        near = runs[min((j for j, r in enumerate(runs) if r[0] == first), key=lambda j: (abs(j - i), j))]
        pairs.append(trip / near[1])
        scaled.append((trip / base) / (near[1] / near[2]))
    for tree in (first, second):
        mine = [r for r in runs if r[0] == tree]
        trips = statistics.median(r[1] for r in mine)
        ratio = statistics.median(r[1] / r[2] for r in mine)
        lines.append(
            f"{tree}: {len(mine)} runs, round trip median of medians {trips:.2f} us, over baseline {ratio:.3f}"
        )
    for what, values in (("round trip", pairs), ("round trip / baseline", scaled)):
        mid = statistics.median(values)
        lines.append(
            f"{second} {what} over {first}'s in the run next to it: "
            + ", ".join(f"{v:.3f}" for v in values)
            + f"; median {mid:.3f} ({'at or below' if mid <= 1 else 'above'} 1)"
        )
    return lines


def main(argv):
    if len(argv) < 4:
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(summarize(argv[1], argv[2], argv[3:])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
