"""bench/ll_host_ab.sh's summary (bench/portep_bench/ll_host_ab.py) on ll-host --json files made up here: the medians
it reads, the ratios it prints, the pairing of each new run with the old run next to it; and the script's refusal
without the earlier tree's folder."""

import json
import os
import random
import subprocess

import pytest

from portep_bench import ll_host_ab

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _write(path, trip, base, rng):
    """An ll-host report whose round trip and baseline rows have these medians (odd sample counts, shuffled, other
    rows beside them)."""
    samples = {
        ll_host_ab.ROUND_TRIP: [trip - 1.0, trip, trip + 5.0],
        ll_host_ab.ROUND_TRIP.replace("one native call", "two native calls"): [99.0, 98.0, 97.0],
        "portep LL dispatch alone": [99.0, 98.0, 97.0],
        # ll-host names a row's batches whose GPU hold ended early after its name
        ll_host_ab.BASELINE + "; in 1 of 10 batches the GPU's hold ended early": [
            base + 3,
            base,
            base - 0.5,
            base + 1,
            0,
        ],
    }
    for s in samples.values():
        rng.shuffle(s)
    table = {"samples": [{"what": what, "samples": s} for what, s in samples.items()]}
    path.write_text(json.dumps({"tables": [table]}))
    return str(path)


def test_summary_pairs_each_new_run_with_the_old_run_next_to_it(tmp_path):
    rng = random.Random(35)
    runs = [("old", 1, 8.0, 6.0), ("new", 1, 7.2, 6.1), ("new", 2, 9.9, 7.0), ("old", 2, 11.0, 7.1)]
    paths = [_write(tmp_path / f"{t}-{k}.json", trip, base, rng) for t, k, trip, base in runs]
    lines = ll_host_ab.summarize("old", "new", paths)
    assert lines[1:5] == [
        "1 | old | 8.00 | 6.00 | 1.333",
        "2 | new | 7.20 | 6.10 | 1.180",
        "3 | new | 9.90 | 7.00 | 1.414",
        "4 | old | 11.00 | 7.10 | 1.549",
    ], lines
    # run 2 pairs with run 1 (7.2 / 8.0), run 3 with run 4 (9.9 / 11.0): both 0.9
    assert lines[-2] == "new round trip over old's in the run next to it: 0.900, 0.900; median 0.900 (at or below 1)"
    # (7.2 / 6.1) / (8 / 6) = 0.885, (9.9 / 7) / (11 / 7.1) = 0.913
    assert lines[-1] == (
        "new round trip / baseline over old's in the run next to it: 0.885, 0.913; median 0.899 (at or below 1)"
    )
    assert lines[5].startswith("old: 2 runs, round trip median of medians 9.50 us"), lines


def test_summary_says_above_when_the_new_tree_is_slower(tmp_path):
    rng = random.Random(36)
    paths = [_write(tmp_path / "old-1.json", 7.0, 6.0, rng), _write(tmp_path / "new-1.json", 7.7, 6.0, rng)]
    lines = ll_host_ab.summarize("old", "new", paths)
    assert lines[-2].endswith("median 1.100 (above 1)") and lines[-1].endswith("median 1.100 (above 1)"), lines


@pytest.mark.parametrize(
    "names,error",
    [(["old-1", "old-2"], "runs of both trees"), (["old-1", "other-1"], "names neither tree")],
)
def test_summary_refuses_runs_it_cannot_pair(tmp_path, names, error):
    rng = random.Random(37)
    paths = [_write(tmp_path / f"{n}.json", 7.0, 6.0, rng) for n in names]
    with pytest.raises(ValueError, match=error):
        ll_host_ab.summarize("old", "new", paths)


def test_summary_names_a_missing_row(tmp_path):
    path = tmp_path / "old-1.json"
    path.write_text(json.dumps({"tables": [{"samples": [{"what": ll_host_ab.ROUND_TRIP, "samples": [1.0]}]}]}))
    with pytest.raises(ValueError, match="0 rows named 'baseline"):
        ll_host_ab.medians(str(path))


def test_script_refuses_without_the_earlier_tree(tmp_path):
    r = subprocess.run(
        ["bash", os.path.join(ROOT, "bench", "ll_host_ab.sh"), str(tmp_path / "absent")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and "no folder" in r.stderr, r.stdout + r.stderr
