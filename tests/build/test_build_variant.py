"""The build under test is the one meant: CI runs the suite once against the CUDA build (where a CUDA compiler was
found) and once against the HIP build, and says which through PORTEP_EXPECT_GPU_RUNTIME. Either way the GPU
backend's report holds together: the runtime, its architectures and the reasons agree. A GPU build's checks fail
where CI expects the kernels (or the LL fast path) and the build lacks them (tests/support/ci_expect.py)."""

import os

import ci_expect
import pytest

from portep import native


def test_the_build_is_the_one_this_run_means():
    expect = os.environ.get("PORTEP_EXPECT_GPU_RUNTIME")
    if expect is None:
        pytest.skip("PORTEP_EXPECT_GPU_RUNTIME not set (CI sets it)")
    info = native.build_info()
    assert info["gpu_runtime"] == expect, (
        f"expected GPU kernels for {expect or 'none'}, the build has "
        f"{info['gpu_runtime'] or 'none'}: {info['gpu_reason']}"
    )


def test_the_build_report_is_consistent():
    info = native.build_info()
    runtime = info["gpu_runtime"]
    assert runtime in ("", "cuda", "hip")
    assert info["gpu_built"] == bool(runtime)
    assert info["cuda_built"] == (runtime == "cuda") and info["hip_built"] == (runtime == "hip")
    if runtime:
        assert info["gpu_archs"] and not info["gpu_reason"]
        assert (runtime == "hip") == bool(info["hip_version"])
        if runtime == "hip":
            assert all(a.startswith("gfx") for a in info["gpu_archs"].split(","))
    else:
        assert info["gpu_reason"] and info["cuda_reason"] and info["hip_reason"]
    count, error = native.cuda_devices()
    assert count >= 0 and (count > 0 or error)


def test_a_gpu_build_refuses_a_torch_of_the_other_runtime(monkeypatch):
    torch = pytest.importorskip("torch")
    info = native.build_info()
    ci_expect.require_or_skip("cuda-kernels", info["gpu_built"], f"no GPU kernels in this build: {info['gpu_reason']}")
    other_is_hip = info["gpu_runtime"] == "cuda"  # a torch built for the other runtime, as torch.version says
    monkeypatch.setattr(torch.version, "hip", "6.2.0" if other_is_hip else None, raising=False)
    monkeypatch.setattr(torch.version, "cuda", None if other_is_hip else "12.8")
    from portep.backends.cuda.engine import CudaEngine

    with pytest.raises(RuntimeError, match=f"PORTEP_GPU={'hip' if other_is_hip else 'cuda'}"):
        CudaEngine(None, 1 << 20, 1)


def test_the_ll_fast_path_is_built_where_meant_and_loads_under_its_torch():
    """portep._ll_torch (the LL hot path, the one module linking libtorch) is built where torch was importable at
    build time; CI builds without isolation and expects ll-fast-path (PORTEP_CI_EXPECT) so a build that lost it
    fails."""
    torch = pytest.importorskip("torch")
    info = native.build_info()
    built_for = info["ll_fast_path_torch"]
    if not built_for:
        assert info["ll_fast_path_reason"]
        ci_expect.require_or_skip("ll-fast-path", False, f"not built: {info['ll_fast_path_reason']}")
    assert not info["ll_fast_path_reason"]
    from portep import _ll_torch
    from portep.backends.cuda.ll_fast import fast_path_module

    assert _ll_torch.TORCH_VERSION == built_for
    module, why_not = fast_path_module(native)
    if built_for != torch.__version__:  # compiled at first use instead (backends/cuda/ll_jit.py)
        assert module is None or module.TORCH_VERSION == torch.__version__, why_not
    elif not hasattr(torch._C, "_cuda_getCurrentRawStream"):  # a CPU-only torch
        assert module is None and "_cuda_getCurrentRawStream" in why_not
    else:
        assert module is _ll_torch and why_not == ""
    assert isinstance(_ll_torch.LLCalls, type)  # its entries: tests/unit/test_ll_fast_entries.py


def test_the_ll_fast_path_is_off_where_torchs_cuda_allocator_was_swapped(monkeypatch):
    """The fast path allocates from torch's own CUDA allocator (native or cudaMallocAsync); one installed with
    torch.cuda.memory.change_current_allocator ("pluggable") would be bypassed, so the Buffer takes the full path."""
    torch = pytest.importorskip("torch")
    built_for = native.build_info()["ll_fast_path_torch"]
    ci_expect.require_or_skip(
        "ll-fast-path",
        built_for == torch.__version__,
        f"built against torch {built_for or '(none)'}, this is {torch.__version__}",
    )
    from portep import _ll_torch
    from portep.backends.cuda.ll_fast import fast_path_module

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)  # a GPU torch
    for backend, expected in (("native", _ll_torch), ("cudaMallocAsync", _ll_torch), ("pluggable", None)):
        monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: backend)
        module, why_not = fast_path_module(native)
        assert module is expected, (backend, why_not)
        assert (why_not == "") == (expected is not None) and (expected is not None or "'pluggable'" in why_not)
