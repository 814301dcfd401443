"""The DeepEP V1 suites (deepep_workers.ll_body / ht_body) on the host backend at the shapes real models use, where
small shapes hide what large ones show: several proxy chunks of 32 local experts and a last partial one, rows of
7168 BF16 values, 4096-token normal-mode batches.

- LL, 128 tokens, top-8: DeepSeek-V3's hidden 7168 with DeepEP's test default of 288 experts (144 local at EP2,
  every peer through the proxies, unordered) and with its 256 experts at EP4 (64 local, half the peers direct);
  hidden 4096 with 160 experts (80 local at EP2: two chunks and a half).
- HT, 4096 tokens, hidden 7168, 256 experts, top-8 (DeepEP's normal-mode test shape), every peer through the proxies.
The CUDA backend runs the same shapes in test_gpu_ll.py / test_gpu_ht.py.
"""

import pytest

import deepep_workers as w
from deepep_workers import assert_clean
from dist_util import run_ranks

# world, ranks_per_node, transport, T, hidden, experts, top-k, seed
LL_SHAPES = [
    (2, 1, "shm-unordered", 128, 7168, 288, 8, 41),
    (4, 2, "shm", 128, 7168, 256, 8, 42),
    (2, 1, "shm", 128, 4096, 160, 8, 43),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", LL_SHAPES, ids=[f"{c[0]}ranks-{c[1]}pernode-{c[2]}-H{c[4]}-E{c[5]}" for c in LL_SHAPES]
)
def test_ll_at_production_shapes(case):
    world, rpn, transport, T, hidden, experts, topk, seed = case
    out = run_ranks(w.ll_body, world, args=(rpn, transport, seed, T, hidden, experts, topk, False, 1), timeout=600)
    assert_clean(out, 5000)


@pytest.mark.slow
def test_ht_at_deepep_shape():
    out = run_ranks(
        w.ht_body, 2, args=(1, "shm-unordered", 44, [4096, 4096], 7168, 8, 256, 1, False, "host", int(2e9)), timeout=600
    )
    assert_clean(out, 150)
