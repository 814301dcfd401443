"""DeepEP V1 low-latency mode of portep.Buffer on the host backend: low_latency_dispatch (BF16, FP8, FP8 with
round_scale, UE8M0; with and without the receive hook; one or two dispatches in a row), low_latency_combine
(identity expert, zero_copy, out=, invalid rows poisoned with NaN), clean_low_latency_buffer, the cumulative
stats, and bitwise reproducibility, against the references in deepep_reference.py.
"""

import pytest

import deepep_workers as w
from dist_util import run_ranks
from deepep_workers import case_id as _id, assert_clean as _assert_clean

# world, ranks_per_node, transport, T (num_max_dispatch_tokens_per_rank), hidden, experts, top-k, seed
CASES = [
    (2, 1, "shm", 64, 512, 16, 8, 11),
    (2, 1, "shm-unordered", 48, 512, 8, 4, 12),
    (2, 2, "shm-unordered", 64, 512, 12, 6, 13),
    (4, 1, "shm", 48, 512, 24, 6, 14),
    (4, 2, "shm-unordered", 48, 512, 32, 8, 15),
    (4, 4, "shm", 32, 512, 16, 4, 16),
    (8, 1, "shm-unordered", 32, 512, 32, 8, 17),
    (8, 8, "shm", 32, 512, 64, 6, 18),
    # the nccl transport's protocol (immediates as records in the receiver's window) on its emulation
    (4, 1, "nccl-emulated", 32, 512, 16, 8, 19),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_ll_dispatch_combine(case):
    world, rpn, transport, T, hidden, experts, topk, seed = case
    out = run_ranks(w.ll_body, world, args=(rpn, transport, seed, T, hidden, experts, topk), timeout=150 + 30 * world)
    _assert_clean(out, 100)


@pytest.mark.slow
@pytest.mark.parametrize("case", [CASES[1], CASES[4]], ids=[_id(CASES[1]), _id(CASES[4])])
def test_ll_over_the_transports_gpu_path(case):
    # Emulated device memory: the proxies' copies complete later, on worker threads (the CUDA-IPC code path).
    world, rpn, transport, T, hidden, experts, topk, seed = case
    out = run_ranks(
        w.ll_body,
        world,
        args=(rpn, transport, seed, T, hidden, experts, topk),
        timeout=150 + 30 * world,
        env={"PORTEP_EMULATE_DEVICE_MEMORY": "1"},
    )
    _assert_clean(out, 100)


@pytest.mark.slow
def test_ll_ranks_with_fewer_tokens_than_the_maximum():
    # Rank r dispatches T - 3r - 1 tokens (num_max_dispatch_tokens_per_rank is the same everywhere).
    out = run_ranks(w.ll_body, 4, args=(2, "shm-unordered", 21, 40, 512, 16, 5, True, 1), timeout=240)
    _assert_clean(out, 100)


def _deepep_size_hint(T, H, E):
    """DeepEP's get_low_latency_rdma_size_hint (deepep-api.md §1.3)."""
    disp = 16 + max(2 * H, H + 4 * H // 128)
    comb = 4 * H // 128 + 2 * H
    send = max(T * disp, E * T * comb)
    recv = max(E * T * disp, E * T * comb)
    total = 2 * send + 2 * recv + 2 * ((4 * E + 127) // 128 * 128)
    return (total + 128) // 128 * 128


def test_low_latency_rdma_size_hint_matches_deepep():
    import portep

    assert [round(_deepep_size_hint(T, 7168, E) / 1e6, 1) for T, E in ((128, 288), (128, 256), (256, 256))] == [
        2147.0,
        1908.4,
        3816.8,
    ]  # the documented examples (2146.96, 1908.4, 3816.8 MB)
    for T, H, E, R in (
        (128, 7168, 288, 8),
        (128, 7168, 256, 16),
        (256, 4096, 64, 4),
        (64, 512, 16, 2),
        (32, 512, 64, 8),
        (1, 2048, 3, 3),
    ):
        assert portep.Buffer.get_low_latency_rdma_size_hint(T, H, R, E) == _deepep_size_hint(T, H, E), (T, H, E, R)


@pytest.mark.parametrize("case", [(2, 1, "shm", 21), (4, 2, "shm-unordered", 22)], ids=["2x1-shm", "4x2-unordered"])
def test_ll_combine_sums_per_owner_rank_then_over_ranks(case):
    # the order the CUDA backend's partial sums between direct peers need, bit for bit
    import ll_order_workers as o

    world, rpn, transport, seed = case
    out = run_ranks(o.combine_order_body, world, args=(rpn, transport, seed, 48, 1024, 8 * world, 8), timeout=200)
    _assert_clean(out, 1)
    assert sum(res["order_sensitive"] for res in out.values()) > 0, "these inputs cannot tell the orders apart"
