"""The GPU kernel sources compile for AMD GPUs with hipcc, unchanged: everything vendor-specific goes through
gpu_kernels/portability.cuh (device code) and gpu_kernels/cuda/gpu_runtime.h (runtime calls). Compile only (no AMD
GPU), for CDNA2 (gfx90a, MI200) and CDNA3 (gfx940 stands in for MI300X's gfx942 where hipcc's clang is too old to
know it), with unchecked runtime calls as errors. Skips where hipcc is not installed (.ci/run installs it with apt, and
expects it: tests/support/ci_expect.py's hip)."""

import os
import shutil
import subprocess
from pathlib import Path

import ci_expect
import pytest

ROOT = Path(__file__).resolve().parents[2]
# the product's kernels and the test hooks' probe kernels (tests/native), which the HIP build compiles too
SOURCES = sorted((ROOT / "gpu_kernels" / "cuda").glob("*.cu")) + sorted((ROOT / "tests" / "native").glob("*.cu"))
ARCHS = os.environ.get("PORTEP_HIP_ARCHS", "gfx90a,gfx940").split(",")

pytestmark = ci_expect.needs("hip", shutil.which("hipcc") is not None, "hipcc is not on PATH (ROCm's hipcc package)")


def _hipcc(source, out, extra=()):
    includes = [f"-I{ROOT}"]  # one include tree: sources include others by their path from the root
    cmd = [
        "hipcc",
        "-x",
        "hip",
        *[f"--offload-arch={a}" for a in ARCHS],
        "-std=c++17",
        "-O2",
        "-c",
        str(source),
        *includes,
        "-Werror=unused-result",
        *extra,
        "-o",
        str(out),
    ]
    env = dict(os.environ, HIP_PLATFORM="amd")  # else hipcc takes the NVIDIA path when nvcc is on PATH
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def test_every_kernel_source_is_found():
    names = {p.name for p in SOURCES}
    assert {"ht_dispatch.cu", "ht_combine.cu", "ht_notify.cu", "ll_dispatch.cu", "ll_combine.cu", "layout.cu"} <= names


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_kernel_source_compiles_with_hipcc(source, tmp_path):
    out = tmp_path / (source.name + ".o")
    r = _hipcc(source, out)
    assert r.returncode == 0, f"hipcc {source.name}:\n{r.stderr[-4000:]}"
    assert out.stat().st_size > 0
    if "__global__" not in source.read_text():
        return  # host code only (allocations, setup)
    # the object holds device code for every requested architecture
    bundles = subprocess.run(["strings", str(out)], capture_output=True, text=True).stdout
    for arch in ARCHS:
        assert arch in bundles, f"{source.name}: no code object for {arch}"


def test_an_unchecked_runtime_call_is_refused(tmp_path):
    """The check above would catch an unchecked call: HIP's runtime functions are [[nodiscard]]."""
    src = tmp_path / "unchecked.cu"
    src.write_text('#include "gpu_kernels/cuda/gpu_runtime.h"\nvoid leak(void* p) { cudaFree(p); }\n')
    r = _hipcc(src, tmp_path / "unchecked.o")
    assert r.returncode != 0 and "unused-result" in r.stderr
