"""The host backend's LL FP8 cast (backends/host/ll.py per_token_cast, whose bits the CUDA kernel's equal: the
GPU cross-backend tests) against DeepEP's formula as tests/support/deepep_reference.py writes it, bit for bit, on
rows that reach its edges: amax an exact 448 * 2^k (round_scale's power of two), amax below the 1e-4 clamp,
scaled values in E4M3's subnormal range, and random rows."""

import pytest
import torch

import deepep_reference as ref
from portep.backends.host.ll import per_token_cast

BF16 = torch.bfloat16
H = 512  # four groups of 128 channels


def _edge_rows():
    g = torch.Generator().manual_seed(11)
    rows = [torch.randn(H, generator=g) * 0.01 for _ in range(6)]
    for group in range(H // 128):
        k = group - 2  # amax = 448 * 2^k, k in -2..1: stored scale exactly 2^k
        rows[0][group * 128] = 448.0 * 2.0**k
    rows[1] = torch.full((H,), 3e-5) * torch.sign(torch.randn(H, generator=g))  # amax below the clamp
    rows[2][::128] = 448.0  # the others scale to E4M3 subnormals (below 2^-6)
    rows[2][1::128] = -(2.0**-8)
    rows[3] = -rows[3].abs()  # all negative
    rows[4][::64] = 1.0 + 2.0**-7  # amax just above a power of two
    rows[5][::64] = 448.0 * (1 - 2.0**-8)  # amax just below 448
    random = torch.randn(64, H, generator=g) * torch.logspace(-3, 3, 64).unsqueeze(1)
    return torch.cat([torch.stack(rows), random]).to(BF16)


@pytest.mark.parametrize("round_scale", [False, True], ids=["amax-scale", "round-scale"])
def test_host_cast_is_deepeps_bit_for_bit(round_scale):
    x = _edge_rows()
    q, scales = per_token_cast(x, round_scale)
    stored, multiplier = ref.ll_fp8_scales_ref(x, round_scale)
    assert torch.equal(scales, stored), (scales != stored).nonzero()[:4].tolist()
    want = (x.float().view(x.size(0), -1, 128) * multiplier.unsqueeze(2)).to(torch.float8_e4m3fn).view(x.shape)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
    assert not ref.e4m3_rounding_mismatch(q.float(), x, multiplier).any()
    if round_scale:
        mantissa, _ = torch.frexp(scales)
        assert bool((mantissa == 0.5).all())  # powers of two


def test_an_exponent_off_by_one_is_caught():
    x = _edge_rows()
    q, scales = per_token_cast(x, True)
    stored, multiplier = ref.ll_fp8_scales_ref(x, True)
    assert not torch.equal(scales * 2, stored)
    halved = (x.float().view(x.size(0), -1, 128) * (multiplier / 2).unsqueeze(2)).to(torch.float8_e4m3fn)
    assert ref.e4m3_rounding_mismatch(halved.view(x.shape).float(), x, multiplier).any()
