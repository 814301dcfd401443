"""What CI expects this machine to have. A test that needs one of the pieces below checks it through
require_or_skip (or the needs() mark): where the piece is missing it fails if PORTEP_CI_EXPECT (comma-separated,
set by .ci/run) names the piece, so CI cannot pass with what it is meant to test quietly skipped; anywhere else it
skips with a reason that says what is missing and why. Tests that need a GPU skip plainly (no machine CI runs on has
one), with a reason that says "no GPU" (gpu_skip_reason).

`python3 tests/support/ci_expect.py VARIABLE` checks the piece names in that environment variable (for .ci/run;
no pytest needed)."""

import os
import sys

PIECES = {  # name: what it means
    "cuda-kernels": "the GPU kernels built: native.build_info()['gpu_built'] (nvcc's; hipcc's in CI's HIP pass)",
    "ll-fast-path": "portep._ll_torch, the LL hot path, built against the installed torch",
    "hip": "ROCm's hipcc, for the kernels' HIP compile check (tests/build/test_hip_compile.py)",
    "verbs": "portep built with libibverbs: the verbs transports",
    "verbs-guest": "the qemu guest with soft-RoCE up (tests/verbs/guest_vm.py): the verbs transports for real",
    "pyverbs": "pyverbs in the guest, for the independent verbs peer (tests/verbs/verbs_pyverbs_peer.py)",
    "mpi": "mpirun (Debian's OpenMPI) and mpi4py, for Buffer(comm=...) under mpirun (tests/host/test_mpi_comm.py)",
    "style": "ruff and clang-format at the versions pyproject.toml's test extra pins (tests/build/test_style.py)",
    "nccl": "an nvidia-nccl-cu12 wheel (pyproject.toml's nccl extra), whose libnccl the NCCL probe loads and reads "
    "(tests/unit/test_nccl_library.py)",
}


def parse(text, source="PORTEP_CI_EXPECT"):
    """The piece names in a comma-separated list; an unknown name raises ValueError (a typo must not expect
    nothing)."""
    names = {n.strip() for n in (text or "").split(",") if n.strip()}
    unknown = sorted(names - PIECES.keys())
    if unknown:
        raise ValueError(f"{source}: unknown pieces {unknown}; the pieces are: {', '.join(PIECES)}")
    return names


def expected():
    return parse(os.environ.get("PORTEP_CI_EXPECT", ""))


def _failure(piece, reason):
    return (
        f"CI expects {piece} but it is missing: {reason}\n{piece}: {PIECES[piece]}. PORTEP_CI_EXPECT names it; "
        f"a machine that truly lacks it runs .ci/run with PORTEP_CI_ALLOW_MISSING={piece}"
    )


def require_or_skip(piece, available, reason):
    """Nothing when `available`; else fails if CI expects `piece`, and skips otherwise. `reason`: what is missing
    and why."""
    import pytest

    __tracebackhide__ = True  # a skip's location is the caller's
    parse(piece, "require_or_skip")
    if available:
        return
    if piece in expected():
        pytest.fail(_failure(piece, reason), pytrace=False)
    pytest.skip(f"{piece} missing: {reason}")


def needs(piece, available, reason):
    """require_or_skip as a mark, decided at collection: none where `piece` is here, a skip where it is missing, and
    where CI expects it a ci_missing mark, which tests/conftest.py turns into a failure at the test's setup."""
    import pytest

    parse(piece, "needs")
    if available or piece not in expected():
        return pytest.mark.skipif(not available, reason=f"{piece} missing: {reason}")
    return pytest.mark.ci_missing(_failure(piece, reason))


def check_marks(item):
    """Fails a test item that has a ci_missing mark (its own or its module's)."""
    import pytest

    for mark in item.iter_markers("ci_missing"):
        pytest.fail(mark.args[0], pytrace=False)


def gpu_skip_reason(gpus=1, also=""):
    """The skip reason of a GPU test that needs `gpus` CUDA GPUs (one where PORTEP_TEST_SHARE_GPU=1), the CUDA
    kernels and `also`: what of it this machine lacks, "no GPU" first."""
    import torch

    from portep import native

    want = 1 if os.environ.get("PORTEP_TEST_SHARE_GPU") == "1" else gpus
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    info = native.build_info()
    lacks = []
    if have < want:
        why = native.cuda_devices()[1] if info["gpu_built"] else ""
        if why:  # CUDA says "driver version is insufficient" also where there is no driver: the doctor's words
            from portep.doctor import cuda_driver_loads, gpu_error_text

            why = gpu_error_text(why, info["gpu_runtime"], cuda_driver_loads())
        share = " (1 with PORTEP_TEST_SHARE_GPU=1)" if want > 1 else ""
        lacks.append(f"no GPU: {have} CUDA GPUs here, {want} needed{share}" + (f"; {why}" if why else ""))
    if not info["gpu_built"]:
        lacks.append(f"no GPU kernels in this build: {info['gpu_reason']}")
    needed = f"needs {want} CUDA GPU{'s' * (want > 1)}, the CUDA kernels" + (f" and {also}" if also else "")
    return "; ".join(lacks) or needed


if __name__ == "__main__":
    try:
        parse(os.environ.get(sys.argv[1], ""), sys.argv[1])
    except ValueError as exc:
        sys.exit(f"ci_expect: {exc}")
