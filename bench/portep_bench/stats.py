"""Small statistics and table helpers shared by the benchmarks."""


def median(values):
    v = sorted(values)
    n = len(v)
    if n == 0:
        raise ValueError("median of no values")
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def percentile(values, q):
    v = sorted(values)
    if not v:
        raise ValueError("percentile of no values")
    k = min(len(v) - 1, max(0, int(round(q / 100.0 * (len(v) - 1)))))
    return v[k]


def spread(values):
    """n, min, median, mean and max of the samples."""
    if not values:
        raise ValueError("spread of no values")
    return {
        "n": len(values),
        "min": min(values),
        "median": median(values),
        "mean": sum(values) / len(values),
        "max": max(values),
    }


def figure(value):
    """A measured value with 3-4 significant digits, never in exponent form."""
    size = abs(value)
    return f"{value:.1f}" if size >= 100 else f"{value:.2f}" if size >= 1 else f"{value:.3f}"


def table(headers, rows):
    """A Markdown table: the first column (what each row is) aligned left, the figures right."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row):
        return (
            "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) + " |"
        )

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])
