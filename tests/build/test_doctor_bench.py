"""The two command-line entry points: doctor's report, and the benchmarks (python -m portep_bench) at tiny shapes:
progress on stderr, tables of min / median / mean / max with the same run's baseline, the backend's note, --json,
--plot, and options alone going to this machine's default mode."""

import json
import os
import re
import subprocess
import sys
import types

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


def test_doctor_lists_the_deepep_apis_served():
    proc = run_module("portep.doctor", "--json")
    assert proc.returncode == 0, proc.stderr
    apis = json.loads(proc.stdout)["apis"]
    assert apis["V1"] == "deep_ep.Buffer, from portep.buffer"
    assert apis["V2"] == "deep_ep.ElasticBuffer, from portep.elastic.buffer"
    assert apis["HybridEP"].startswith("not served: deep_ep.hybrid_ep_buffer.HybridEPBuffer cannot be imported")
    text = run_module("portep.doctor").stdout
    assert "DeepEP APIs (import deep_ep):" in text and "V1       deep_ep.Buffer, from portep.buffer" in text


def test_doctor_text_mentions_every_transport():
    proc = run_module("portep.doctor")
    assert proc.returncode == 0, proc.stderr
    for name in ("shm", "shm-unordered", "verbs", "nccl"):
        assert name in proc.stdout


def test_a_missing_nvidia_driver_is_named_as_such():
    from portep.doctor import gpu_error_text

    cuda_says = "CUDA driver version is insufficient for CUDA runtime version"
    assert gpu_error_text(cuda_says, "cuda", driver_loads=False).startswith("no NVIDIA driver / no GPU found")
    assert gpu_error_text(cuda_says, "cuda", driver_loads=True) == cuda_says  # a driver too old: CUDA's words
    assert (
        gpu_error_text("no ROCm-capable device is detected", "hip", driver_loads=False)
        == "no ROCm-capable device is detected"
    )
    assert gpu_error_text("", "cuda", driver_loads=False) == ""


def test_the_doctor_names_a_missing_driver_on_a_machine_without_one():
    import ctypes

    from portep import native

    try:
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("this machine has an NVIDIA driver (libcuda.so.1 loads)")
    except OSError:
        pass
    if native.build_info()["gpu_runtime"] != "cuda":
        pytest.skip("not a CUDA build: the doctor reports the GPU runtime's own words")
    proc = run_module("portep.doctor")
    assert "GPUs:       0 (no NVIDIA driver / no GPU found" in proc.stdout, proc.stdout


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
    code = (
        "import sys; sys.modules['numpy'] = None\n"
        "from portep.bootstrap import all_gather_objects\n"
        "try:\n    all_gather_objects(1, None)\nexcept RuntimeError as e:\n    print(e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "needs numpy" in proc.stdout and "pip install numpy" in proc.stdout, proc.stdout + proc.stderr


TINY_EP = ["--ranks", "2", "--ht-tokens", "128", "--ll-tokens", "8", "--hidden", "512", "--iterations", "3"]


def table_rows(stdout, title_start):
    """{first cell: {column: cell}} of the table printed under the title that starts with title_start."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("## " + title_start))
    body = []
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            body.append([c.strip() for c in line.strip("|").split("|")])
        elif body:
            break
    header = body[0]
    return {row[0]: dict(zip(header, row)) for row in body[2:]}


def printed_equals(cell, value):
    """The printed figure is value rounded to the cell's decimals."""
    decimals = len(cell.split(".")[1]) if "." in cell else 0
    return abs(float(cell) - value) <= 0.5 * 10**-decimals + 1e-12


def median(values):
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def test_help_lists_the_modes_and_shows_every_default():
    from portep_bench.__main__ import build_parser, default_modes

    top = run_module("portep_bench", "--help")
    assert top.returncode == 0, top.stderr
    for mode in (
        "ep",
        "channel",
        "gpu-fifo",
        "gpu-ll",
        "gpu-ht",
        "gpu",
        "gpu-ht-loopback",
        "gpu-ht-nodes",
        "gpu-ep",
        "ll-host",
    ):
        assert re.search(rf"^\s+{re.escape(mode)}\b", top.stdout, re.M), mode
    assert f"default here: {' then '.join(default_modes())}" in " ".join(top.stdout.split())
    ep_help = build_parser()[1]["ep"].format_help()
    text = " ".join(ep_help.split())
    for option, default in (
        ("--ht-tokens", 4096),
        ("--hidden", 7168),
        ("--iterations", 10),
        ("--warmup", 1),
        ("--transport", "shm"),
        ("--ll-experts", 288),
    ):
        assert re.search(rf"{option} \S+ (?:(?!\(default).)*\(default: {default}\)", text), (option, ep_help)
    assert text.count("(default:") == len(re.findall(r"^\s+--", ep_help, re.M)), ep_help  # every option


def test_ep_benchmark_reports_spread_baseline_note_progress_and_json(tmp_path):
    from portep_bench.__main__ import default_modes

    if default_modes() != ("ep",):
        pytest.skip(f"the default mode here is {default_modes()}, not ep: options alone go there")
    path = tmp_path / "ep.json"
    proc = run_module("portep_bench", *TINY_EP, "--json", str(path), timeout=240)  # no mode: the default, ep
    assert proc.returncode == 0, proc.stdout + proc.stderr
    progress = re.findall(r"^\[portep_bench \d+\.\ds\] (.*)$", proc.stderr, re.M)
    assert "ep: HT dispatch BF16, warm-up" in progress and "ep: HT dispatch BF16, iteration 3/3" in progress, progress
    assert "a CPU emulation of the protocols over shared memory, not GPU speed" in proc.stdout
    rows = table_rows(proc.stdout, "ep: host backend, 2 ranks")
    baseline = "baseline: gloo all_to_all_single + pack, HT BF16 rows"
    assert set(rows) == {
        "get_dispatch_layout",
        "HT dispatch BF16",
        baseline,
        "HT dispatch FP8",
        "HT combine BF16",
        "LL dispatch FP8",
        "LL dispatch + combine",
        "V2 ElasticBuffer dispatch BF16",
        "V2 ElasticBuffer cached dispatch BF16",
        "V2 ElasticBuffer combine BF16 (weights back)",
    }, rows
    report = json.loads(path.read_text())
    assert report["modes"] == ["ep"] and "--ranks 2" in report["command"]
    assert set(report["machine"]) == {"cpu_count", "load_average_1min", "python", "torch", "gpus", "portep"}
    assert report["machine"]["cpu_count"] == os.cpu_count()
    table, memory = report["tables"]
    assert "not GPU speed" in table["note"] and table["unit"] == "ms"
    assert memory["unit"] == "MiB" and "Computed, not measured" in memory["note"]
    mib = {s["what"]: s["samples"] for s in memory["samples"]}
    assert len(mib) == 12 and all(len(v) == 1 and v[0] > 0 for v in mib.values()), mib
    for ranks in (8, 16, 32, 64):  # V2 on the CUDA backend takes no more than V1, rounded up to 2 MiB
        v1 = mib[f"{ranks} ranks: V1 Buffer (DeepEP's hints)"][0]
        assert v1 <= mib[f"{ranks} ranks: V2 ElasticBuffer, CUDA backend"][0] < v1 + 2
    for sample in table["samples"]:
        printed = rows[sample["what"]]
        assert printed["n"] == "3" and len(sample["samples"]) == 3
        assert sample["baseline"] == (sample["what"] == baseline)
        assert printed_equals(printed["median ms"], median(sample["samples"])), (printed, sample)
        assert printed_equals(printed["min ms"], min(sample["samples"]))
        assert printed_equals(printed["max ms"], max(sample["samples"]))
    assert float(rows[baseline]["GB/s at median"]) > 0 and float(rows["HT dispatch BF16"]["GB/s at median"]) > 0


def test_options_alone_go_to_the_default_modes(monkeypatch):
    from portep_bench import __main__ as cli

    monkeypatch.setattr(cli, "default_modes", lambda: ("ep",))
    (ep,) = cli.parse(["--ranks", "2"])
    assert (ep.mode, ep.ranks, ep.iterations) == ("ep", 2, 10)
    (channel,) = cli.parse(["channel", "--ranks", "2"])
    assert (channel.mode, channel.ranks) == ("channel", 2)
    monkeypatch.setattr(cli, "default_modes", lambda: ("gpu-ht-loopback", "ll-host"))
    loopback, ll_host = cli.parse(["--iterations", "7", "--calls", "9", "--json", "x.json"])
    assert (loopback.mode, loopback.iterations, loopback.json) == ("gpu-ht-loopback", 7, "x.json")
    assert (ll_host.mode, ll_host.calls, ll_host.json) == ("ll-host", 9, "x.json")
    with pytest.raises(SystemExit):
        cli.parse(["--ranks", "2"])  # neither default mode here takes it


def test_modes_with_ranks_as_threads_ask_cuda_for_32_hardware_queues(monkeypatch):
    import torch

    from portep_bench import __main__ as cli

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # as before any mode ran

    var = "CUDA_DEVICE_MAX_CONNECTIONS"
    monkeypatch.delenv(var, raising=False)
    cli.widen_hardware_queues(["ll-host", "gpu-ep", "ep"])
    assert var not in os.environ  # one rank a process: the A/B of ll-host runs as before
    cli.widen_hardware_queues(["ll-host", "gpu-ht-nodes"])
    assert os.environ[var] == "32"
    monkeypatch.setenv(var, "8")
    cli.widen_hardware_queues(["gpu-ht-loopback"])
    assert os.environ[var] == "8"  # the caller's choice stays


def fake_ll_host_time(monkeypatch, measure):
    import portep_bench

    module = types.ModuleType("portep_bench.ll_host_time")
    module.measure = measure
    monkeypatch.setitem(sys.modules, "portep_bench.ll_host_time", module)
    monkeypatch.setattr(portep_bench, "ll_host_time", module, raising=False)


def test_ll_host_table_has_median_mean_and_the_baseline(monkeypatch, capsys, tmp_path):
    from portep_bench import __main__ as cli

    asked = []

    def measure(calls=1000, progress=print, profile_calls=0):
        asked.append((calls, profile_calls))
        progress("ll-host: timing")
        return {
            "rows": [
                {"what": "Buffer LL round trip", "samples_us": [40.0, 38.0, 90.0, 41.0]},
                {"what": "baseline: six torch.empty", "samples_us": [12.0, 13.0, 11.0, 30.0]},
            ],
            "note": "host time of each call on one GPU",
            "profile": f"cProfile of {profile_calls} round trips" if profile_calls else "",
        }

    fake_ll_host_time(monkeypatch, measure)
    path = tmp_path / "ll.json"
    assert cli.main(["ll-host", "--calls", "4", "--json", str(path)]) == 0
    out, err = capsys.readouterr()
    assert asked == [(4, 0)] and "] ll-host: timing" in err and "cProfile" not in out
    assert cli.main(["ll-host", "--calls", "4", "--profile", "7"]) == 0
    assert asked[1] == (4, 7) and "cProfile of 7 round trips" in capsys.readouterr().out
    rows = table_rows(out, "ll-host")
    assert rows["Buffer LL round trip"]["median us"] == "40.50" and rows["Buffer LL round trip"]["mean us"] == "52.25"
    assert rows["baseline: six torch.empty"]["min us"] == "11.00" and rows["baseline: six torch.empty"]["n"] == "4"
    (table,) = json.loads(path.read_text())["tables"]
    assert table["note"] == "host time of each call on one GPU"
    assert [s["baseline"] for s in table["samples"]] == [False, True]


def test_ll_host_without_a_gpu_prints_the_reason_and_fails(monkeypatch, capsys):
    from portep_bench import __main__ as cli

    def measure(calls=1000, progress=print, profile_calls=0):
        raise RuntimeError("ll-host needs a CUDA GPU; here: none visible")

    fake_ll_host_time(monkeypatch, measure)
    assert cli.main(["ll-host"]) != 0
    assert "portep_bench ll-host: ll-host needs a CUDA GPU; here: none visible" in capsys.readouterr().err


def test_plots_without_matplotlib_say_how_to_get_them_and_json_is_still_written(monkeypatch, capsys, tmp_path):
    from portep_bench import __main__ as cli
    from portep_bench import plot

    fake_ll_host_time(
        monkeypatch,
        lambda calls, progress, profile_calls: {
            "rows": [{"what": "baseline: x", "samples_us": [1.0]}],
            "note": "n",
            "profile": "",
        },
    )
    monkeypatch.setattr(plot, "available", lambda: False)
    assert cli.main(["ll-host", "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "plots")]) == 0
    err = capsys.readouterr().err
    assert "pip install 'portep[plot]'" in err and "pip install matplotlib" in err
    assert json.loads((tmp_path / "r.json").read_text())["tables"] and not (tmp_path / "plots").exists()


def test_plots_are_one_png_per_table(tmp_path):
    pytest.importorskip("matplotlib")
    from portep_bench import plot
    from portep_bench.report import Table

    tables = [Table("first", "us", "n"), Table("second: rates", "M cmd/s", "n")]
    for t in tables:
        t.add("portep", [3.0, 4.0, 5.0])
        t.add("baseline: other", [6.0, 7.0])
    paths = plot.write(tables, str(tmp_path))
    assert [os.path.basename(p) for p in paths] == ["01-first.png", "02-second-rates.png"]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_channel_benchmark_prints_rates_latencies_and_baselines():
    proc = run_module(
        "portep_bench",
        "channel",
        "--ranks",
        "2",
        "--messages",
        "2000",
        "--iterations",
        "200",
        "--proxy-threads",
        "2",
        "--producers",
        "2",
        "--transport",
        "shm",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "not GPU speed" in proc.stdout and "] channel shm: baseline, the FIFO alone" in proc.stderr
    rates = table_rows(proc.stdout, "channel: command rate")
    assert set(rates) == {"shm, per process", "baseline: FIFO alone (shm run)"}, rates
    assert rates["shm, per process"]["n"] == "2" and rates["baseline: FIFO alone (shm run)"]["n"] == "3"
    latency = table_rows(proc.stdout, "channel: write+signal round trip")
    assert set(latency) == {
        "shm, 8 B",
        "shm, 4096 B",
        "baseline: gloo send/recv, 8 B (shm run)",
        "baseline: gloo send/recv, 4096 B (shm run)",
    }, latency
    for row in list(rates.values()) + list(latency.values()):
        figures = [float(v) for k, v in row.items() if k.split()[0] in ("min", "median", "mean", "max", "p99")]
        assert len(figures) >= 4 and all(f > 0 for f in figures), row
    assert all(row["n"] == "200" for row in latency.values())


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


@pytest.mark.parametrize(
    "cuda_built,available,count,modes",
    [
        (True, True, 2, ("gpu",)),
        (True, True, 8, ("gpu",)),
        (True, True, 1, ("gpu-ht-loopback", "gpu-ht-nodes", "gpu-ep", "ll-host")),
        (True, False, 0, ("ep",)),
        (False, True, 2, ("ep",)),
    ],
)
def test_main_benchmark_picks_the_best_backend_here(monkeypatch, cuda_built, available, count, modes):
    import torch

    from portep import native
    from portep_bench.__main__ import default_modes

    monkeypatch.setattr(native, "build_info", lambda: {"gpu_built": cuda_built})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    assert default_modes() == modes


@pytest.mark.parametrize(
    "args,reason",
    [
        (["gpu-ht-loopback", "--sms", "8"], "gpu-ht-loopback needs a CUDA GPU"),
        (["ll-host", "--calls", "5"], "ll-host needs a GPU"),
        (["gpu-ep", "--iterations", "3"], "gpu-ep needs a GPU"),
    ],
)
def test_gpu_benchmarks_without_a_gpu_say_what_they_need(args, reason):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the benchmark would run")
    r = run_module("portep_bench", *args)
    assert r.returncode != 0
    assert f"portep_bench {args[0]}: {reason}" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]


def test_ll_host_profile_runs_each_batch_behind_its_own_hold():
    """ll_host_time._profile: every call profiled, in batches of BATCH each behind a GPU sleep, and batches whose
    hold had ended by their last call counted in the report (a stand-in for torch.cuda)."""
    from portep_bench import ll_host_time

    log = []

    class Event:
        def record(self):
            log.append("record")

        def query(self):
            return log.count("sleep") == 1  # the first batch's hold ends early

    cuda = types.SimpleNamespace(
        synchronize=lambda: log.append("sync"), _sleep=lambda cycles: log.append("sleep"), Event=Event
    )
    calls = []
    report = ll_host_time._profile(lambda: calls.append(1), 250, types.SimpleNamespace(cuda=cuda))
    assert len(calls) == 250 and log.count("sleep") == 3 and log.count("record") == 3
    assert "cProfile of 250 round trips through the full Python path; in 1 of 3 batches" in report
    assert "<lambda>" in report
