"""The CUDA backend's LL mode under what applications do around its calls (gpu_hazard_workers):
CUDA_DEVICE_MAX_CONNECTIONS chosen by the application, at 1 (one hardware queue for every stream) or at CUDA's
default, .item() reads right after a call, kernels new to the process launched mid-exchange, on the direct path and
on the proxy path over both shm modes; and out-of-range expert indices in CUDA tensors, reported by the next call
without a host synchronization. Skipped without the CUDA kernels and two GPUs (PORTEP_TEST_SHARE_GPU=1: one,
shared)."""

import os

import pytest
import torch

from ci_expect import gpu_skip_reason
import gpu_hazard_workers as h
from deepep_workers import assert_clean
from dist_util import run_ranks
from portep import native

GPUS_NEEDED = 1 if os.environ.get("PORTEP_TEST_SHARE_GPU") == "1" else 2
two_gpus = pytest.mark.skipif(
    not native.build_info()["gpu_built"] or not torch.cuda.is_available() or torch.cuda.device_count() < GPUS_NEEDED,
    reason=gpu_skip_reason(2),
)

# (name, num_ranks_per_node, transport, allow_nvlink_for_low_latency_mode)
PATHS = [("direct", 2, "shm", True), ("proxy-shm", 1, "shm", True), ("proxy-nvlink-off", 2, "shm-unordered", False)]
# the DeepEP test's shape: 144 local experts at EP2, every proxy peer in 5 chunks
SHAPE = (128, 7168, 288, 8)


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("connections", ["1", "8"], ids=["one-queue", "default-queues"])
@pytest.mark.parametrize("path", PATHS, ids=[p[0] for p in PATHS])
def test_ll_with_application_habits(path, connections):
    _, rpn, transport, nvlink = path
    out = run_ranks(
        h.application_habits_body,
        2,
        args=(rpn, transport, nvlink, 61, *SHAPE, 4),
        timeout=300,
        env={"CUDA_DEVICE_MAX_CONNECTIONS": connections},
    )
    assert_clean(out, 4)


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("path", PATHS, ids=[p[0] for p in PATHS])
def test_out_of_range_expert_on_cuda_is_raised_by_the_next_call(path):
    _, rpn, transport, nvlink = path
    out = run_ranks(h.bad_expert_body, 2, args=(rpn, transport, nvlink, 62, *SHAPE), timeout=300)
    assert_clean(out, 4)


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("path", PATHS[:2], ids=[p[0] for p in PATHS[:2]])
def test_ll_profile_shows_one_kernel_name_per_op(path):
    _, rpn, transport, nvlink = path
    out = run_ranks(h.profile_body, 2, args=(rpn, transport, nvlink, 63, *SHAPE, 3), timeout=300)
    assert_clean(out, 4)
