"""The NCCL probe (transport/nccl/nccl_library.h, portep.nccl_library): it reads the version and the host one-sided
API of a real libnccl (the nvidia-nccl-cu12 wheel's; ncclGetVersion needs no GPU) and of stand-in libraries compiled
here (an NCCL 2.28.9 without ncclPutSignal, a 2.32.3 with every symbol, one without ncclGetVersion)."""

import subprocess
import sys


from ci_expect import require_or_skip
from nccl_wheel import SYMBOLS, stand_in_library, version_code, wheel_version
from portep import nccl_library
from portep._native import native


def _probe_in_subprocess(env_path):
    """native.nccl_probe([]) with $PORTEP_LIBNCCL=env_path, in a fresh process (the probe loads once per process)."""
    code = "import json, portep; print(json.dumps(portep.native.nccl_probe([])))"
    env = {"PORTEP_LIBNCCL": env_path}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**_env(), **env}, check=True
    )
    import json

    return json.loads(out.stdout.strip().splitlines()[-1])


def _env():
    import os

    return dict(os.environ)


def test_an_old_nccl_is_named_with_the_version_it_needs(tmp_path):
    lib = stand_in_library(tmp_path, "nccl_old", 22809, [s for s in SYMBOLS if "Signal" not in s])
    p = _probe_in_subprocess(lib)
    assert p["loaded"] and p["version"] == 22809 and p["version_text"] == "2.28.9"
    assert not p["host_rma"]
    assert p["missing"] == ["ncclPutSignal", "ncclSignal", "ncclWaitSignal"]
    assert "NCCL 2.28.9 at" in p["summary"] and "older than 2.29.2" in p["summary"]
    assert "needs NCCL >= 2.29.2" in p["summary"] and "ncclPutSignal" in p["summary"]


def test_a_new_nccl_with_every_symbol_has_the_host_api(tmp_path):
    p = _probe_in_subprocess(stand_in_library(tmp_path, "nccl_new", 23203, SYMBOLS))
    assert p["loaded"] and p["version_text"] == "2.32.3" and p["missing"] == [] and p["host_rma"]
    assert p["summary"].endswith("host one-sided API present")


def test_a_library_without_nccl_get_version_is_reported(tmp_path):
    p = _probe_in_subprocess(stand_in_library(tmp_path, "not_nccl", None, SYMBOLS))
    assert p["loaded"] and not p["host_rma"] and "has no ncclGetVersion" in p["error"]


def test_a_missing_library_names_the_path(tmp_path):
    missing = str(tmp_path / "libnope.so.2")
    p = _probe_in_subprocess(missing)
    assert not p["loaded"] and missing in p["error"] and "$PORTEP_LIBNCCL" in p["error"]


def test_the_wheels_nccl_is_found_and_read(monkeypatch):
    version = wheel_version()
    require_or_skip(
        "nccl", version is not None and nccl_library.wheel_candidates(), "nvidia-nccl-cu12 is not installed"
    )
    monkeypatch.delenv("PORTEP_LIBNCCL", raising=False)
    p = nccl_library.probe()
    assert p["loaded"], p
    assert p["version"] == version_code(version)
    assert p["host_rma"] == (p["version"] >= 22902), p
    assert p["path"].endswith("libnccl.so.2")


def test_transport_nccl_is_a_transport_name_and_in_the_catalog(monkeypatch):
    """'nccl' is chosen like any transport (its refusals come from the native layer: test_nccl_transport.py)."""
    from portep.config import transport_from_env

    assert transport_from_env("nccl") == "nccl"
    monkeypatch.setenv("PORTEP_TRANSPORT", "nccl")
    assert transport_from_env() == "nccl"
    catalog = {t["name"]: t for t in native.transport_catalog()}
    cuda = native.build_info()["gpu_runtime"] == "cuda"
    assert catalog["nccl"]["built"] == cuda, catalog["nccl"]
    assert catalog["nccl"]["ordered"] and not catalog["nccl"]["remote_atomics"]
    assert catalog["nccl-emulated"]["built"] and catalog["nccl-emulated"].get("usable", True)
    assert "emulation" in catalog["nccl-emulated"]["note"] and "2.29.2" in catalog["nccl"]["note"]
