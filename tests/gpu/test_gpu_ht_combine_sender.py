"""The CUDA normal-mode combine's sender block (ht_combine_send.cuh: every ring at once, each ring a lane that stores
what room it has), bitwise against the host backend on every path: direct stores, the proxies (shm, shm-unordered),
forwarders between simulated nodes, rings small enough to wrap many times (senders waiting for heads and credits, a
slow reader holding up only its own lane), 12 to 32 ranks, a rank without tokens and a node that receives nothing
(gpu_ht_workers.cross_backend_body: dispatch, cached dispatch, combine with weights and both biases, also against
float64)."""

import os

import pytest
import torch

import gpu_ht_workers as g
from ci_expect import gpu_skip_reason
from deepep_workers import assert_clean
from dist_util import run_ranks
from portep import native

SHARE = os.environ.get("PORTEP_TEST_SHARE_GPU") == "1"

# world, ranks per node, transport, seed, tokens per rank, hidden, top-k, experts, SMs, GPU bytes, avoid node, groups
CASES = [
    pytest.param(2, 2, "shm", 11, [333, 150], 1024, 8, 32, 24, None, None, None, id="1x2-direct"),
    pytest.param(4, 4, "shm", 12, [333, 0, 97, 271], 1024, 8, 32, 24, None, None, None, id="1x4-direct-rank-1-empty"),
    pytest.param(2, 2, "shm", 9, [1500, 900], 1024, 8, 32, 4, 600064, None, None, id="1x2-direct-small-rings"),
    pytest.param(2, 1, "shm-unordered", 9, [1500, 900], 1024, 8, 32, 4, 600064, None, None, id="2x1-proxy-small-rings"),
    pytest.param(4, 2, "shm", 53, [333, 150, 5, 271], 1024, 8, 32, 24, None, None, None, id="2x2-forward-shm"),
    pytest.param(
        4,
        2,
        "shm-unordered",
        19,
        [1500, 900, 1200, 700],
        1024,
        8,
        32,
        4,
        6 << 20,
        None,
        None,
        id="2x2-forward-shm-unordered-small-rings",
    ),
    pytest.param(12, 4, "shm-unordered", 16, None, 1024, 8, 48, 24, None, None, 2, id="3x4-shm-unordered-2-groups"),
    pytest.param(16, 8, "shm", 24, None, 1024, 8, 128, 24, None, 0, None, id="2x8-shm-node-0-empty"),
    pytest.param(12, 1, "shm-unordered", 13, None, 1024, 8, 48, 24, None, None, None, id="12x1-shm-unordered"),
    pytest.param(32, 8, "shm", 40, None, 1024, 8, 256, 24, None, 2, 2, id="4x8-shm-node-2-empty-2-groups"),
]


def _tokens(world, seed):
    """Tokens per rank: different on every rank, rank 1 sends none (as test_gpu_ht_nodes)."""
    return [0 if r == 1 else 40 + (seed * 37 + r * 53) % 170 for r in range(world)]


@pytest.mark.gpu
@pytest.mark.parametrize("world,rpn,transport,seed,tokens,hidden,topk,experts,sms,gpu_bytes,avoid,groups", CASES)
def test_combine_sender_matches_host_backend_bitwise(
    world, rpn, transport, seed, tokens, hidden, topk, experts, sms, gpu_bytes, avoid, groups
):
    if not (
        native.build_info()["gpu_built"]
        and torch.cuda.is_available()
        and torch.cuda.device_count() >= (1 if SHARE else world)
    ):
        pytest.skip(gpu_skip_reason(world))
    args = (rpn, transport, seed, tokens or _tokens(world, seed), hidden, topk, experts, sms, gpu_bytes, avoid, groups)
    out = run_ranks(g.cross_backend_body, world, args=args, timeout=900)
    assert_clean(out, 20)
