"""--plot DIR: one PNG per table, each row's median as a bar with its min..max as error bars, the same run's
baseline rows in grey next to portep's. matplotlib is an optional extra (pip install 'portep[plot]')."""

import importlib.util
import os
import re
import textwrap

from .report import TIME_UNITS

PORTEP_COLOR, BASELINE_COLOR = "#2f6db5", "#9a9a9a"
LOG_SCALE_ABOVE = 5  # a row's max / median beyond which the axis is logarithmic
HOW_TO_GET = "pip install 'portep[plot]' or pip install matplotlib"


def available():
    return importlib.util.find_spec("matplotlib") is not None


def file_name(index, title):
    slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:60]
    return f"{index:02d}-{slug}.png"


def write(tables, directory):
    """Writes the PNGs; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    paths = []
    for index, t in enumerate(tables, 1):
        path = os.path.join(directory, file_name(index, t.title))
        fig = _figure(plt, t)
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


def _figure(plt, t):
    rows = t.rows
    medians = [r.spread["median"] for r in rows]
    below = [r.spread["median"] - r.spread["min"] for r in rows]
    above = [r.spread["max"] - r.spread["median"] for r in rows]
    fig, ax = plt.subplots(figsize=(9, 1.3 + 0.42 * len(rows)))
    ax.barh(
        range(len(rows)),
        medians,
        xerr=[below, above],
        capsize=3,
        color=[BASELINE_COLOR if r.baseline else PORTEP_COLOR for r in rows],
    )
    ax.set_yticks(range(len(rows)), [textwrap.shorten(r.what, 64, placeholder="...") for r in rows], fontsize=8)
    ax.invert_yaxis()
    for y, (m, r) in enumerate(zip(medians, rows)):
        ax.annotate(
            f"{m:.4g} (n={r.spread['n']})",
            (r.spread["max"], y),
            xytext=(5, 0),
            textcoords="offset points",
            va="center",
            fontsize=7,
        )
    scale = _scale_axis(ax, rows)
    better = "lower" if t.unit in TIME_UNITS else "higher"
    ax.set_xlabel(
        f"{t.unit} ({better} is better{scale}): median, error bars min..max; grey: the baseline, same run", fontsize=8
    )
    what_it_measures = t.note.split(". ")[0]  # the note's first sentence names the backend and what it stands for
    ax.set_title(textwrap.fill(t.title, 90) + "\n" + textwrap.fill(what_it_measures, 110), fontsize=8)
    fig.tight_layout()
    return fig


def _scale_axis(ax, rows):
    """A logarithmic axis where outliers would squeeze the medians of a linear one into its first pixels."""
    low, high = min(r.spread["min"] for r in rows), max(r.spread["max"] for r in rows)
    if low > 0 and max(r.spread["max"] / r.spread["median"] for r in rows) > LOG_SCALE_ABOVE:
        ax.set_xscale("log")
        ax.set_xlim(low / 2, high * 4)
        return ", log scale"
    ax.set_xlim(0, high * 1.25)
    return ""
