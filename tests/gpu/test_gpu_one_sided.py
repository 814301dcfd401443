"""One-sided failures on the CUDA backend as a DeepEP user meets them (gpu_one_sided_workers.py): a bad input on one
rank, a peer later than the timeout, a peer whose process dies; each rank calls the Buffer as a model does, and on
every rank no call returns without raising unless each output is exactly right or poisoned (NaN rows, count -1),
and the ranks recover after clean_low_latency_buffer. At DeepSeek-V3's LL shape and a small one, on the direct path
and the proxy path over both shm modes. Skipped without the CUDA kernels and two GPUs (PORTEP_TEST_SHARE_GPU=1:
one, shared)."""

import os

import pytest
import torch

from ci_expect import gpu_skip_reason
import gpu_one_sided_workers as o
from deepep_workers import assert_clean
from dist_util import run_ranks
from portep import native

GPUS_NEEDED = 1 if os.environ.get("PORTEP_TEST_SHARE_GPU") == "1" else 2
two_gpus = pytest.mark.skipif(
    not native.build_info()["gpu_built"] or not torch.cuda.is_available() or torch.cuda.device_count() < GPUS_NEEDED,
    reason=gpu_skip_reason(2),
)

# (name, num_ranks_per_node, transport, allow_nvlink_for_low_latency_mode)
PATHS = [("direct", 2, "shm", True), ("proxy-shm", 1, "shm", True), ("proxy-unordered", 2, "shm-unordered", False)]
SHAPES = {"deepseek": (128, 7168, 256, 8), "small": (64, 2048, 32, 4)}  # T, hidden, experts, top-k


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
@pytest.mark.parametrize("path", PATHS, ids=[p[0] for p in PATHS])
def test_an_expert_id_out_of_range_on_one_rank_never_desynchronises(path, shape):
    _, rpn, transport, nvlink = path
    out = run_ranks(o.bad_input_body, 2, args=(rpn, transport, nvlink, 71, SHAPES[shape]), timeout=300)
    assert_clean(out, 10)


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
@pytest.mark.parametrize("path", PATHS, ids=[p[0] for p in PATHS])
def test_a_peer_late_past_the_timeout_gives_poison_or_errors_never_wrong_data(path, shape):
    _, rpn, transport, nvlink = path
    out = run_ranks(o.late_peer_body, 2, args=(rpn, transport, nvlink, 73, SHAPES[shape], 3.0, 6.0), timeout=300)
    assert_clean(out, 10)


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("path", PATHS, ids=[p[0] for p in PATHS])
def test_a_dead_peer_gives_the_survivors_poison_then_an_error(path):
    _, rpn, transport, nvlink = path
    out = run_ranks(
        o.dead_peer_body, 2, args=(rpn, transport, nvlink, 79, SHAPES["small"]), timeout=300, expect_missing=(1,)
    )
    assert_clean({k: v for k, v in out.items() if k != 1}, 5)


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("path", [(2, "shm"), (1, "shm"), (1, "shm-unordered")], ids=["direct", "proxy", "unordered"])
def test_normal_mode_with_a_late_peer_gives_poison_or_errors_never_wrong_data(path):
    rpn, transport = path
    out = run_ranks(o.ht_late_peer_body, 2, args=(rpn, transport, 83, (4096, 7168, 256, 8), 3.0, 6.0), timeout=300)
    assert_clean(out, 4)


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("path", PATHS, ids=[p[0] for p in PATHS])
def test_a_caller_that_skips_a_call_after_a_dropped_input_gets_poison_never_wrong_data(path):
    _, rpn, transport, nvlink = path
    out = run_ranks(o.bad_input_skipping_body, 2, args=(rpn, transport, nvlink, 89, SHAPES["small"], 3.0), timeout=300)
    assert_clean(out, 10)
