"""The CUDA backend's normal (HT) mode on two GPUs: the host backend's whole HT suite (deepep_workers.ht_body) on
GPU tensors, through direct NVLink stores (one node) and through the forced proxy path (one GPU per node: FIFOs,
proxy threads, copy engines) over both shm transport modes; every output and handle entry against the host
backend's bit for bit, with large buffers and with small ones whose rings wrap; num_worst_tokens dispatch + combine
captured in a CUDA graph and replayed; normal and LL ops alternating on one Buffer; forwarding inside nodes of two
GPUs across two nodes (4 ranks: proxies between the nodes, forwarders storing to their node peer). Skipped without
the GPUs and the CUDA kernels (PORTEP_TEST_SHARE_GPU=1 lets the ranks share one GPU: correctness only)."""

import os

import pytest
import torch

from ci_expect import gpu_skip_reason
import deepep_workers as w
import gpu_ht_workers as g
from deepep_workers import assert_clean
from dist_util import run_ranks
from portep import native

SHARE = os.environ.get("PORTEP_TEST_SHARE_GPU") == "1"


def _gpus(n):
    return pytest.mark.skipif(
        not native.build_info()["gpu_built"]
        or not torch.cuda.is_available()
        or torch.cuda.device_count() < (1 if SHARE else n),
        reason=gpu_skip_reason(n),
    )


two_gpus = _gpus(2)
four_gpus = _gpus(4)

# (name, num_ranks_per_node, transport)
PATHS = [
    pytest.param(("direct-nvlink", 2, "shm"), id="direct-nvlink"),
    pytest.param(("proxy-shm", 1, "shm"), id="proxy-shm"),
    pytest.param(("proxy-shm-unordered", 1, "shm-unordered"), id="proxy-shm-unordered"),
]
# 2 nodes of 2 ranks: (name, num_ranks_per_node, transport) between the nodes
FORWARD_PATHS = [
    pytest.param(("forward-shm", 2, "shm"), id="forward-shm"),
    pytest.param(("forward-shm-unordered", 2, "shm-unordered"), id="forward-shm-unordered"),
]
# graph_body launches torch kernels of its own (the experts' outputs) while a num_worst_tokens dispatch still runs:
# with CUDA's lazy module loading such a first launch waits for the running kernels and holds up the shm proxies'
# copies they wait for (the README's rule for applications on the shm-GPU proxy path)
EAGER = {"CUDA_MODULE_LOADING": "EAGER"}
# hidden, num_topk, experts, tokens per rank, seed, starve_last
SUITE = [(512, 8, 16, [300, 211], 1, False), (2048, 6, 32, [97, 256], 2, True), (7168, 8, 64, [64, 130], 3, False)]


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", SUITE, ids=[f"H{c[0]}-K{c[1]}-E{c[2]}" for c in SUITE])
def test_ht_suite_on_gpus(path, case):
    _run_suite(2, path, case, timeout=400)


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("path", PATHS)
def test_ht_suite_at_deepep_shape(path):
    # DeepEP's normal-mode test shape: 4096 tokens of hidden 7168, 256 experts, top-8 (the host backend: CI)
    _run_suite(2, path, (7168, 8, 256, [4096, 4096], 4, False), timeout=600, pressure_runs=1)


def _run_suite(world, path, case, timeout, pressure_runs=2):
    """The host backend's HT suite (deepep_workers.ht_body) on `world` GPU ranks."""
    _, rpn, transport = path
    hidden, topk, experts, n_tokens, seed, starve = case
    out = run_ranks(
        w.ht_body,
        world,
        args=(rpn, transport, seed, n_tokens, hidden, topk, experts, pressure_runs, starve, "cuda"),
        timeout=timeout,
    )
    assert_clean(out, 60)


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("num_sms", [24, 2, 128])
def test_ht_cuda_matches_host_backend_bitwise(path, num_sms):
    _, rpn, transport = path
    out = run_ranks(
        g.cross_backend_body, 2, args=(rpn, transport, 11 + num_sms, [333, 150], 1024, 8, 32, num_sms), timeout=400
    )
    assert_clean(out, 30)


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("path", PATHS)
def test_ht_small_buffer_rings_wrap_bitwise(path):
    # 600064 bytes, 2 channels: rings of 64-128 rows; ~700 rows per channel wrap them many times (direct: a sender
    # waits for the reader's head; proxy: for its credits). Also the refusal of rows too large for any ring.
    _, rpn, transport = path
    out = run_ranks(g.cross_backend_body, 2, args=(rpn, transport, 9, [1500, 900], 1024, 8, 32, 4, 600064), timeout=400)
    assert_clean(out, 30)


@pytest.mark.gpu
@two_gpus
def test_normal_and_ll_modes_alternate_without_clean():
    out = run_ranks(g.mixed_modes_body, 2, args=(31, 4), timeout=300)
    assert_clean(out, 20)


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("path", PATHS)
def test_ht_rank_without_tokens_bitwise(path):
    # rank 0 sends nothing: its FP8 scales are empty (no address), yet it receives FP8 rows with scales laid out as
    # its peer lays them out (2026-12-06: the binding took the scale count from the address, 6cf60fd)
    _, rpn, transport = path
    out = run_ranks(g.cross_backend_body, 2, args=(rpn, transport, 21, [0, 150], 1024, 8, 32, 24), timeout=400)
    assert_clean(out, 30)


@pytest.mark.gpu
@two_gpus
def test_ht_odd_scale_count_bitwise():
    # hidden 1152: 9 FP8 scales per row, so a record's top-k ids follow an odd number of 4-byte scales
    out = run_ranks(g.cross_backend_body, 2, args=(2, "shm", 5, [97, 64], 1152, 8, 32, 24), timeout=400)
    assert_clean(out, 30)


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("path", PATHS[:2])
def test_ht_num_worst_tokens_cuda_graph_replay(path):
    _, rpn, transport = path
    out = run_ranks(g.graph_body, 2, args=(rpn, transport, 21, 200, 1024, 8, 32, 3), timeout=300, env=EAGER)
    assert_clean(out, 15)


FORWARD_SUITE = [(512, 8, 16, [300, 211, 97, 256], 41, False), (2048, 6, 32, [64, 130, 200, 77], 42, True)]


@pytest.mark.gpu
@four_gpus
@pytest.mark.parametrize("path", FORWARD_PATHS)
@pytest.mark.parametrize("case", FORWARD_SUITE, ids=[f"H{c[0]}-K{c[1]}-E{c[2]}" for c in FORWARD_SUITE])
def test_ht_forwarding_suite(path, case):
    _run_suite(4, path, case, timeout=500)


@pytest.mark.gpu
@four_gpus
@pytest.mark.parametrize("path", FORWARD_PATHS)
@pytest.mark.parametrize("num_sms", [24, 2])
def test_ht_forwarding_matches_host_backend_bitwise(path, num_sms):
    _, rpn, transport = path
    out = run_ranks(
        g.cross_backend_body,
        4,
        args=(rpn, transport, 51 + num_sms, [333, 150, 5, 271], 1024, 8, 32, num_sms),
        timeout=500,
    )
    assert_clean(out, 30)


@pytest.mark.gpu
@four_gpus
def test_ht_forwarding_small_buffer_rings_wrap_bitwise():
    # 6 MiB, 2 channels: forward and proxy rings of 64-128 rows, wrapped many times by blocks of 700-1500 rows
    out = run_ranks(
        g.cross_backend_body,
        4,
        args=(2, "shm-unordered", 19, [1500, 900, 1200, 700], 1024, 8, 32, 4, 6 << 20),
        timeout=500,
    )
    assert_clean(out, 30)


@pytest.mark.gpu
@four_gpus
def test_ht_forwarding_num_worst_tokens_cuda_graph_replay():
    out = run_ranks(g.graph_body, 4, args=(2, "shm", 23, 120, 1024, 8, 32, 2), timeout=500, env=EAGER)
    assert_clean(out, 15)


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("path", PATHS[:2])
def test_ht_missing_peer_times_out_once_and_raises(path):
    _, rpn, transport = path
    timeout_s = 3.0
    out = run_ranks(g.missing_peer_body, 2, args=(rpn, transport, timeout_s), timeout=120)
    message, took = out[0]
    assert "a kernel failed" in message and "peer rank 1" in message, message
    # the notify's one timeout, not another one per receiving block of the data kernel
    assert timeout_s * 0.9 <= took < 2 * timeout_s, took
