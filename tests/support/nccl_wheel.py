"""The nvidia-nccl-cu12 wheel the nccl extra installs (CI installs it): its version, for the NCCL tests; and stand-in
libraries of a chosen NCCL version and symbols, compiled here."""

import importlib.metadata
import shutil
import subprocess
from typing import Optional


def wheel_version() -> Optional[str]:
    """The installed nvidia-nccl-cu12's version ("2.32.3"), or None."""
    try:
        return importlib.metadata.version("nvidia-nccl-cu12")
    except importlib.metadata.PackageNotFoundError:
        return None


def version_code(text: str) -> int:
    """NCCL's version code of "X.Y.Z": X * 10000 + Y * 100 + Z."""
    major, minor, patch = (int(v) for v in text.split(".")[:3])
    return major * 10000 + minor * 100 + patch


# The symbols of NCCL's host one-sided API that the probe looks up (transport/nccl/nccl_library.cpp).
SYMBOLS = [
    "ncclGetUniqueId",
    "ncclCommInitRank",
    "ncclCommDestroy",
    "ncclMemAlloc",
    "ncclMemFree",
    "ncclCommWindowRegister",
    "ncclCommWindowDeregister",
    "ncclPutSignal",
    "ncclSignal",
    "ncclWaitSignal",
]


def stand_in_library(tmp_path, name, version, symbols):
    """A shared library exporting ncclGetVersion (when version is not None) and `symbols` (functions returning 0),
    compiled with the machine's C compiler into tmp_path; returns its path."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) to build the stand-in libraries")
    src = tmp_path / f"{name}.c"
    body = [f"int {s}(void) {{ return 0; }}" for s in symbols]
    if version is not None:
        body.append(f"int ncclGetVersion(int* v) {{ *v = {version}; return 0; }}")
    src.write_text("\n".join(body) + "\n")
    lib = tmp_path / f"lib{name}.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return str(lib)
