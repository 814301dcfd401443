"""Clients of the `deep_ep` drop-in modelled on how vLLM, LMDeploy/DLBlas, xtuner and SGLang (V1 API) call DeepEP,
written from their call patterns (not copied), on portep's host backend (CPU tensors, gloo), two ranks each.

Modelled: vLLM's all-keyword constructor and size hint, its WeakValueDictionary of Buffers, LL rounds with receive
hooks and combine into out=, normal mode by keyword with the tuned configs, a clean_low_latency_buffer at each mode
switch, get_local_buffer_tensor, a shrink-mode Buffer's mask calls; LMDeploy/DLBlas's set_num_sms, TypeError-fallback
constructor, the attributes it reads, capture() and an FP8 LL dispatch unpacked as (fp8, scales); xtuner's
autograd.Function that saves the normal-mode handle with ctx.save_for_backward and combines the gradients with it;
SGLang's Config(**json), class-level capture() and num_sms, expert_alignment=128, async LL dispatch, keyword LL
combine, and the TypeError retry when use_nvfp4 is refused.

Checked, on every rank, against the independent references of deepep_reference.py (through deepep_workers' checks):
dispatched rows, counts and handles exactly, combined rows (and gradients) within BF16 rounding of float64 sums
(tests/support/client_pattern_workers.py).
"""

import pytest

import client_pattern_workers as cp
from deepep_workers import assert_clean
from dist_util import run_ranks

WORLD = 2


@pytest.mark.slow
def test_vllm_ll_and_normal_mode():
    out = run_ranks(cp.vllm_body, WORLD, args=(21,), timeout=240)
    assert_clean(out, 110)


@pytest.mark.slow
def test_lmdeploy_dlblas_fp8_ll():
    out = run_ranks(cp.lmdeploy_body, WORLD, args=(22,), timeout=240)
    assert_clean(out, 70)


@pytest.mark.slow
def test_xtuner_handle_through_autograd():
    out = run_ranks(cp.xtuner_body, WORLD, args=(23,), timeout=240)
    assert_clean(out, 20)


@pytest.mark.slow
def test_sglang_v1_config_alignment_and_ll():
    out = run_ranks(cp.sglang_body, WORLD, args=(24,), timeout=240)
    assert_clean(out, 75)
