"""What every benchmark prints and saves: progress lines on stderr, tables of sample sets (n, min, median, mean,
max, the same run's baseline among the rows), a note saying what the backend measures, and the whole run as JSON
(tables, raw samples, machine facts) for --json."""

import json
import os
import platform
import sys
import textwrap
import time

from .stats import figure, percentile, spread, table

TIME_UNITS = {"ms": 1e-3, "us": 1e-6}


class MissingHardware(RuntimeError):
    """This machine lacks what the benchmark needs (a GPU, two GPUs, the CUDA kernels); the message says what."""


class Progress:
    """Prints '[portep_bench 12.3s] what' on stderr. Picklable: spawned ranks report on the same clock."""

    def __init__(self):
        self.t0 = time.time()

    def __call__(self, what):
        print(f"[portep_bench {time.time() - self.t0:.1f}s] {what}", file=sys.stderr, flush=True)


class Row:
    def __init__(self, what, samples, nbytes=None, extra=None):
        if not samples:
            raise ValueError(f"{what}: no samples")
        self.what, self.samples, self.nbytes, self.extra = what, [float(s) for s in samples], nbytes, extra or {}
        self.spread = spread(self.samples)

    @property
    def baseline(self):
        return self.what.startswith("baseline")


class Table:
    """Rows of samples in one unit. A row whose label starts with 'baseline' is the reference measured in the same
    run. nbytes (DeepEP's byte counting) gives a GB/s column at the median; extra_columns are named per row."""

    def __init__(self, title, unit, note, extra_columns=(), p99=False):
        self.title, self.unit, self.note = title, unit, note
        self.extra_columns, self.p99 = tuple(extra_columns), p99
        self.rows, self.lines = [], []

    def add(self, what, samples, nbytes=None, extra=None):
        self.rows.append(Row(what, samples, nbytes, extra))

    def line(self, text):
        """A figure that is not a sample set (a bound, a quoted reference), printed under the table."""
        self.lines.append(text)

    def columns(self):
        u = self.unit
        cols = ["what", "n", f"min {u}", f"median {u}", f"mean {u}", f"max {u}"] + (["p99 " + u] if self.p99 else [])
        if any(r.nbytes for r in self.rows):
            cols.append("GB/s at median")
        return cols + list(self.extra_columns)

    def cells(self):
        gbs = any(r.nbytes for r in self.rows)
        out = []
        for r in self.rows:
            s = r.spread
            row = [r.what, s["n"]] + [figure(s[k]) for k in ("min", "median", "mean", "max")]
            if self.p99:
                row.append(figure(percentile(r.samples, 99)))
            if gbs:
                row.append(figure(r.nbytes / (s["median"] * TIME_UNITS[self.unit]) / 1e9) if r.nbytes else "-")
            out.append(row + [r.extra.get(c, "-") for c in self.extra_columns])
        return out

    def text(self):
        note = textwrap.fill(self.note, 120, initial_indent="note: ", subsequent_indent="  ")
        return "\n".join([f"## {self.title}", note, "", table(self.columns(), self.cells())] + self.lines)

    def as_json(self):
        return {
            "title": self.title,
            "unit": self.unit,
            "note": self.note,
            "columns": self.columns(),
            "rows": [[str(c) for c in row] for row in self.cells()],
            "lines": self.lines,
            "samples": [
                {
                    "what": r.what,
                    "baseline": r.baseline,
                    "samples": r.samples,
                    "nbytes": r.nbytes,
                    "extra": {k: str(v) for k, v in r.extra.items()},
                }
                for r in self.rows
            ],
        }


def machine_facts():
    """Hostname-free facts that bear on the figures."""
    import torch

    import portep

    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    )
    return {
        "cpu_count": os.cpu_count(),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpus": gpus,
        "portep": portep.__version__,
    }


class Report:
    """The run's tables, printed as they come (stdout) and kept for --json and --plot."""

    def __init__(self, command, modes, progress):
        self.command, self.modes, self.progress = command, modes, progress
        self.machine = machine_facts()
        self.tables, self.lines = [], []

    def say(self, text):
        """A line about the whole run (stdout, and the JSON's 'lines')."""
        self.lines.append(text)
        print(text, flush=True)

    def add(self, t):
        self.tables.append(t)
        print("\n" + t.text() + "\n", flush=True)

    def machine_line(self):
        m = self.machine
        gpus = ", ".join(m["gpus"]) or "no GPU"
        return (
            f"machine: {m['cpu_count']} CPUs (load average {m['load_average_1min']} at the start: other work on "
            f"this machine slows the figures), {gpus}; torch {m['torch']}, portep {m['portep']}"
        )

    def as_json(self):
        return {
            "command": self.command,
            "modes": self.modes,
            "machine": self.machine,
            "lines": self.lines,
            "tables": [t.as_json() for t in self.tables],
        }

    def write_json(self, path):
        with open(path, "w") as f:
            json.dump(self.as_json(), f, indent=1)
