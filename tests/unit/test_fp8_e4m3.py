"""float32 -> FP8 E4M3 in integer arithmetic (gpu_kernels/fp8_e4m3.h), the conversion the AMD kernels use,
checked on the CPU against torch's float8_e4m3fn conversion and, past 448, against the saturation CUDA's
__NV_SATFINITE conversion does."""

import math

import pytest
import torch

from portep_testing import wire

MAX_E4M3 = 448.0


def _native(values):
    values = values.to(torch.float32).contiguous()
    out = wire.e4m3_from_float32(values.numpy())
    return torch.frombuffer(bytearray(out), dtype=torch.uint8)


def _torch(values):
    return values.to(torch.float32).to(torch.float8_e4m3fn).view(torch.uint8)


def _e4m3_values():
    """Every finite E4M3 value, as float64, ascending (both signs)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    v = codes.view(torch.float8_e4m3fn).to(torch.float64)
    return torch.unique(v[~torch.isnan(v)])


def test_every_float32_pattern_below_448_matches_torch_on_a_dense_sweep():
    # Every 61st bit pattern from 2^-13 up to 448 (a prime stride, so every mantissa residue is hit), both signs.
    lo = torch.tensor([2.0**-13], dtype=torch.float32).view(torch.int32).item()
    hi = torch.tensor([MAX_E4M3], dtype=torch.float32).view(torch.int32).item()
    bits = torch.arange(lo, hi, 61, dtype=torch.int32)
    values = bits.view(torch.float32)
    values = torch.cat([values, -values])
    got, want = _native(values), _torch(values)
    bad = torch.nonzero(got != want)[:, 0]
    assert bad.numel() == 0, (
        f"{bad.numel()} of {values.numel()} differ, e.g. {values[bad[:5]].tolist()}: "
        f"{got[bad[:5]].tolist()} vs torch {want[bad[:5]].tolist()}"
    )


def test_halfway_points_round_to_even_and_their_neighbours_round_to_nearest():
    grid = _e4m3_values()
    grid = grid[grid.abs() < MAX_E4M3]
    mids = ((grid[:-1] + grid[1:]) / 2).to(torch.float32)  # exact in float32
    assert torch.equal(mids.to(torch.float64), (grid[:-1] + grid[1:]) / 2)
    up = torch.nextafter(mids, torch.full_like(mids, math.inf))
    down = torch.nextafter(mids, torch.full_like(mids, -math.inf))
    for values in (mids, up, down):
        assert torch.equal(_native(values), _torch(values))
    # and the rule itself, independently of torch: the even neighbour (mantissa bit 0 clear) at a tie
    tie = _native(mids).view(torch.float8_e4m3fn).to(torch.float64)
    lower, upper = grid[:-1], grid[1:]
    even_lower = (lower.to(torch.float32).to(torch.float8_e4m3fn).view(torch.uint8) & 1) == 0
    assert torch.equal(tie, torch.where(even_lower, lower, upper))


def test_random_values_in_every_binade_match_torch():
    gen = torch.Generator().manual_seed(20261201)
    exps = torch.randint(-16, 9, (400_000,), generator=gen).to(torch.float32)
    mant = 1 + torch.rand(400_000, generator=gen)
    sign = torch.where(torch.rand(400_000, generator=gen) < 0.5, -1.0, 1.0)
    values = (sign * mant * torch.pow(2.0, exps)).to(torch.float32)
    values = values[values.abs() < MAX_E4M3]
    assert torch.equal(_native(values), _torch(values))


def test_tiny_values_and_zeros_keep_their_sign():
    values = torch.tensor(
        [
            0.0,
            -0.0,
            1e-45,
            -1e-45,
            2.0**-11,
            -(2.0**-11),
            2.0**-10,
            2.0**-10 * 1.0001,
            2.0**-9,
            3 * 2.0**-10,
            -3 * 2.0**-10,
            2.0**-6 - 2.0**-20,
        ],
        dtype=torch.float32,
    )
    assert _native(values).tolist() == [0x00, 0x80, 0x00, 0x80, 0x00, 0x80, 0x00, 0x01, 0x01, 0x02, 0x82, 0x08]
    assert torch.equal(_native(values), _torch(values))


def test_saturation_and_nan_as_cuda_satfinite():
    values = torch.tensor(
        [448.0, 449.0, 463.99, 464.0, 480.0, 1e30, math.inf, -448.0, -500.0, -math.inf], dtype=torch.float32
    )
    assert _native(values).tolist() == [0x7E] * 7 + [0xFE] * 3
    nan = _native(torch.tensor([math.nan, -math.nan], dtype=torch.float32))
    assert torch.isnan(nan.view(torch.float8_e4m3fn).to(torch.float32)).all()
    assert nan.tolist() == [0x7F, 0x7F]  # CUDA's NaN, whatever the input's sign


def test_non_float32_input_is_refused_naming_the_format():
    with pytest.raises(ValueError, match="float32"):
        wire.e4m3_from_float32(torch.zeros(4, dtype=torch.float64).numpy())
