"""The CUDA normal mode across simulated nodes at cluster shapes: 12 ranks (3 nodes x 4), 16 (2 x 8), 32 (4 x 8)
and 12 nodes of one GPU each, every rank on the GPUs there are (PORTEP_TEST_SHARE_GPU=1: all on one, correctness
only). Each case runs gpu_ht_workers.cross_backend_body: every output and handle entry of the CUDA backend against
the host backend's bit for bit (BF16 and FP8 dispatch, cached dispatch, combine with top-k weights and both bias
tensors), combines also against their float64 references; with a rank that sends nothing, a node that receives
nothing, and tokens limited to num_topk_groups nodes; and 16 ranks (2 x 8) and 6 (3 x 2) at DeepEP's shape. Traffic
between nodes goes through the proxies over both shm transports; inside a node, direct stores and forwarders."""

import os

import pytest
import torch

import gpu_ht_workers as g
from ci_expect import gpu_skip_reason
from deepep_workers import assert_clean
from dist_util import run_ranks
from portep import native

SHARE = os.environ.get("PORTEP_TEST_SHARE_GPU") == "1"


def _tokens(world, seed):
    """Tokens per rank: different on every rank, rank 1 sends none."""
    return [0 if r == 1 else 40 + (seed * 37 + r * 53) % 170 for r in range(world)]


def _skip_without_gpus(world):
    """Skips unless the CUDA kernels are built and there are `world` GPUs (one with PORTEP_TEST_SHARE_GPU=1)."""
    if not (
        native.build_info()["gpu_built"]
        and torch.cuda.is_available()
        and torch.cuda.device_count() >= (1 if SHARE else world)
    ):
        pytest.skip(gpu_skip_reason(world))


# world, ranks per node, transport, experts, extra arguments of cross_backend_body
CASES = [
    pytest.param(12, 4, "shm", 96, {}, id="3x4-shm"),
    pytest.param(12, 4, "shm-unordered", 48, {"topk_groups": 2}, id="3x4-shm-unordered-2-groups"),
    pytest.param(16, 8, "shm", 64, {}, id="2x8-shm"),
    pytest.param(16, 8, "shm-unordered", 128, {"avoid_node": 0}, id="2x8-shm-unordered-node-0-empty"),
    pytest.param(12, 1, "shm-unordered", 48, {}, id="12x1-shm-unordered"),
    pytest.param(32, 8, "shm", 256, {"avoid_node": 2, "topk_groups": 2}, id="4x8-shm-node-2-empty-2-groups"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("world,rpn,transport,experts,extra", CASES)
def test_ht_nodes_match_host_backend_bitwise(world, rpn, transport, experts, extra):
    _skip_without_gpus(world)
    seed = world + rpn
    out = run_ranks(
        g.cross_backend_body,
        world,
        args=(
            rpn,
            transport,
            seed,
            _tokens(world, seed),
            1024,
            8,
            experts,
            24,
            None,
            extra.get("avoid_node"),
            extra.get("topk_groups"),
        ),
        timeout=900,
    )
    assert_clean(out, 20)


# A host backend Buffer that holds every row a rank receives at DeepEP's shape with 16 ranks, even if every token
# came to it: 16 x 4096 rows of at most 14.5 KB, and as much again for the rows its forwarders stage
DEEPEP_HOST_BYTES = 2 << 30
# The GPU Buffer there: 160 rows of 14.5 KB per ring with 12 channels (256 MiB holds 32, under the 64 a ring needs;
# DeepEP's test_internode.py gives 3 GB)
DEEPEP_GPU_BYTES = 1 << 30


@pytest.mark.gpu
@pytest.mark.parametrize(
    "world,rpn,experts",
    [pytest.param(16, 8, 256, id="2x8"), pytest.param(6, 2, 288, id="3x2")],
)
def test_ht_nodes_at_deepep_shape_bitwise(world, rpn, experts):
    """16 ranks (2 nodes x 8) at DeepEP's test_internode.py shape: 4096 tokens a rank, hidden 7168, top-8, 256
    experts, 24 SMs, the shm transport between the nodes; a 1 GiB GPU Buffer, whose rings wrap many times. And 3 nodes
    x 2 ranks at that shape (288 experts, a multiple of 6), where each forwarder serves two other nodes' sources with
    wrapping rings (the one-process benchmark at that node count did not end on an H100, 2026-12-07)."""
    _skip_without_gpus(world)
    tokens = [4096] * world
    args = (rpn, "shm", 97, tokens, 7168, 8, experts, 24, DEEPEP_GPU_BYTES, None, None, DEEPEP_HOST_BYTES)
    out = run_ranks(g.cross_backend_body, world, args=args, timeout=1500)
    assert_clean(out, 20)
