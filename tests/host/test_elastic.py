"""DeepEP V2's ElasticBuffer on the host backend: dispatch (BF16 and FP8 with float32 or packed-int32 scale factors,
plain, expanded, cached, cached expanded with zero padding, alignment 1 to 128, with and without a CPU sync, the
three stream modes, do_handle_copy on and off) and combine (0 to 2 biases, weights back, plain and expanded, V2's
reduction order for direct and hybrid routing, with and without multiple reduction), each output bitwise against
elastic_ref.py, at 2, 4, 12 and 16 ranks, one node and several, on both shm transports."""

import pytest

import elastic_workers as w
from deepep_workers import assert_clean
from dist_util import run_ranks

MODES = [
    dict(fp8=0, alignment=4, bias=2, weights=1),
    dict(fp8=1, alignment=1, bias=1, weights=0, events="async", copy=False),
    dict(fp8=1, sf="int", alignment=8, bias=0, weights=1, cpu_sync=False, events="previous"),
    dict(fp8=0, alignment=128, bias=1, weights=1, cpu_sync=False, events="async"),
]


def _tokens(world, base=37):
    return [base + (r * 29) % 23 for r in range(world)]


# world, ranks per node, transport, allow_hybrid_mode, allow_multiple_reduction, (tokens, hidden, top-k, experts)
CASES = [
    (2, 2, "shm", True, True, (_tokens(2), 256, 4, 16)),
    (2, 1, "shm-unordered", True, True, (_tokens(2), 256, 6, 16)),
    (4, 2, "shm", True, True, (_tokens(4), 256, 8, 32)),
    (4, 2, "shm-unordered", False, False, (_tokens(4), 256, 6, 32)),
    (4, 2, "shm", True, False, (_tokens(4), 128, 4, 16)),
    (4, 4, "shm-unordered", True, True, (_tokens(4), 256, 8, 64)),
]


def _id(case):
    world, rpn, transport, hybrid, multi, _ = case
    return f"{world}ranks-{rpn}pernode-{transport}-hybrid{int(hybrid)}-multi{int(multi)}"


def _run(case, modes, seed, timeout=300):
    world, rpn, transport, hybrid, multi, shape = case
    out = run_ranks(w.elastic_body, world, args=(rpn, transport, hybrid, multi, shape, modes, seed), timeout=timeout)
    assert_clean(out, 40 * len(modes))


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_elastic_dispatch_combine(case):
    _run(case, MODES, 11)


def test_elastic_zero_tokens_and_a_node_that_receives_nothing():
    # rank 1 sends nothing; every token goes to one node only, chosen per token, so some node may get nothing of a
    # rank's; with 3 nodes of 2 and tokens limited to 1 node, each node misses most ranks' tokens.
    tokens = [41, 0, 33, 27, 19, 36]
    modes = [dict(m, nodes=(3, 2, 1)) for m in MODES[:3]]
    _run((6, 2, "shm", True, True, (tokens, 256, 4, 24)), modes, 23)


@pytest.mark.parametrize("hybrid,multi", [(True, True), (True, False)])
def test_elastic_fixed_capacity_calls_repeat_on_new_inputs(hybrid, multi):
    # graph_body as the CUDA-graph test runs it, with the calls repeated instead of replayed: 4 ranks, 2 nodes
    n_tokens = [37 - (r * 5) % 9 for r in range(4)]
    out = run_ranks(w.graph_body, 4, args=(2, "shm-unordered", hybrid, multi, (n_tokens, 256, 4, 32), 71, "host"))
    assert_clean(out, 60)


def test_elastic_ranks_that_receive_one_row_or_none():
    # every expert on rank 0 but one slot on rank 1: rank 1 receives one row, ranks 2 and 3 none, with column
    # counts of both parities (K = 6 BF16: 7 dispatch columns; K = 5: 6) and 1-row / 0-row return trips
    modes = [dict(m, skew=True) for m in MODES[:3]]
    _run((4, 2, "shm", True, True, (_tokens(4), 128, 6, 32)), modes, 61)
    _run((4, 4, "shm-unordered", True, False, (_tokens(4), 128, 5, 32)), modes, 62)


def test_elastic_deterministic_orders_by_global_index_across_nodes():
    world, rpn, transport, hybrid, multi, shape = (4, 2, "shm", True, True, (_tokens(4), 256, 6, 32))
    out = run_ranks(
        w.elastic_body,
        world,
        args=(rpn, transport, hybrid, multi, shape, MODES[:2], 71, "host", True),
        timeout=300,
    )
    assert_clean(out, 80)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        (16, 8, "shm", True, True, (_tokens(16, 24), 128, 8, 64)),
        (16, 8, "shm-unordered", True, False, (_tokens(16, 24), 128, 6, 32)),
        (12, 4, "shm", True, True, (_tokens(12, 24), 128, 8, 48)),
    ],
    ids=["16ranks-8pernode-shm", "16ranks-8pernode-shm-unordered", "12ranks-4pernode-shm"],
)
def test_elastic_many_ranks(case):
    _run(case, MODES[:2], 31, timeout=900)


@pytest.mark.slow
def test_elastic_qwen3_decode_shape():
    # Qwen3-235B's hidden size, experts and top-8, a 128-token decode batch per rank
    _run((2, 2, "shm", True, True, ([128, 121], 4096, 8, 128)), MODES[:2], 41, timeout=900)
