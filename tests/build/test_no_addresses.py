"""Python passes tensors to native code, never addresses (issue 35 item 1): no `data_ptr()` (nor a native method
handing out an address, `device_data_ptr()`, `peer_data_ptr(d)`, ...) in python/portep outside the CUDA backend's
files listed here, each with the number of lines that still do, so that the list and the counts can only shrink
(engine.py: the Channel's region as a tensor, the peers' regions in the LL kernels' tables, the LL flags' view).
The normal-mode kernels (ht.py) take tensors and the Channel itself."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2] / "python" / "portep"
STILL_ADDRESSED = {"backends/cuda/engine.py": 5}  # file: lines
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
    found = {f: len(lines) for f, lines in _offenders().items() if f in STILL_ADDRESSED}
    assert found == STILL_ADDRESSED, f"lines passing addresses now {found}, listed {STILL_ADDRESSED}: lower the list"


def test_the_scan_finds_an_address(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("native.copy_rows(dst.data_ptr(), 0)\n")
    assert ADDRESS.search(planted.read_text())
