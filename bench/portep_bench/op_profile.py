"""Where one call's time goes, by torch operation: the torch profiler around one call (after one untimed), each
aten operation's own time summed over its calls: the GPU's (its kernels) where there is one, and the CPU's (on a
GPU: launching and waiting). Used by gpu-ep to show what V2's layer costs on top of V1's kernels."""

import torch

from .report import Table


def op_times(fn, device):
    """[(operation, own device us, own CPU us, calls)] of one fn() on `device` ("cuda" or "cpu"; on the CPU the
    device time is the CPU's), the largest device time first; the last entry, "all operations", sums them."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    fn()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if not e.key.startswith("aten::"):
            continue
        cpu = float(e.self_cpu_time_total)
        dev = float(getattr(e, "self_device_time_total", 0.0)) if cuda else cpu
        rows.append((e.key, dev, cpu, int(e.count)))
    rows.sort(key=lambda r: (-r[1], -r[2]))
    rows.append(("all operations", sum(r[1] for r in rows), sum(r[2] for r in rows), sum(r[3] for r in rows)))
    return rows


def op_table(title, calls, device, top=12):
    """One table of op_times for each (label, fn) of `calls`: its `top` operations and the total."""
    where = "GPU kernel time" if device == "cuda" else "CPU time"
    t = Table(
        title,
        "us",
        f"torch profiler around one call after an untimed one: each aten operation's own {where} (the samples), "
        f"summed over its calls in that one call, with its own CPU time and its calls; the {top} largest per call, "
        "then all aten operations together.",
        extra_columns=("CPU us", "calls"),
    )
    for label, fn in calls:
        rows = op_times(fn, device)
        for name, dev, cpu, count in rows[:top] + rows[-1:]:
            t.add(f"{label}: {name}", [dev], extra={"CPU us": f"{cpu:.1f}", "calls": str(count)})
    return t
