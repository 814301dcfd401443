"""The CUDA backend after a failure on one side (robust_workers.py on GPU tensors): one rank's LL call refused
while its peers make it (the peers' kernels give up within a second and raise; every later call raises until
clean_low_latency_buffer), a peer that dies or leaves (the waiting kernels give up within a second), and shrink
mode (ranks that leave are masked, the others' results exact without them). Direct path and the proxy path over both
shm modes. Skipped without the CUDA kernels and the GPUs (PORTEP_TEST_SHARE_GPU=1: the ranks share one)."""

import os

import pytest
import torch

from ci_expect import gpu_skip_reason
import robust_workers as r
from deepep_workers import assert_clean
from dist_util import run_ranks
from portep import native

SHARE = os.environ.get("PORTEP_TEST_SHARE_GPU") == "1"


def _gpus(n):
    return pytest.mark.skipif(
        not native.build_info()["gpu_built"]
        or not torch.cuda.is_available()
        or torch.cuda.device_count() < (1 if SHARE else n),
        reason=gpu_skip_reason(n),
    )


# world, ranks_per_node, transport
PATHS = [(2, 2, "shm"), (2, 1, "shm"), (2, 1, "shm-unordered")]
IDS = ["direct", "proxy-shm", "proxy-shm-unordered"]


@pytest.mark.gpu
@_gpus(2)
@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_cuda_one_sided_refusal_fails_fast_until_resynchronised(path):
    world, rpn, transport = path
    out = run_ranks(r.one_sided_refusal_body, world, args=(rpn, transport, "ll", 3, "cuda"), timeout=240)
    assert_clean(out, 10)


@pytest.mark.gpu
@_gpus(2)
@pytest.mark.parametrize("how", ["exit", "destroy"])
@pytest.mark.parametrize("path", PATHS[:2], ids=IDS[:2])
def test_cuda_dead_or_departed_peer_fails_the_waiters_within_a_second(path, how):
    world, rpn, transport = path
    out = run_ranks(
        r.dead_peer_body,
        world,
        args=(rpn, transport, how, 9, "cuda"),
        timeout=180,
        expect_missing=(world - 1,) if how == "exit" else (),
    )
    assert_clean({k: v for k, v in out.items() if k != world - 1}, 2)


@pytest.mark.gpu
@_gpus(6)
@pytest.mark.parametrize("path", [(6, 6, "shm"), (6, 1, "shm-unordered")], ids=["direct", "proxy-shm-unordered"])
def test_cuda_shrink_masks_the_ranks_that_leave(path):
    world, rpn, transport = path
    # torch's defaults as DeepEP's tests set them (bfloat16, 'cuda') during every Buffer call
    out = run_ranks(r.shrink_body, world, args=(rpn, transport, 13, 2, "cuda", "cuda"), timeout=400)
    assert_clean(out, 1)
    assert sum(v["checks"] for v in out.values()) > 100
