"""The two command-line entry points: doctor's report and a short channel benchmark run."""

import json
import subprocess
import sys

import pytest


def run_module(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout, check=False)


def test_doctor_json_lists_backends_and_transport_properties():
    proc = run_module("portep.doctor", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["version"]
    assert "host" in report["backends"]
    shm, unordered = report["transports"]["shm"], report["transports"]["shm-unordered"]
    assert shm == {"built": True, "ordered": True, "remote_atomics": True}
    assert unordered == {"built": True, "ordered": False, "remote_atomics": False}
    for name, t in report["transports"].items():
        assert set(t) >= {"built", "ordered", "remote_atomics"}
        if not t["built"]:
            assert t["reason"], f"{name} is not built but says nothing about why"
    if "cuda" not in report["backends"]:
        assert report["backends_unavailable"]["cuda"]


def test_doctor_text_mentions_every_transport():
    proc = run_module("portep.doctor")
    assert proc.returncode == 0, proc.stderr
    for name in ("shm", "shm-unordered", "verbs", "nccl"):
        assert name in proc.stdout


NUMPY_BLOCKED = """
import sys
sys.modules["numpy"] = None  # as in a fresh venv where only torch was installed
import runpy
sys.argv = ["portep.doctor"]
runpy.run_module("portep.doctor", run_name="__main__")
"""


def test_doctor_reports_a_missing_numpy_and_fails():
    proc = subprocess.run([sys.executable, "-c", NUMPY_BLOCKED], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "PROBLEM:" in proc.stdout and "numpy cannot be imported" in proc.stdout, proc.stdout
    assert "pip install numpy" in proc.stdout


def test_doctor_says_the_run_time_dependencies_are_usable():
    proc = run_module("portep.doctor")
    assert "run time:   torch, torch.distributed (gloo) and numpy usable" in proc.stdout, proc.stdout


def test_bootstrap_names_the_missing_numpy():
    code = ("import sys; sys.modules['numpy'] = None\n"
            "from portep.bootstrap import all_gather_objects\n"
            "try:\n    all_gather_objects(1, None)\nexcept RuntimeError as e:\n    print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "needs numpy" in proc.stdout and "pip install numpy" in proc.stdout, proc.stdout + proc.stderr


def test_channel_benchmark_prints_rates_latencies_and_baselines():
    proc = run_module("portep.bench", "channel", "--ranks", "2", "--messages", "2000", "--iterations", "200",
                      "--proxy-threads", "2", "--producers", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    rate_rows = [line for line in lines if line.split("|")[1].strip() in ("shm", "shm-unordered")
                 and len(line.split("|")) == 6]
    lat_rows = [line for line in lines if len(line.split("|")) == 8 and line.split("|")[2].strip().isdigit()]
    assert len(rate_rows) == 2 and len(lat_rows) == 4, proc.stdout
    for row in rate_rows:
        cells = [c.strip() for c in row.split("|")[2:5]]
        assert all(float(c) > 0 for c in cells), row
    for row in lat_rows:
        cells = [c.strip() for c in row.split("|")[3:7]]
        assert all(float(c) > 0 for c in cells), row


def test_command_latency_upper_bound_uses_the_host_clock_alone():
    # Synthetic clocks: the GPU clock is 500 us off the host's; each command's true publish -> pop is 1.0-1.3 us,
    # and the host clock the GPU read before publishing is 0.4 us older than the publish (the read's return leg).
    import random

    from portep_bench.gpu_fifo import command_latency_lines

    rng = random.Random(3)
    n, offset = 400, 500_000
    t = {k: [] for k in ("publish_ns", "pop_ns", "release_ns", "seen_ns", "host_clock_before_ns")}
    truth = []
    for i in range(n):
        host_publish = 10_000_000 + i * 5_000
        fwd = rng.randint(1_000, 1_300)
        truth.append(fwd)
        t["host_clock_before_ns"].append(host_publish - 400)
        t["publish_ns"].append(host_publish + offset)
        t["pop_ns"].append(host_publish + fwd)
        t["release_ns"].append(host_publish + fwd + 40)
        t["seen_ns"].append(host_publish + offset + fwd + 40 + 1_000)
    t["host_read_ns"] = [1_000] * 50
    lines = command_latency_lines(t, skip=100)
    bound = [line for line in lines if "host clock alone" in line]
    assert len(bound) == 1, lines
    tail = sorted(truth[100:])  # the first `skip` commands are left out; an even count: the mean of two
    true_median = (tail[len(tail) // 2 - 1] + tail[len(tail) // 2]) / 2
    assert f"median at most {(true_median + 400) / 1e3:.2f} us" in bound[0], bound[0]


@pytest.mark.parametrize("cuda_built,available,count,mode", [
    (True, True, 2, "gpu"), (True, True, 8, "gpu"), (True, True, 1, "gpu-ht-loopback"), (True, False, 0, "ep"),
    (False, True, 2, "ep")])
def test_main_benchmark_picks_the_best_backend_here(monkeypatch, cuda_built, available, count, mode):
    import torch

    from portep import bench, native

    monkeypatch.setattr(native, "build_info", lambda: {"gpu_built": cuda_built})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    assert bench._best_mode() == mode


def test_loopback_benchmark_without_a_gpu_says_what_it_needs():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the benchmark would run")
    r = run_module("portep.bench", "gpu-ht-loopback", "--sms", "8")
    assert r.returncode != 0
    assert "gpu-ht-loopback needs a CUDA GPU and portep's CUDA kernels" in r.stderr, r.stderr[-2000:]
