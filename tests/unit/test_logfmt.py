"""LogFMT-10 rows (gpu_kernels/logfmt.h, gpu_kernels/host/logfmt_rows.cpp) against the independent float64
reference (tests/support/logfmt_ref.py): metadata, cast decisions, BF16 fallback chunks and signs exactly; codes
exactly but for rare off-by-one at level boundaries (FP32 logs against float64); decoded values; the sequence number
in the metadata; DeepEP's sizes; refusals."""

import pytest
import torch

import logfmt_ref as ref
from portep import native

SEQ = 0xDEADBEEF


def _rows(H, seed):
    """Rows that tell the format's cases apart: mostly castable (small randn), DeepEP's mix of cast and BF16 chunks,
    a group with |x| >= 1, an all-zero group, a constant-magnitude group, zeros and a NaN inside castable groups."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(H, generator=g) * 0.1]
    rows += [torch.randn(H, generator=g) * 0.5 * float(torch.rand(1, generator=g)) for _ in range(3)]
    big = torch.randn(H, generator=g) * 0.05
    big[130] = 3.0  # group 1 (and its chunk) cannot be cast
    big[-128:] = 0.0  # the last group all zero
    big[256:384] = -0.25  # group 2: one magnitude
    big[700] = 0.0  # a zero inside a castable group: its range is clipped to 32 binades
    big[H - 600] = float("nan")
    rows.append(big)
    return torch.stack(rows).to(torch.bfloat16)


def _encode(x, seq=SEQ):
    n, H = x.shape
    pitch = int(native.logfmt_layout(H)["max_row_bytes"])
    out = torch.full((n, pitch), 0xA5, dtype=torch.uint8)  # stale bytes: the encoder must not depend on zeros
    idx = torch.arange(n, dtype=torch.int64)
    native.logfmt_encode_rows(out, pitch, idx, x.view(torch.uint8), 2 * H, idx, H, seq)
    return out


def _decode(rows, H):
    """The native decoder's FP32 values (through reduce_rows with weight 1), as float64."""
    n, pitch = rows.shape
    out = torch.empty(n, H, dtype=torch.float32)
    idx = torch.arange(n, dtype=torch.int64)
    native.reduce_rows(out, 4 * H, native.ROW_F32, n, H, [(rows, pitch, native.ROW_LOGFMT, idx, None)])
    return out.double()


@pytest.mark.parametrize("H", [2048, 2560, 4096, 7168])
def test_encoding_matches_the_reference(H):
    x = _rows(H, H)
    rows = _encode(x)
    chunk = ref.chunk_of(H)
    code_mismatches = 0
    saw = {"cast": 0, "bf16": 0}
    for i in range(x.size(0)):
        meta, cast, codes, signs, _, _ = ref.analyse(x[i])
        got_meta, seq, got_cast, got_codes, got_signs, plain = ref.parse_row(rows[i], H)
        assert seq == SEQ
        assert torch.equal(got_meta, meta), f"row {i}: metadata"
        assert torch.equal(got_cast, cast), f"row {i}: cast decisions"
        saw["cast"] += int(cast.sum())
        saw["bf16"] += int((~cast).sum())
        for c, data in plain.items():
            assert torch.equal(data, x[i, c * chunk : (c + 1) * chunk].view(torch.uint8)), f"row {i} chunk {c}"
        in_cast = cast.repeat_interleave(chunk)
        assert torch.equal(got_signs[in_cast], signs[in_cast]), f"row {i}: signs"
        diff = (got_codes - codes)[in_cast]
        assert int(diff.abs().max()) <= 1 if diff.numel() else True, f"row {i}: a code off by more than one level"
        code_mismatches += int((diff != 0).sum())
    assert saw["cast"] > 0 and saw["bf16"] > 0, saw  # the inputs exercise both kinds of chunk
    assert code_mismatches <= x.numel() // 1000, f"{code_mismatches} codes differ from the float64 reference"


@pytest.mark.parametrize("H", [2048, 7168])
def test_decoding_matches_the_reference_and_error_bound(H):
    x = _rows(H, 7 + H)
    rows = _encode(x)
    got = _decode(rows, H)
    for i in range(x.size(0)):
        meta, cast, codes, signs, lmin, step = ref.analyse(x[i])
        _, _, _, got_codes, got_signs, _ = ref.parse_row(rows[i], H)
        want = ref.decode_codes(got_codes, got_signs, lmin, step)  # the row's own codes, decoded in float64
        in_cast = cast.repeat_interleave(ref.chunk_of(H))
        torch.testing.assert_close(got[i][in_cast], want[in_cast], rtol=2e-6, atol=0)
        plain = ~in_cast & ~torch.isnan(x[i].double())
        assert torch.equal(got[i][plain], x[i].double()[plain]), f"row {i}: BF16 chunks must pass unchanged"
        # quantization error: half a level (relative) for values above the range's floor, as the format promises
        xv = x[i].double()
        s = step.repeat_interleave(128)
        floor = torch.exp2(lmin.repeat_interleave(128))
        live = in_cast & (xv.abs() >= floor) & ~torch.isnan(xv)
        bound = (torch.exp2(s) - 1) / (torch.exp2(s) + 1) * xv.abs() * 1.001 + 1e-30
        assert bool(((got[i] - xv).abs()[live] <= 2 * bound[live]).all()), f"row {i}: error above the bound"
    q = torch.stack([ref.quantize(r) for r in x])
    assert ref.calc_diff(torch.nan_to_num(q), torch.nan_to_num(got)) < 1e-6


def test_sequence_number_rides_in_the_metadata_only():
    H = 4096
    x = _rows(H, 3)
    a, b = _encode(x, seq=0), _encode(x, seq=0xFFFFFFFF)
    assert not torch.equal(a, b)
    torch.testing.assert_close(_decode(a, H), _decode(b, H), rtol=0, atol=0, equal_nan=True)  # values unchanged
    n = x.size(0)
    for seq, rows in ((0, a), (0xFFFFFFFF, b), (SEQ, _encode(x))):
        out = torch.empty(n, dtype=torch.int32)
        idx = torch.arange(n, dtype=torch.int64)
        native.logfmt_row_seqs(out, rows, rows.size(1), idx, H)
        assert (out.to(torch.int64) & 0xFFFFFFFF).tolist() == [seq] * n


def test_sizes_are_deepeps():
    # (hidden, chunk, metadata bytes, fully cast row bytes, combine slot bytes): DeepEP's table
    table = [
        (2048, 1024, 64, 2624, 4160),
        (2560, 512, 80, 3280, 5200),
        (4096, 1024, 128, 5248, 8320),
        (7168, 1024, 224, 9184, 14560),
        (8192, 1024, 256, 10496, 16640),
    ]
    for H, chunk, meta, cast_row, slot in table:
        lay = native.logfmt_layout(H)
        assert (lay["ok"], lay["chunk"], lay["meta_bytes"], lay["cast_row_bytes"], lay["max_row_bytes"]) == (
            True,
            chunk,
            meta,
            cast_row,
            slot,
        )
        assert native.ll_layout(1, H, 8, 1).comb == slot


def test_rows_outside_the_tensors_are_refused():
    """The native operations check every row against the tensors they were given (no addresses cross)."""
    H = 2048
    x = _rows(H, 1)[:2]
    pitch = int(native.logfmt_layout(H)["max_row_bytes"])
    out = torch.zeros(2, pitch, dtype=torch.uint8)
    with pytest.raises(ValueError, match="row 2"):
        native.logfmt_encode_rows(
            out, pitch, torch.tensor([0, 2]), x.view(torch.uint8), 2 * H, torch.tensor([0, 1]), H, 1
        )
    with pytest.raises(ValueError, match="row 5"):
        native.copy_rows(out, pitch, torch.tensor([0]), x.view(torch.uint8), 2 * H, torch.tensor([5]), 2 * H)
    with pytest.raises(ValueError, match="int64"):
        native.copy_rows(out, pitch, torch.tensor([0], dtype=torch.int32), x.view(torch.uint8), 2 * H, None, 16)
    with pytest.raises(ValueError, match="contiguous"):
        native.copy_rows(out.t(), pitch, torch.tensor([0]), x.view(torch.uint8), 2 * H, None, 16)
    with pytest.raises(ValueError, match="dst: a tensor on cpu is needed, got one on meta"):
        native.copy_rows(out.to("meta"), pitch, torch.tensor([0]), x.view(torch.uint8), 2 * H, None, 16)
    rows = _encode(x)
    with pytest.raises(ValueError, match="row 3"):
        native.reduce_rows(
            torch.empty(1, H), 4 * H, native.ROW_F32, 1, H, [(rows, pitch, native.ROW_LOGFMT, torch.tensor([3]), None)]
        )
    with pytest.raises(ValueError, match="2 entries, 3 needed"):
        native.logfmt_row_seqs(torch.empty(2, dtype=torch.int32), rows, pitch, torch.tensor([0, 1, 0]), H)


def test_hidden_below_the_sequence_bits_is_refused():
    assert not native.logfmt_layout(1536)["ok"]
    x = torch.randn(1, 1536).to(torch.bfloat16) * 0.1
    with pytest.raises(ValueError, match="hidden=1536"):
        _encode(x)


@pytest.mark.parametrize("hidden,limit", [(16896, 16384), (33792, 32768)], ids=["512-chunks", "1024-chunks"])
def test_more_than_32_chunks_are_refused(hidden, limit):
    """A row's cast decisions are one bit per chunk of a 32-bit mask (the CUDA receive side): 33 chunks are refused,
    32 are not."""
    layout = native.logfmt_layout(hidden)
    assert not layout["ok"] and layout["max_hidden"] == limit and native.logfmt_layout(limit)["ok"]
    x = torch.randn(1, hidden).to(torch.bfloat16) * 0.1
    with pytest.raises(ValueError, match=f"hidden={hidden}.*32 chunks"):
        _encode(x)
