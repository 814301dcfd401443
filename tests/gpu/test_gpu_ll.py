"""The CUDA backend's low-latency mode on two GPUs: the host backend's whole LL suite (deepep_workers.ll_body)
through the direct NVLink path and through the forced proxy path (FIFOs, proxy threads, copy engines) over both
shm transport modes; the CUDA results against the host backend's bit for bit; CUDA-graph capture; a missing
peer. Skipped without two GPUs and the CUDA kernels."""

import os

import pytest
import torch

from ci_expect import gpu_skip_reason
import deepep_workers as w
import gpu_ll_workers as g
from deepep_workers import assert_clean
from dist_util import run_ranks
from portep import native

# PORTEP_TEST_SHARE_GPU=1 lets both ranks share one GPU (their kernels time-slice: correctness only, slowly)
GPUS_NEEDED = 1 if os.environ.get("PORTEP_TEST_SHARE_GPU") == "1" else 2
two_gpus = pytest.mark.skipif(
    not native.build_info()["gpu_built"] or not torch.cuda.is_available() or torch.cuda.device_count() < GPUS_NEEDED,
    reason=gpu_skip_reason(2),
)

# (name, num_ranks_per_node, transport, allow_nvlink_for_low_latency_mode)
PATHS = [
    ("direct-nvlink", 2, "shm", True),
    ("proxy-shm", 1, "shm", True),
    ("proxy-shm-unordered", 1, "shm-unordered", True),
    ("proxy-nvlink-off", 2, "shm-unordered", False),
]
SHAPES = [(64, 512, 16, 8, 31), (48, 2048, 12, 6, 32)]  # T, hidden, experts, top-k, seed
# The shapes real models use (the host backend runs them in CI: test_production_shapes.py): DeepEP's test default,
# hidden 7168 with 288 experts (144 local at EP2: four proxy chunks of 32 and a half; 72 at EP4), DeepSeek-V3's 256,
# and hidden 4096 with 160 (80 local at EP2)
PROD_SHAPES = [(128, 7168, 288, 8, 71), (128, 7168, 256, 8, 72), (128, 4096, 160, 8, 73)]
GPUS_FOR_4 = 1 if GPUS_NEEDED == 1 else 4
four_gpus = pytest.mark.skipif(
    not native.build_info()["gpu_built"] or not torch.cuda.is_available() or torch.cuda.device_count() < GPUS_FOR_4,
    reason=gpu_skip_reason(4),
)
# 4 ranks: (name, num_ranks_per_node, transport, allow_nvlink_for_low_latency_mode)
PATHS_4 = [
    ("direct-nvlink", 4, "shm", True),
    ("proxy-shm", 1, "shm", True),
    ("proxy-nvlink-off", 4, "shm-unordered", False),
]


def _run_ll_suite(path, shape, ranks, rounds, timeout, min_checks):
    _, rpn, transport, nvlink = path
    T, H, E, K, seed = shape
    out = run_ranks(
        w.ll_body, ranks, args=(rpn, transport, seed, T, H, E, K, False, rounds, "cuda", nvlink), timeout=timeout
    )
    assert_clean(out, min_checks)


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("path", PATHS, ids=[p[0] for p in PATHS])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"T{s[0]}-H{s[1]}-E{s[2]}" for s in SHAPES])
def test_ll_suite_on_gpus(path, shape):
    _run_ll_suite(path, shape, ranks=2, rounds=3, timeout=300, min_checks=100)


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("path", PATHS, ids=[p[0] for p in PATHS])
@pytest.mark.parametrize("shape", PROD_SHAPES, ids=[f"H{s[1]}-E{s[2]}" for s in PROD_SHAPES])
def test_ll_suite_at_production_shapes(path, shape):
    _run_ll_suite(path, shape, ranks=2, rounds=1, timeout=600, min_checks=5000)


@pytest.mark.gpu
@four_gpus
@pytest.mark.parametrize("path", PATHS_4, ids=[p[0] for p in PATHS_4])
def test_ll_suite_at_deepep_shape_on_4_ranks(path):
    _run_ll_suite(path, PROD_SHAPES[0], ranks=4, rounds=1, timeout=600, min_checks=3000)


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("path", PATHS[1:3], ids=[p[0] for p in PATHS[1:3]])
def test_cuda_matches_host_backend_bitwise_at_deepep_shape(path):
    _, rpn, transport, nvlink = path
    T, H, E, K, seed = PROD_SHAPES[0]
    out = run_ranks(g.cross_backend_body, 2, args=(rpn, transport, nvlink, seed, T, H, E, K), timeout=600)
    assert_clean(out, 20)


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("hidden", [2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192])
def test_cuda_matches_host_backend_bitwise_for_every_deepep_hidden_size(hidden):
    # DeepEP's LL kernels take these hidden sizes; 33 local experts: a full proxy chunk and one of a single expert
    out = run_ranks(
        g.cross_backend_body, 2, args=(1, "shm-unordered", True, hidden % 97, 24, hidden, 66, 8), timeout=300
    )
    assert_clean(out, 20)


@pytest.mark.gpu
@two_gpus
def test_ll_suite_on_gpus_with_fewer_tokens():
    out = run_ranks(w.ll_body, 2, args=(1, "shm-unordered", 41, 40, 1024, 8, 5, True, 1, "cuda", True), timeout=300)
    assert_clean(out, 100)


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("path", PATHS[:3], ids=[p[0] for p in PATHS[:3]])
def test_cuda_matches_host_backend_bitwise(path):
    _, rpn, transport, nvlink = path
    out = run_ranks(g.cross_backend_body, 2, args=(rpn, transport, nvlink, 7, 64, 2048, 32, 8), timeout=300)
    assert_clean(out, 20)


@pytest.mark.gpu
@two_gpus
def test_cuda_matches_host_backend_bitwise_past_partials():
    # more tokens than the combine's meta blocks hold (LL_META_TOKENS): direct peers get rows, not partial sums
    T = native.LL_META_TOKENS + 16
    out = run_ranks(g.cross_backend_body, 2, args=(2, "shm", True, 9, T, 512, 8, 4), timeout=300)
    assert_clean(out, 20)


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("path", PATHS[:3], ids=[p[0] for p in PATHS[:3]])
def test_ll_cuda_graph_capture_and_replay(path):
    _, rpn, transport, nvlink = path
    out = run_ranks(g.graph_body, 2, args=(rpn, transport, nvlink, 5, 32, 1024, 16, 4), timeout=300)
    assert_clean(out, 8)


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("nvlink", [True, False], ids=["direct", "proxy"])
def test_missing_peer_times_out_and_raises(nvlink):
    out = run_ranks(g.missing_peer_body, 2, args=("shm", nvlink), timeout=120)
    assert "a signal did not arrive" in out[0] and "peer rank 1" in out[0], out[0]


@pytest.mark.gpu
@pytest.mark.skipif(not native.build_info()["gpu_built"] or not torch.cuda.is_available(), reason=gpu_skip_reason(1))
def test_validation_cache_still_rejects_changed_calls():
    out = run_ranks(g.validation_cache_body, 1, timeout=120)
    assert out[0] == [], out[0]
