"""DeepEP V2's ElasticBuffer on the CUDA backend: the host suite's rank body (elastic_workers.elastic_body: every
output of dispatch, expanded, cached and cached-expanded dispatches and of plain and expanded combines bitwise
against elastic_ref.py) with GPU tensors, through the direct path (one node), the proxies (one rank per node) and
hybrid routing (2 nodes x 2), at a small shape (with ranks that receive one row or none) and at DeepSeek-V3's and
Qwen3-235B's decode shapes, and DeepSeek-V3's prefill shape on the direct path; and dispatches without CPU sync
with their combines captured in a CUDA graph and replayed on new inputs. Skipped without the GPUs and the CUDA
kernels."""

import os

import pytest
import torch

import elastic_workers as w
from ci_expect import gpu_skip_reason
from deepep_workers import assert_clean
from dist_util import run_ranks
from portep import native

SHARED = os.environ.get("PORTEP_TEST_SHARE_GPU") == "1"  # every rank on GPU 0 (time-sliced: correctness only)
MODES = [
    dict(fp8=0, alignment=4, bias=2, weights=1),
    dict(fp8=1, alignment=128, bias=1, weights=0, events="async", copy=False),
    dict(fp8=1, sf="int", alignment=8, bias=0, weights=1, cpu_sync=False, events="previous"),
]


def _gpus(n):
    want = 1 if SHARED else n
    ok = native.build_info()["gpu_built"] and torch.cuda.is_available() and torch.cuda.device_count() >= want
    return pytest.mark.skipif(not ok, reason=gpu_skip_reason(n))


# name, world, ranks per node, transport, allow_hybrid_mode, allow_multiple_reduction
PATHS = [
    ("direct", 2, 2, "shm", True, True),
    ("proxy-shm", 2, 1, "shm", True, True),
    ("hybrid-2x2-shm-unordered", 4, 2, "shm-unordered", True, True),
    ("direct-4-no-multiple-reduction", 4, 4, "shm", True, False),
]
# tokens per rank, hidden, top-k, experts (per 2 ranks: scaled with the world)
SHAPES = [
    pytest.param((40, 256, 4, 8), id="small"),
    pytest.param((128, 7168, 8, 128), id="deepseek-v3-decode"),
    pytest.param((128, 4096, 8, 64), id="qwen3-235b-decode"),
]


@pytest.mark.gpu
@_gpus(4)
@pytest.mark.parametrize("path", PATHS, ids=[p[0] for p in PATHS])
@pytest.mark.parametrize("shape", SHAPES)
def test_elastic_on_cuda(path, shape):
    _, world, rpn, transport, hybrid, multi = path
    tokens, hidden, topk, experts_per_2 = shape
    experts = experts_per_2 * world // 2
    n_tokens = [tokens - (r * 3) % 7 for r in range(world)]
    modes = MODES + [dict(fp8=0, alignment=1, bias=1, weights=1, skew=True)] if tokens <= 64 else MODES[:2]
    out = run_ranks(
        w.elastic_body,
        world,
        args=(rpn, transport, hybrid, multi, (n_tokens, hidden, topk, experts), modes, 51, "cuda"),
        timeout=900,
    )
    assert_clean(out, 40 * len(modes))


@pytest.mark.gpu
@_gpus(2)
def test_elastic_on_cuda_at_deepseek_v3_prefill():
    """DeepSeek-V3's prefill shape as DeepEP tests it (4096 tokens per rank, hidden 7168, top-8, 256 experts) on
    the direct path, one BF16 mode with both biases and weights back: the reference runs on the CPU, so one mode."""
    out = run_ranks(
        w.elastic_body,
        2,
        args=(2, "shm", True, True, ([4096, 4090], 7168, 8, 256), MODES[:1], 53, "cuda"),
        timeout=1200,
    )
    assert_clean(out, 40)


GRAPH_PATHS = [PATHS[0], PATHS[2], PATHS[3]]


@pytest.mark.gpu
@_gpus(4)
@pytest.mark.parametrize("path", GRAPH_PATHS, ids=[p[0] for p in GRAPH_PATHS])
def test_elastic_cuda_graph_replays_new_inputs(path):
    _, world, rpn, transport, hybrid, multi = path
    n_tokens = [37 - (r * 5) % 9 for r in range(world)]
    out = run_ranks(
        w.graph_body, world, args=(rpn, transport, hybrid, multi, (n_tokens, 256, 4, 8 * world), 71), timeout=900
    )
    assert_clean(out, 60)
