"""What the GPU test files did, per file: passed, failed (errors included), skipped (with reasons) and never ran
(collected, planned for this run, but with no result: pytest was stopped by its time limit, or never started).
bench/device_session.sh uses it; its closing summary line is the one an issue's closing note quotes.

  python3 bench/gpu_test_report.py report [--json FILE] [--quiet] [--planned-only] SOURCE...   ("report" may be
      left out)
  python3 bench/gpu_test_report.py plan RAW PART [FILE...]

A SOURCE is a run's raw folder (device_session.sh's files.txt, collect.txt, plan.json, runs.tsv, meta.txt and
junit-*.xml, read from the repository root), a gpu-tests.json that `report --json` wrote, or a folder holding one
(what one device call brings back; it holds one run, or one per lane of a call that ran lanes side by side). With
one run, or with --planned-only (the lanes of one call), the tests counted are the ones the runs planned; with
several (the parts of a suite, in the order they ran) every test any of them collected counts, so a part left out
shows as never ran, and where a test has results in several SOURCEs the last one's count. Exit status 1 if any test
failed, was skipped or never ran, or none was counted; 2 on bad arguments.

`plan` deals the collected tests of RAW/collect.txt to a part: `all` runs each file whole; `N/M` runs every M-th
test of each file from its N-th, so each of M parts holds about 1/M of every file (the files differ too much in
length for whole files to fill M calls evenly); a file that could not be collected (or every file, where nothing
was) runs whole in one part, so that its error is counted. FILEs, if given, limit the plan to those (names or
paths); PORTEP_GPU_TEST_IDS, a file of test ids one per line, limits it to those. It writes RAW/plan.json and
RAW/ids-<file>.txt, and prints one line per file to run: the file, a tab, and its ids file (empty: run the file
whole).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

JSON_NAME = "gpu-tests.json"
STATUSES = ("passed", "skipped", "failed")  # worst last
COUNTS = ("passed", "failed", "skipped", "never ran")  # the order they are printed in
MESSAGE_CHARS = 400
LIST_IDS = 12


def _lines(path: Path) -> list[str]:
    return path.read_text(errors="replace").splitlines() if path.is_file() else []


def _rel(file: str) -> str:
    """A test file as pytest names it: relative to the repository root (pytest's rootdir, the working directory)."""
    return os.path.relpath(file) if os.path.isabs(file) else os.path.normpath(file)


def read_collect(raw: Path, files: list[str]) -> tuple[dict[str, list[str]], dict[str, str]]:
    """What `pytest --collect-only -q` printed into raw/collect.txt: the node ids by file, in collection order, and
    the files it could not collect, with the error's last line."""
    ids: dict[str, list[str]] = {f: [] for f in files}
    errors: dict[str, str] = {}
    current = None
    for line in _lines(raw / "collect.txt"):
        file = line.split("::", 1)[0]
        if "::" in line and file in ids:
            ids[file].append(line.strip())
        elif m := re.search(r"ERROR collecting (\S+\.py)", line):
            current = m[1]
            errors[current] = "collection error"
        elif current and line.startswith("E "):
            errors[current] = "collection error: " + _short(line[1:])
        elif m := re.match(r"ERROR (\S+\.py)", line):
            errors.setdefault(m[1], "collection error")
    return ids, {f: e for f, e in errors.items() if f in ids}


def collection_id(file: str) -> str:
    """The id under which a file's collection error counts (a failed test)."""
    return f"{file} (collection)"


def deal(ids: list[str], part: str, index: int, uncollected: bool) -> tuple[list[str], bool]:
    """This part's share of one file's ids and whether to run the file whole (index: the file's place in the list;
    uncollected: its collection failed, or everyone's did): see the module docstring."""
    n, m = (1, 1) if part == "all" else (int(x) for x in part.split("/"))
    if ids:
        return (ids, True) if part == "all" else (ids[n - 1 :: m], False)
    return [], uncollected and index % m == n - 1


def plan(raw: Path, part: str, only: list[str]) -> int:
    """Writes raw/plan.json and the ids files; prints the files to run (see the module docstring)."""
    files = [_rel(f) for f in _lines(raw / "files.txt") if f.strip()]
    wanted = {_rel(f) if "/" in f else f for f in only}
    unknown = wanted - set(files) - {Path(f).name for f in files}
    if unknown:
        print(f"plan: not among the test files: {' '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    collected, errors = read_collect(raw, files)
    ids_path = os.environ.get("PORTEP_GPU_TEST_IDS")
    if ids_path:  # only these tests (e.g. what an earlier call never ran)
        keep = set(_lines(Path(ids_path)))
        collected = {f: [i for i in ids if i in keep] for f, ids in collected.items()}
    nothing = not any(collected.values())
    entries: dict[str, dict[str, Any]] = {}
    for i, file in enumerate(files):
        if wanted and file not in wanted and Path(file).name not in wanted:
            continue
        ids, whole = deal(collected[file], part, i, nothing or file in errors)
        if not ids and not whole:
            continue
        entries[file] = {"planned": ids, "whole": whole}
        ids_file = ""
        if not whole:
            ids_file = str(raw / f"ids-{Path(file).stem}.txt")
            Path(ids_file).write_text("".join(x + "\n" for x in ids))
        print(f"{file}\t{ids_file}")
    (raw / "plan.json").write_text(json.dumps(entries, indent=1))
    return 0


def junit_key(nodeid: str) -> str:
    """The classname::name a pytest node id gets in junit XML (pytest's mangle_test_address)."""
    path, bracket, params = nodeid.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names[-1] += bracket + params
    return ".".join(names[:-1]) + "::" + names[-1]


def _short(text: str | None) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= MESSAGE_CHARS else text[: MESSAGE_CHARS - 3] + "..."


def case_result(case: ET.Element) -> dict[str, Any]:
    """One <testcase>: passed, failed (a <failure> or an <error>) or skipped (a <skipped>, xfail included)."""
    result: dict[str, Any] = {"status": "passed", "time": float(case.get("time") or 0)}
    bad = [e for e in case if e.tag in ("failure", "error")]
    skipped = case.find("skipped")
    if bad:
        result["status"] = "failed"
        result["message"] = "; ".join(f"{e.tag}: {_short(e.get('message') or e.text)}" for e in bad)
    elif skipped is not None:
        result["status"] = "skipped"
        kind = skipped.get("type") or ""
        result["message"] = ("xfail: " if "xfail" in kind else "") + _short(skipped.get("message") or skipped.text)
    return result


def read_junit(path: Path, file: str, known: list[str]) -> tuple[str, dict[str, dict[str, Any]]]:
    """The results in one file's junit XML, by node id; the XML's state: ok, missing or unreadable."""
    if not path.is_file():
        return "missing", {}
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        return f"unreadable ({e})", {}
    by_key = {junit_key(i): i for i in known}
    by_key[junit_key(file)] = collection_id(file)  # pytest's entry for a collection error: classname ""
    results: dict[str, dict[str, Any]] = {}
    for case in root.iter("testcase"):
        if not case.get("name"):
            continue  # pytest's entry for the interruption (SIGINT at the time limit)
        key = f"{case.get('classname') or ''}::{case.get('name')}"
        nodeid = by_key.get(key) or f"{file}::{key.lstrip(':')}"
        result = case_result(case)
        old = results.get(nodeid)  # a test with two entries (a call and its teardown, say) counts its worst
        if old is None or STATUSES.index(result["status"]) > STATUSES.index(old["status"]):
            results[nodeid] = result
    return "ok", results


def read_raw(raw: Path) -> dict[str, Any]:
    """One run's raw folder as the dict that `report --json` saves."""
    meta = dict(line.split("=", 1) for line in _lines(raw / "meta.txt") if "=" in line)
    files = [_rel(f) for f in _lines(raw / "files.txt") if f.strip()]
    collected, errors = read_collect(raw, files)
    planned = json.loads((raw / "plan.json").read_text()) if (raw / "plan.json").is_file() else {}
    runs = {}
    for line in _lines(raw / "runs.tsv"):
        file, rc, seconds, limit = line.split("\t")
        runs[_rel(file)] = {"rc": int(rc), "seconds": int(seconds), "limit": int(limit)}
    out: dict[str, Any] = {"version": 1, "meta": meta, "files": {}}
    for file in files:
        entry: dict[str, Any] = {
            "collected": collected[file],
            "planned": None,
            "run": runs.get(file),
            "junit": None,
            "results": {},
        }
        if file in planned:
            entry["planned"] = planned[file]["planned"]
        if file in errors:
            entry["results"][collection_id(file)] = {"status": "failed", "time": 0.0, "message": errors[file]}
        if file in runs:
            entry["junit"], results = read_junit(raw / f"junit-{Path(file).stem}.xml", file, collected[file])
            entry["results"].update(results)
        out["files"][file] = entry
    return out


def load(source: Path) -> list[dict[str, Any]]:
    """A SOURCE's runs: a gpu-tests.json (one run, or {"runs": [...]}), a folder holding one, or a raw folder."""
    if source.is_dir() and (source / JSON_NAME).is_file():
        source = source / JSON_NAME
    if source.is_file():
        saved = json.loads(source.read_text())
        return saved["runs"] if "runs" in saved else [saved]
    if (source / "files.txt").is_file():
        return [read_raw(source)]
    raise FileNotFoundError(f"{source}: neither {JSON_NAME} nor a raw folder (files.txt)")


def merge(runs: list[dict[str, Any]], planned_only: bool = False) -> dict[str, dict[str, Any]]:
    """Per file: the tests that count (expected), the results (the last run's win) and the runs' notes."""
    files: dict[str, dict[str, Any]] = {}
    planned_only = planned_only or len(runs) == 1
    for run in runs:
        part = run["meta"].get("part", "?")
        for file, e in run["files"].items():
            if planned_only and e["planned"] is None:
                continue  # not this run's file
            f = files.setdefault(file, {"expected": {}, "results": {}, "notes": []})
            f["expected"].update(dict.fromkeys(e["planned"] if planned_only else e["collected"]))
            f["results"].update(e["results"])
            if e["planned"] is None:
                continue
            if e["run"] is None:
                f["notes"].append(f"part {part}: not started (no time left)")
            elif e["junit"] != "ok" or e["run"]["rc"] not in (0, 1, 5):
                r = e["run"]
                why = " (the time limit)" if r["rc"] in (124, 137) else ""
                f["notes"].append(
                    f"part {part}: pytest rc {r['rc']}{why} after {r['seconds']} s of "
                    f"{r['limit']}, junit XML {e['junit']}"
                )
    return files


def counts(f: dict[str, Any]) -> dict[str, int]:
    c = {s: 0 for s in COUNTS}
    for r in f["results"].values():
        c[r["status"]] += 1
    c["never ran"] = sum(1 for i in f["expected"] if i not in f["results"])
    return c


def describe(file: str, f: dict[str, Any]) -> list[str]:
    """The report's lines for one file."""
    c = counts(f)
    lines = [f"{file}: " + ", ".join(f"{n} {s}" for s, n in c.items())]
    lines += [f"  note: {n}" for n in f["notes"]]
    order = [*(i for i in f["expected"] if i in f["results"]), *(i for i in f["results"] if i not in f["expected"])]
    lines += [
        f"  FAILED {i} - {f['results'][i].get('message', '')}" for i in order if f["results"][i]["status"] == "failed"
    ]
    reasons: dict[str, list[str]] = {}  # skips by reason: a missing GPU skips whole files
    for i in order:
        if f["results"][i]["status"] == "skipped":
            reasons.setdefault(f["results"][i].get("message", ""), []).append(i.split("::", 1)[-1])
    for reason, ids in reasons.items():
        more = f", ... and {len(ids) - LIST_IDS} more" if len(ids) > LIST_IDS else ""
        lines.append(f"  SKIPPED {len(ids)} - {reason}: {', '.join(ids[:LIST_IDS])}{more}")
    never = [i for i in f["expected"] if i not in f["results"]]
    lines += [f"  NEVER RAN {i}" for i in never[:LIST_IDS]]
    if len(never) > LIST_IDS:
        lines.append(f"  ... and {len(never) - LIST_IDS} more never ran")
    return lines


def summary(files: dict[str, dict[str, Any]], runs: list[dict[str, Any]]) -> tuple[str, bool]:
    """The one summary line and whether everything counted passed."""
    total = {s: 0 for s in COUNTS}
    per_file = []
    for file, f in files.items():
        c = counts(f)
        for s in total:
            total[s] += c[s]
        n = sum(c.values())
        if n:
            bad = ", ".join(f"{c[s]} {s}" for s in ("failed", "skipped", "never ran") if c[s])
            per_file.append(f"{Path(file).name} {c['passed']}/{n}" + (f" ({bad})" if bad else ""))
    parts = " ".join(r["meta"].get("part", "?") for r in runs)
    ks = "".join(f" -k {k!r}" for k in sorted({r["meta"].get("k") or "" for r in runs}) if k)
    trees = sorted({f"commit {r['meta'].get('commit', '?')} tree {r['meta'].get('tree', '?')}" for r in runs})
    where = f"part{'s' * (len(runs) > 1)} {parts}{ks}; {' / '.join(trees)}"
    where += " (DIFFERENT TREES)" if len(trees) > 1 else ""
    line = (
        f"gpu tests: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped, "
        f"{total['never ran']} never ran (files: {', '.join(per_file) or 'none'}; {where})"
    )
    ok = total["passed"] > 0 and total["failed"] == total["skipped"] == total["never ran"] == 0
    return line, ok


def report(args: argparse.Namespace) -> int:
    runs = [run for s in args.sources for run in load(Path(s))]
    if args.json:
        Path(args.json).write_text(json.dumps(runs[0] if len(runs) == 1 else {"version": 1, "runs": runs}, indent=1))
    files = merge(runs, args.planned_only)
    line, ok = summary(files, runs)
    if not args.quiet:
        for r in runs:
            m = r["meta"]
            if m.get("collect_rc") not in (None, "0", "1", "5"):  # 1: collection errors, counted; 5: none
                print(f"part {m.get('part', '?')}: pytest --collect-only rc {m['collect_rc']} (its output: tests.log)")
        for file, f in files.items():
            if f["expected"] or f["results"] or f["notes"]:
                print("\n".join(describe(file, f)))
        print(line)
    return 0 if ok else 1


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("plan", "report", "-h", "--help"):
        argv = ["report", *argv]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("report", help="per file results and the summary line of one run or several")
    r.add_argument("--json", help="save the SOURCEs' runs to this file (what device_session.sh brings back)")
    r.add_argument(
        "--planned-only",
        action="store_true",
        help="count only the tests the runs planned (the lanes of one call), not every collected one",
    )
    r.add_argument("--quiet", action="store_true", help="print nothing (with --json: just save)")
    r.add_argument("sources", nargs="+", metavar="SOURCE")
    pl = sub.add_parser("plan", help="deal the collected tests of a raw folder to one part")
    pl.add_argument("raw")
    pl.add_argument("part", help="all, or N/M")
    pl.add_argument("only", nargs="*", metavar="FILE")
    args = p.parse_args(argv)
    if args.cmd == "plan":
        m = re.fullmatch(r"(\d+)/(\d+)", args.part)
        if args.part != "all" and not (m and 1 <= int(m[1]) <= int(m[2])):
            p.error(f"part {args.part!r}: all, or N/M with 1 <= N <= M")
        return plan(Path(args.raw), args.part, args.only)
    return report(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
