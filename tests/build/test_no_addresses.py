"""Python passes tensors to native code, never addresses it computed (issue 35 item 1): no `data_ptr()` (nor a native
method handing out an address, `device_data_ptr()`, `peer_data_ptr(d)`, ...) anywhere in python/portep. The kernels
take tensors and the native Channel, which writes the peers' regions into the kernels' tables itself
(`cuda_peer_table`) and hands its region to torch as a lease (`__cuda_array_interface__`); the mapped host words
(kernel error records, the peer watch's status, the normal mode's count record) are native MappedHost objects that
the bindings take whole (tests/unit/test_mapped_host.py)."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2] / "python" / "portep"
ADDRESS = re.compile(r"\.\w*_ptr\(")


def test_no_addresses_cross_into_native_code():
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        lines = [i + 1 for i, line in enumerate(path.read_text().splitlines()) if ADDRESS.search(line)]
        if lines:
            found[path.relative_to(ROOT).as_posix()] = lines
    assert not found, f"addresses passed to native code (pass the tensor; the native side checks it): {found}"


def test_the_scan_finds_an_address(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("native.copy_rows(dst.data_ptr(), 0)\nx = ch.peer_data_ptr(3)\n")
    assert len(ADDRESS.findall(planted.read_text())) == 2
