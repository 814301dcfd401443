"""The NIC libraries are loaded at run time (issue 35 item 5): the native module neither links libibverbs or libefa
nor needs their symbols to load, and a machine without them imports portep, runs the shm transports, and gets an
error naming the library when it asks for verbs. Simulated here by pointing $PORTEP_LIBIBVERBS / $PORTEP_LIBEFA at a
library that does not exist."""

import json
import os
import shutil
import subprocess
import sys

import pytest

import ci_expect
from portep import _C, native

VERBS = next(t for t in native.transport_catalog() if t["name"] == "verbs")
pytestmark = ci_expect.needs("verbs", VERBS["built"], VERBS.get("reason", ""))
MISSING = "libportep-test-absent.so.1"


def _run(code, **env):
    full = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=full)


@pytest.mark.skipif(not shutil.which("readelf") or not shutil.which("nm"), reason="binutils (readelf, nm) missing")
def test_the_native_module_does_not_link_the_nic_libraries():
    needed = subprocess.run(["readelf", "-d", _C.__file__], capture_output=True, text=True, check=True).stdout
    assert "(NEEDED)" in needed, "readelf listed no dependency at all: the check below would prove nothing"
    assert "libibverbs" not in needed and "libefa" not in needed, needed
    undefined = subprocess.run(["nm", "-D", "--undefined-only", _C.__file__], capture_output=True, text=True).stdout
    assert undefined.strip(), "nm listed no undefined symbol at all: the check below would prove nothing"
    nic = [line for line in undefined.splitlines() if " ibv_" in line or " efadv_" in line]
    assert not nic, f"{_C.__file__} needs NIC symbols at load time: {nic}"


def test_without_libibverbs_portep_imports_runs_shm_and_names_the_library_for_verbs():
    code = """
import json, portep
from portep import native
kw = dict(rank=0, num_ranks=1, nbytes=4096, num_proxy_threads=1, num_fifos=1, fifo_capacity=64, num_streams=1,
          max_inflight_cmds=8, max_inflight_bytes=1 << 20, timeout_s=5.0, unordered_window=8, seed=0,
          skip_ordering=False)
ch = native.Channel(transport="shm", **kw)
ch.destroy()
try:
    native.Channel(transport="verbs", **kw)
    verbs_error = None
except RuntimeError as e:
    verbs_error = str(e)
catalog = {t["name"]: t for t in native.transport_catalog()}
print(json.dumps({"verbs_error": verbs_error, "catalog": catalog["verbs"], "libs": native.nic_libraries()}))
"""
    proc = _run(code, PORTEP_LIBIBVERBS=MISSING)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["verbs_error"] and MISSING in out["verbs_error"] and "cannot load" in out["verbs_error"], out
    assert out["catalog"]["built"] and out["catalog"]["usable"] is False and MISSING in out["catalog"]["reason"]
    assert any(line.startswith(MISSING + ": not loadable") for line in out["libs"]), out["libs"]


def test_the_doctor_names_the_missing_library():
    proc = _run("import portep.doctor as d; print(d.format_text(d.collect()))", PORTEP_LIBIBVERBS=MISSING)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"verbs          built, not usable here: cannot load {MISSING}" in proc.stdout, proc.stdout
    assert f"{MISSING}: not loadable" in proc.stdout


def test_where_libibverbs_loads_the_doctor_says_from_where():
    libs = native.nic_libraries()
    assert len(libs) == 2
    if "not loadable" in libs[0]:
        pytest.skip(f"libibverbs does not load on this machine: {libs[0]}")
    name, path = libs[0].split(": ", 1)
    assert name == "libibverbs.so.1" and os.path.isfile(path), libs


def test_without_libefa_verbs_still_loads():
    proc = _run("from portep import native; print(native.nic_libraries())", PORTEP_LIBEFA=MISSING)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert MISSING in proc.stdout and "not loadable" in proc.stdout
