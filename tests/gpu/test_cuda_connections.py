"""With PORTEP_GPU_PROXY_COPIES=1 (the GPU proxy path's bytes copied by the proxies on the copy engines) portep asks
CUDA for its most hardware queues at import (those copies must not share one with the LL kernels' stream; see
portep/config.py), keeps an application's own choice, and refuses or warns where the choice makes the copies wait
behind the kernels. Without it (the kernels store the bytes, the proxies make no CUDA call) portep leaves CUDA's
queues alone."""

import os
import subprocess
import sys

import pytest

PROBE = """
import os, warnings
import portep.config as c
print(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), c.CUDA_CONNECTIONS_NOTE is None)
try:
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        c.check_gpu_copy_connections("the proxy path")
    print("warned" if w else "quiet")
except ValueError as e:
    print("raised", "CUDA_DEVICE_MAX_CONNECTIONS=1" in str(e))
"""


def _probe(value, copies=True):
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_DEVICE_MAX_CONNECTIONS", "PORTEP_GPU_PROXY_COPIES")}
    if copies:
        env["PORTEP_GPU_PROXY_COPIES"] = "1"
    if value is not None:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = value
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, ["32", "True", "quiet"]),  # unset: portep sets 32 and has nothing to say
        ("32", ["32", "False", "quiet"]),  # the application's 32: kept
        ("8", ["8", "False", "warned"]),  # fewer queues: kept, with a warning
        ("1", ["1", "False", "raised", "True"]),  # one queue: the copies surely wait behind the kernels
    ],
)
def test_import_widens_cuda_connections_unless_chosen(value, expected):
    assert _probe(value) == expected


@pytest.mark.parametrize("value", [None, "8", "1"])
def test_import_leaves_cuda_connections_alone_without_proxy_copies(value):
    assert _probe(value, copies=False)[:2] == [str(value), "False"]
