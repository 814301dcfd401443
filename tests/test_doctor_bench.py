"""The two command-line entry points: doctor's report and a short channel benchmark run."""

import json
import subprocess
import sys


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
