"""LogFMT-10 combine (low_latency_combine(use_logfmt=True)) on the CUDA kernels: the host backend's LogFMT suite
(ll_logfmt_workers.logfmt_body: every combined row against the float64 LogFMT reference, DeepEP's calc_diff against
the unquantized sum, out=, the receive hook, wait statistics, the zero_copy refusal) through the direct path, the
proxies on both shm transports and with NVLink off, at 2 and 4 ranks, at a small shape, at hidden 2560 (chunks of
512) and at DeepSeek-V3's and Qwen3-235B's shapes. The first call of a signature takes the Python path, later ones
the LL fast path. Skipped without the GPUs and the CUDA kernels."""

import os

import pytest
import torch

import ll_logfmt_workers as lw
from ci_expect import gpu_skip_reason
from deepep_workers import assert_clean
from dist_util import run_ranks
from portep import native

SHARED = os.environ.get("PORTEP_TEST_SHARE_GPU") == "1"  # every rank on GPU 0 (time-sliced: correctness only)


def _gpus(n):
    want = 1 if SHARED else n
    ok = native.build_info()["gpu_built"] and torch.cuda.is_available() and torch.cuda.device_count() >= want
    return pytest.mark.skipif(not ok, reason=gpu_skip_reason(n))


# (name, ranks per node at 2 ranks, transport, allow_nvlink_for_low_latency_mode)
PATHS = [
    ("direct", 2, "shm", True),
    ("proxy-shm", 1, "shm", True),
    ("proxy-shm-unordered", 1, "shm-unordered", True),
    ("proxy-nvlink-off", 2, "shm-unordered", False),
]
# T, hidden, experts, top-k, seed
SHAPES = [
    pytest.param((12, 2048, 8, 4, 41), id="T12-H2048"),
    pytest.param((16, 2560, 12, 6, 42), id="T16-H2560"),
    pytest.param((128, 7168, 256, 8, 43), id="deepseek-v3"),
    pytest.param((128, 4096, 128, 8, 44), id="qwen3-235b"),
]


def _run(world, path, shape, timeout):
    _, rpn, transport, nvlink = path
    T, H, E, K, seed = shape
    rpn = world if rpn > 1 else 1
    out = run_ranks(lw.logfmt_body, world, args=(rpn, transport, seed, T, H, E, K, "cuda", nvlink), timeout=timeout)
    assert_clean(out, 18)


@pytest.mark.gpu
@_gpus(2)
@pytest.mark.parametrize("path", PATHS, ids=[p[0] for p in PATHS])
@pytest.mark.parametrize("shape", SHAPES)
def test_logfmt_combine_on_2_ranks(path, shape):
    _run(2, path, shape, timeout=600)


@pytest.mark.gpu
@_gpus(4)
@pytest.mark.parametrize("path", PATHS[:2], ids=[p[0] for p in PATHS[:2]])
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[2]])
def test_logfmt_combine_on_4_ranks(path, shape):
    _run(4, path, shape, timeout=600)
