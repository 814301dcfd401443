"""Python passes tensors to native code, never addresses (issue 35 item 1): no `data_ptr()` (nor a native method
handing out an address, `device_data_ptr()`, `peer_data_ptr(d)`, ...) in python/portep outside the CUDA backend's
files listed here, whose kernels still take some addresses from Python (engine.py: the Channel's region as a tensor
and the peers' addresses in the kernels' tables; ht.py: the normal-mode kernels), so that the list can only
shrink."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2] / "python" / "portep"
STILL_ADDRESSED = {"backends/cuda/engine.py", "backends/cuda/ht.py"}  # the CUDA kernels' arguments
ADDRESS = re.compile(r"\.\w*_ptr\(")


def _offenders():
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        lines = [i + 1 for i, line in enumerate(path.read_text().splitlines()) if ADDRESS.search(line)]
        if lines:
            found[rel] = lines
    return found


def test_no_addresses_cross_into_native_code_outside_the_cuda_backend():
    found = _offenders()
    outside = {f: lines for f, lines in found.items() if f not in STILL_ADDRESSED}
    assert not outside, f"data_ptr() passed to native code (pass the tensor; the native side checks it): {outside}"


def test_the_list_of_addressed_files_is_current():
    found = _offenders()
    stale = sorted(STILL_ADDRESSED - set(found))
    assert not stale, f"{stale} no longer pass addresses: drop them from STILL_ADDRESSED"


def test_the_scan_finds_an_address(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("native.copy_rows(dst.data_ptr(), 0)\n")
    assert ADDRESS.search(planted.read_text())
