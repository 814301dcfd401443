"""The NCCL device path without a GPU (gpu_kernels/nccl/nccl_lsa.h, portep.nccl_device): which NCCL release's device
headers the build carries (a CUDA build where an nvidia-nccl wheel is installed; none in a HIP build, saying why), the
release check every rank makes before any collective step, a real ncclUniqueId from the wheel's library, the native
object's refusals of bad arguments and of a machine without a GPU, and the collective refusal: every rank raises,
naming each rank that cannot run the path. The path itself runs on a GPU: tests/gpu/test_gpu_nccl_device.py."""

import os
import shutil
import subprocess
import sys

import pytest

from ci_expect import require_or_skip
from dist_util import run_ranks
from nccl_wheel import version_code, wheel_version
from portep import nccl_library
from portep._native import native

INFO = native.build_info()


def test_the_build_says_which_nccl_headers_it_carries_or_why_none():
    runtime = INFO["gpu_runtime"]
    if runtime == "cuda":
        require_or_skip("nccl", wheel_version() is not None, "nvidia-nccl-cu12 is not installed")
        # the CUDA build found the installed wheel's device headers (cmake/portep_nccl.cmake)
        assert INFO["nccl_device_headers"] == version_code(wheel_version()), INFO["nccl_device_reason"]
        assert INFO["nccl_device_reason"] == ""
    else:
        assert INFO["nccl_device_headers"] == 0
        want = "a hip build" if runtime == "hip" else "no GPU kernels in this build"
        assert want in INFO["nccl_device_reason"], INFO["nccl_device_reason"]


def _text(code):
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


def test_the_library_must_be_the_release_of_the_headers():
    headers = INFO["nccl_device_headers"]
    if not headers:
        assert "has no NCCL device path" in native.nccl_device_mismatch(22809)
        return
    same_release = headers // 100 * 100 + 99  # another patch level of the same major.minor
    assert native.nccl_device_mismatch(headers) == "" and native.nccl_device_mismatch(same_release) == ""
    other = 22809 if headers // 100 != 228 else 23203
    why = native.nccl_device_mismatch(other)
    assert f"compiled against NCCL {_text(headers)}'s device headers" in why
    assert f"the library loaded is NCCL {_text(other)}" in why and "PORTEP_NCCL_INCLUDE" in why


def test_a_unique_id_comes_from_the_library():
    require_or_skip("nccl", bool(nccl_library.wheel_candidates()), "nvidia-nccl-cu12 is not installed")
    first = native.nccl_unique_id(nccl_library.wheel_candidates())
    second = native.nccl_unique_id(nccl_library.wheel_candidates())
    assert isinstance(first, bytes) and len(first) == len(second) == 128 and first != second


def _native_lsa(**changes):
    args = dict(
        rank=0,
        num_ranks=1,
        device=0,
        nbytes=4096,
        unique_id=bytes(range(128)),
        timeout_s=5.0,
        candidates=nccl_library.wheel_candidates(),
    )
    args.update(changes)
    return native.NcclLsa(**args)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(nbytes=100), "bytes 100: a positive multiple of 16 is needed"),
        (dict(nbytes=0), "bytes 0: a positive multiple of 16"),
        (dict(unique_id=b"x" * 16), "unique_id: 16 bytes, 128 needed"),
        (dict(rank=2, num_ranks=2), "rank 2 of num_ranks 2"),
        (dict(rank=2, num_ranks=2, gin=True), "rank 2 of num_ranks 2"),
    ],
)
def test_the_native_object_refuses_bad_arguments(changes, match):
    if not INFO["gpu_built"]:
        pytest.skip(f"no GPU kernels in this build: {INFO['gpu_reason']}")
    if not INFO["nccl_device_headers"]:
        with pytest.raises(RuntimeError, match="this build has no NCCL device path"):
            _native_lsa(**changes)
        return
    with pytest.raises(ValueError, match=match):
        _native_lsa(**changes)


def test_without_a_gpu_the_native_object_says_so():
    if not INFO["gpu_built"] or native.cuda_devices()[0] > 0:
        pytest.skip("needs a GPU build on a machine without a GPU")
    with pytest.raises(RuntimeError, match="NCCL device path: no GPU|this build has no NCCL device path"):
        _native_lsa()


def _refused_on_every_rank(rank, world):
    from portep.nccl_device import NcclDevicePath, device_path_problem

    try:
        NcclDevicePath(None, 1 << 16)
    except RuntimeError as e:
        return {"problem": device_path_problem(), "error": str(e)}
    return {"problem": device_path_problem(), "error": None}


def test_every_rank_refuses_naming_each_rank_that_cannot_run_the_path():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine can run the path (tests/gpu/test_gpu_nccl_device.py)")
    out = run_ranks(_refused_on_every_rank, 2, timeout=120)
    for rank in (0, 1):
        problem, error = out[rank]["problem"], out[rank]["error"]
        assert problem and error, out[rank]
        assert error.startswith("the NCCL device path cannot run: rank 0: ")
        assert f"rank 0: {problem}" in error and f"rank 1: {out[1]['problem']}" in error


def test_a_library_of_another_release_is_named(tmp_path):
    """An NCCL of another release than the headers' (a stand-in library, $PORTEP_LIBNCCL) is refused before any NCCL
    call, naming both releases and the library's path."""
    if not INFO["nccl_device_headers"]:
        pytest.skip(f"this build has no NCCL device path: {INFO['nccl_device_reason']}")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("no C compiler (cc or gcc) to build the stand-in library")
    other = 22809 if INFO["nccl_device_headers"] // 100 != 228 else 23203
    src = tmp_path / "nccl_other.c"
    src.write_text(f"int ncclGetVersion(int* v) {{ *v = {other}; return 0; }}\n")
    lib = tmp_path / "libnccl_other.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    code = "from portep.nccl_device import device_path_problem; print(device_path_problem())"
    env = dict(os.environ, PORTEP_LIBNCCL=str(lib))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    problem = out.stdout.strip()
    assert "compiled against NCCL" in problem and str(lib) in problem, problem
    assert f"the library loaded is NCCL {_text(other)}" in problem
