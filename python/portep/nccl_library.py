"""The NCCL library portep finds at run time (torch-free): the one this process already loaded (torch's), else
$PORTEP_LIBNCCL, else an nvidia-nccl-cu12 / -cu13 wheel's, else libnccl.so.2 from the loader's search path; its
version and whether it has the host one-sided API (ncclPutSignal, NCCL >= 2.29.2) the nccl transport is to be built
on (transport/nccl/nccl_library.h). The doctor reports it; transport='nccl' loads it (Channel passes the wheels'
libraries it finds) and refuses naming it where it lacks that API."""

import os
import sys
from typing import Dict, List

WHEEL_LIBRARY = os.path.join("nvidia", "nccl", "lib", "libnccl.so.2")  # both wheels' layout


def wheel_candidates() -> List[str]:
    """libnccl.so.2 of an installed nvidia-nccl wheel, for each sys.path entry that has one."""
    found = []
    for entry in sys.path:
        path = os.path.join(entry or ".", WHEEL_LIBRARY)
        if os.path.isfile(path) and path not in found:
            found.append(path)
    return found


def probe() -> Dict[str, object]:
    """What native.nccl_probe says (keys: loaded, path, version, version_text, missing, error, host_rma,
    summary); {"loaded": False, "summary": why} without the native module."""
    from ._native import native, native_error

    if native is None:
        return {"loaded": False, "host_rma": False, "summary": f"portep's native module did not load: {native_error}"}
    return dict(native.nccl_probe(wheel_candidates()))
