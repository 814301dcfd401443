"""The LL fast path (portep._ll_torch, backends/cuda/ll_fast.py) on GPUs: bit for bit the full path's outputs at
DeepEP's shape on one rank and at two ranks (direct NVLink and the proxy path), the calls it must decline, and
notices raised through it. Skipped without a GPU, the CUDA kernels and the fast path module (built, or compiled at
first use: an install without the build-time module runs these on the one compiled by ll_jit.py)."""

import os

import pytest
import torch

from ci_expect import gpu_skip_reason
import gpu_ll_fast_workers as f
from dist_util import run_ranks
from portep import native

GPUS_FOR_2 = 1 if os.environ.get("PORTEP_TEST_SHARE_GPU") == "1" else 2


NO_GPU = "no GPU or no CUDA kernels"


def _fast_path_missing():
    """Why no fast path module serves this torch ('' where one does): the build's, or the one compiled at first use
    (ll_jit.py), as a Buffer finds it; checked only where there is a GPU, since the first use compiles."""
    if not native.build_info()["gpu_built"] or not torch.cuda.is_available():
        return NO_GPU
    from portep.backends.cuda.ll_fast import fast_path_module

    return fast_path_module(native)[1]


_MISSING = _fast_path_missing()
fast_path = pytest.mark.skipif(
    bool(_MISSING),
    reason=gpu_skip_reason(1) if _MISSING == NO_GPU else f"no LL fast path module for this torch: {_MISSING}",
)

# (ranks, name, num_ranks_per_node, transport); the GPUs each case needs follow from ranks
CASES = [(1, "one-rank", 1, "shm"), (2, "direct-nvlink", 2, "shm"), (2, "proxy-shm-unordered", 1, "shm-unordered")]


@pytest.mark.gpu
@fast_path
@pytest.mark.parametrize("case", CASES, ids=[c[1] for c in CASES])
def test_fast_path_matches_the_full_path(case):
    ranks, _, rpn, transport = case
    if ranks > 1 and torch.cuda.device_count() < GPUS_FOR_2:
        pytest.skip("needs two GPUs (or PORTEP_TEST_SHARE_GPU=1)")
    out = run_ranks(f.fast_path_body, ranks, args=(rpn, transport, 5, 128, 7168, 288, 8), timeout=600)
    for rank, errors in out.items():
        assert errors == [], f"rank {rank}: {errors}"


@pytest.mark.gpu
@fast_path
@pytest.mark.parametrize("case", CASES, ids=[c[1] for c in CASES])
def test_graph_launches_match_kernel_launches(case):
    ranks, _, rpn, transport = case
    if native.build_info()["gpu_runtime"] != "cuda" or os.environ.get("PORTEP_LL_GRAPH_LAUNCH") == "0":
        pytest.skip("graph launches are a CUDA build's, and PORTEP_LL_GRAPH_LAUNCH=0 turns them off")
    if ranks > 1 and torch.cuda.device_count() < GPUS_FOR_2:
        pytest.skip("needs two GPUs (or PORTEP_TEST_SHARE_GPU=1)")
    out = run_ranks(f.graph_launch_body, ranks, args=(rpn, transport, 7, 128, 7168, 288, 8), timeout=600)
    for rank, errors in out.items():
        assert errors == [], f"rank {rank}: {errors}"
