"""LogFMT-10 low-latency combine (low_latency_combine(use_logfmt=True)) on the host backend, at 2 and 4 ranks, direct
(one node) and through the proxies on both shm transports: every combined row against the float64 LogFMT reference
(ll_logfmt_workers.py), DeepEP's calc_diff threshold against the unquantized sum, and the zero_copy refusal."""

import pytest

import ll_logfmt_workers as lw
from deepep_workers import assert_clean
from dist_util import run_ranks

# world, ranks per node, transport, T, hidden, experts, top-k, seed; hidden 2560 has 512-channel chunks
CASES = [
    pytest.param(2, 1, "shm", 12, 2048, 8, 4, 31, id="2-ranks-proxy-shm"),
    pytest.param(2, 2, "shm-unordered", 12, 2048, 8, 4, 32, id="2-ranks-direct"),
    pytest.param(4, 1, "shm-unordered", 8, 2560, 16, 4, 33, id="4-ranks-proxy-shm-unordered-h2560"),
    pytest.param(4, 2, "shm", 8, 4096, 16, 8, 34, id="4-ranks-2-nodes-shm-h4096"),
    # the models' shapes at LL's 128 tokens: DeepSeek-V3 (hidden 7168, 256 experts, top-8), Qwen3-235B (4096, 128)
    pytest.param(2, 1, "shm-unordered", 128, 7168, 256, 8, 35, id="deepseek-v3-proxy"),
    pytest.param(2, 2, "shm", 128, 4096, 128, 8, 36, id="qwen3-235b-direct"),
]


@pytest.mark.parametrize("world,rpn,transport,T,hidden,experts,topk,seed", CASES)
def test_ll_logfmt_combine(world, rpn, transport, T, hidden, experts, topk, seed):
    out = run_ranks(
        lw.logfmt_body, world, args=(rpn, transport, seed, T, hidden, experts, topk), timeout=300 + 30 * world
    )
    assert_clean(out, 18)


@pytest.mark.parametrize("hidden,limit", [(1024, "2048"), (16896, "16384")], ids=["below-2048", "33-chunks"])
def test_ll_logfmt_refuses_a_hidden_outside_the_format(hidden, limit):
    out = run_ranks(lw.small_hidden_body, 2, args=(hidden,), timeout=180)
    for rank, message in out.items():
        assert f"hidden={hidden}" in message and limit in message, f"rank {rank}: {message}"
