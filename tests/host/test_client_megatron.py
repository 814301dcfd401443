"""A client of the `deep_ep` drop-in modelled on NVIDIA Megatron-core's fused_a2a (DeepEP V1 normal mode): a cached
Buffer sized from the dispatch/combine configs' NVL hints, FusedDispatch (layout + dispatch forward, combine of the
gradients backward) and FusedCombine (combine forward, cached dispatch backward) autograd Functions around per-rank
float32 experts, on the host backend (CPU tensors, gloo).

Each case is one spawned run of `world` ranks (one node) that runs the MoE layer forward and backward twice and
checks, on every rank, the output and the gradients of x, token_probs and each local expert's weight against an
independent float64 reference of the whole layer over all ranks' inputs, the per-expert receive counts, and that the
output check fails against a reference with two experts' weights swapped (tests/support/client_megatron_workers.py).
"""

import pytest

from client_megatron_workers import megatron_body
from deepep_workers import assert_clean
from dist_util import run_ranks

# world, tokens per rank, hidden, experts per rank, top-k, seed
CASES = [(2, 64, 256, 8, 4, 11), (4, 64, 256, 8, 4, 12)]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}ranks" for c in CASES])
def test_megatron_fused_a2a_moe_layer(case):
    world, n, hidden, experts_per_rank, topk, seed = case
    out = run_ranks(megatron_body, world, args=(seed, n, hidden, experts_per_rank, topk), timeout=150 + 30 * world)
    # per iteration: the cached Buffer, the counts, out, x.grad, token_probs.grad and each W grad (2 checks each:
    # dtype/shape, values), the swapped-experts reference
    assert_clean(out, 2 * (1 + 2 * 3 + 2 * experts_per_rank + 1 + 1))
