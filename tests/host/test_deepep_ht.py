"""DeepEP V1 normal (high-throughput) mode of portep.Buffer on the host backend: get_dispatch_layout, dispatch
(BF16 random / rank-constant / FP8, with and without top-k, expert_alignment 1 and 4, num_worst_tokens, cached),
combine (echo, bias, top-k weights) and bitwise reproducibility, against the references in deepep_reference.py.

Each case is one spawned run of `world` ranks that makes all the calls and returns every failed check; ranks
[r*rpn, (r+1)*rpn) form a node, so rpn < world exercises the internode (10-tuple handle) path.
"""

import pytest

import deepep_workers as w
from dist_util import run_ranks
from deepep_workers import case_id as _id, assert_clean as _assert_clean

# world, ranks_per_node, transport, hidden, num_topk, experts per rank, tokens per rank, seed
CASES = [
    (2, 1, "shm", 512, 8, 8, [300, 211], 1),
    (2, 1, "shm-unordered", 512, 8, 8, [173, 256], 2),
    (2, 2, "shm", 512, 6, 8, [256, 100], 3),
    (4, 1, "shm-unordered", 256, 6, 8, [150, 64, 201, 97], 4),
    (4, 2, "shm", 512, 8, 8, [200, 64, 150, 97], 5),
    (4, 2, "shm-unordered", 256, 4, 4, [80, 160, 120, 66], 6),
    (4, 4, "shm", 256, 6, 8, [128, 190, 70, 100], 7),
    (8, 2, "shm-unordered", 256, 8, 8, [64, 96, 128, 80, 72, 110, 64, 90], 8),
    (8, 8, "shm", 256, 8, 8, [100, 64, 128, 72, 90, 64, 81, 120], 9),
    # DeepEP's internode shape of nodes: 2 nodes x 8 ranks (the forwarders of 16 ranks)
    (16, 8, "shm", 128, 8, 4, [40 + (r * 29) % 50 for r in range(16)], 10),
    (16, 8, "shm-unordered", 128, 6, 4, [30 + (r * 41) % 60 for r in range(16)], 11),
    # the nccl transport's protocol on its emulation: every peer through the proxies
    (4, 1, "nccl-emulated", 256, 8, 8, [120, 77, 190, 64], 12),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_ht_layout_dispatch_combine(case):
    world, rpn, transport, hidden, topk, per_rank, n_tokens, seed = case
    # In the (4, 2, shm) case no rank routes anything to rank 3; elsewhere only rank 0 avoids the last rank.
    starve = (world, rpn, transport) == (4, 2, "shm")
    out = run_ranks(
        w.ht_body,
        world,
        args=(rpn, transport, seed, n_tokens, hidden, topk, per_rank * world, 3, starve),
        timeout=150 + 30 * world,
    )
    _assert_clean(out, 60)


@pytest.mark.slow
@pytest.mark.parametrize("case", [CASES[3], CASES[5]], ids=[_id(CASES[3]), _id(CASES[5])])
def test_ht_over_the_transports_gpu_path(case):
    # Emulated device memory: the proxies' copies complete later, on worker threads (the CUDA-IPC code path).
    world, rpn, transport, hidden, topk, per_rank, n_tokens, seed = case
    out = run_ranks(
        w.ht_body,
        world,
        args=(rpn, transport, seed, n_tokens, hidden, topk, per_rank * world, 1),
        timeout=150 + 30 * world,
        env={"PORTEP_EMULATE_DEVICE_MEMORY": "1"},
    )
    _assert_clean(out, 60)
