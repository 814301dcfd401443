"""transport="nccl" where it cannot run: every refusal names what is missing, from what the native layer finds at run
time (the device asked for, the NCCL library and its version, the GPU). Its protocol runs in CI over the emulation
("nccl-emulated": test_channel.py and the DeepEP bodies in test_deepep_ll.py / test_deepep_ht.py); over NCCL itself it
needs NCCL >= 2.29.2 and a GPU (tests/gpu/test_gpu_nccl_transport.py)."""

import pytest

import channel_workers as w
from dist_util import run_ranks
from nccl_wheel import SYMBOLS, stand_in_library
from portep._native import native

CUDA_BUILD = native.build_info()["gpu_runtime"] == "cuda"


def _refusal(device, env=None):
    return run_ranks(w.refusal, 1, args=("nccl", device), timeout=120, env=env)[0]


def test_host_memory_is_refused_naming_the_device_and_the_emulation():
    msg = _refusal(None)
    assert msg is not None, "a Channel on host memory was built over transport='nccl'"
    if CUDA_BUILD:
        assert "moves GPU memory" in msg and "device=-1" in msg and "nccl-emulated" in msg, msg
    else:
        assert "no CUDA runtime" in msg and "nccl-emulated" in msg, msg


@pytest.mark.skipif(not CUDA_BUILD, reason="a build without the CUDA runtime refuses before it looks for NCCL")
def test_an_nccl_without_the_one_sided_api_is_refused_naming_its_version(tmp_path):
    old = stand_in_library(tmp_path, "nccl_old", 22809, [s for s in SYMBOLS if "Signal" not in s])
    msg = _refusal(0, env={"PORTEP_LIBNCCL": old})
    assert msg is not None and "NCCL 2.28.9 at" in msg and old in msg, msg
    assert "needs NCCL >= 2.29.2" in msg and "ncclPutSignal" in msg, msg


@pytest.mark.skipif(not CUDA_BUILD, reason="a build without the CUDA runtime refuses before it looks for NCCL")
def test_a_missing_library_is_refused_naming_the_path(tmp_path):
    missing = str(tmp_path / "libnccl-missing.so.2")
    msg = _refusal(0, env={"PORTEP_LIBNCCL": missing})
    assert msg is not None and missing in msg and "$PORTEP_LIBNCCL" in msg, msg


@pytest.mark.skipif(not CUDA_BUILD, reason="a build without the CUDA runtime refuses before it looks for NCCL")
def test_a_new_enough_nccl_without_a_gpu_is_refused_naming_the_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: tests/gpu/test_gpu_nccl_transport.py runs the transport there")
    new = stand_in_library(tmp_path, "nccl_new", 23203, SYMBOLS)
    msg = _refusal(0, env={"PORTEP_LIBNCCL": new})
    assert msg is not None and "nccl: no GPU 0 here" in msg, msg
