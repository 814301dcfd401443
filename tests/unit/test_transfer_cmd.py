"""TransferCmd (proxy/transfer_cmd.h): the 16-byte command record."""

import itertools
import random

import pytest

from portep_testing import wire

MiB = 1 << 20
GiB = 1 << 30

# Literal bit table of transfer_cmd.h: field -> (word, shift, width).
BIT_TABLE = {
    "op": ("lo", 0, 4),
    "flags": ("lo", 4, 4),
    "dst_rank": ("lo", 8, 13),
    "size": ("lo", 21, 25),
    "stream": ("lo", 46, 18),
    "remote_off": ("hi", 0, 32),
    "local_off": ("hi", 32, 32),
}
FIELDS = ("op", "flags", "dst_rank", "size", "stream", "remote_off", "local_off")
OFFSET_FIELDS = ("remote_off", "local_off")
VALID_OPS = (1, 2, 3, 4, 5)
RANK_LIMIT = 8192
SIZE_LIMIT = 16 * MiB
STREAM_LIMIT = 262144
OFFSET_LIMIT = 64 * GiB - 16

MAXIMA = {
    "op": 5,
    "flags": 15,
    "dst_rank": RANK_LIMIT - 1,
    "size": SIZE_LIMIT,
    "stream": STREAM_LIMIT - 1,
    "remote_off": OFFSET_LIMIT,
    "local_off": OFFSET_LIMIT,
}
MINIMA = {f: (1 if f == "op" else 0) for f in FIELDS}
ZERO_FIELDS = dict.fromkeys(FIELDS, 0)
ARG_BITS = {f: (64 if f in OFFSET_FIELDS else 32) for f in FIELDS}
WORD_MASK = (1 << 64) - 1
# Opcodes 8..15 are refused, so the encoder never sets the op field's top bit; only the decoder reads it.
OP_TOP_BIT = 1 << (BIT_TABLE["op"][1] + BIT_TABLE["op"][2] - 1)
SECOND = {f: (16 if f in OFFSET_FIELDS else (2 if f == "op" else 1)) for f in FIELDS}


def py_pack(fields):
    words = {"lo": 0, "hi": 0}
    for name, (word, shift, width) in BIT_TABLE.items():
        value = fields[name]
        if name in OFFSET_FIELDS:
            assert value % 16 == 0
            value //= 16
        assert 0 <= value < (1 << width), name
        words[word] |= value << shift
    return words["lo"], words["hi"]


def py_unpack(lo, hi):
    words = {"lo": lo, "hi": hi}
    out = {}
    for name, (word, shift, width) in BIT_TABLE.items():
        value = (words[word] >> shift) & ((1 << width) - 1)
        out[name] = value * 16 if name in OFFSET_FIELDS else value
    return out


def encode(fields):
    return wire.encode_cmd(*(fields[f] for f in FIELDS))


def random_fields(rng):
    return {
        "op": rng.choice(VALID_OPS),
        "flags": rng.randrange(16),
        "dst_rank": rng.randrange(RANK_LIMIT),
        "size": rng.randint(0, SIZE_LIMIT),
        "stream": rng.randrange(STREAM_LIMIT),
        "remote_off": 16 * rng.randint(0, OFFSET_LIMIT // 16),
        "local_off": 16 * rng.randint(0, OFFSET_LIMIT // 16),
    }


def valid_base():
    return {"op": 1, "flags": 5, "dst_rank": 77, "size": 4096, "stream": 300, "remote_off": 1024, "local_off": 2048}


def table_masks(field):
    word, shift, width = BIT_TABLE[field]
    mask = ((1 << width) - 1) << shift
    return (mask, 0) if word == "lo" else (0, mask)


def expected_encoder_masks(field):
    lo, hi = table_masks(field)
    return (lo & ~OP_TOP_BIT, hi) if field == "op" else (lo, hi)


def encoder_masks(field):
    """(lo, hi) bits the native encoder changes when only `field` moves off its minimum, over the single-bit
    values it accepts."""
    base_lo, base_hi = encode(MINIMA)
    lo_mask = hi_mask = 0
    for bit in range(ARG_BITS[field]):
        try:
            lo, hi = encode(dict(MINIMA, **{field: 1 << bit}))
        except ValueError:
            continue
        lo_mask, hi_mask = lo_mask | (lo ^ base_lo), hi_mask | (hi ^ base_hi)
    return lo_mask, hi_mask


def test_exposed_limits_match_header():
    assert wire.MAX_RANKS == RANK_LIMIT
    assert wire.MAX_CMD_BYTES == SIZE_LIMIT
    assert wire.MAX_STREAMS == STREAM_LIMIT
    assert wire.MAX_OFFSET == OFFSET_LIMIT
    assert (wire.OP_WRITE, wire.OP_SIGNAL, wire.OP_QUIET, wire.OP_BARRIER, wire.OP_NOP) == VALID_OPS


def test_encoder_field_masks_match_the_table_and_fill_both_words_without_overlap():
    covered_lo = covered_hi = 0
    for field in FIELDS:
        lo, hi = encoder_masks(field)
        assert (lo, hi) == expected_encoder_masks(field), field
        assert covered_lo & lo == 0 and covered_hi & hi == 0, field
        covered_lo, covered_hi = covered_lo | lo, covered_hi | hi
    assert (covered_lo, covered_hi) == (WORD_MASK & ~OP_TOP_BIT, WORD_MASK)


def test_only_refused_opcodes_would_set_the_op_fields_top_bit():
    assert wire.decode_cmd(OP_TOP_BIT, 0) == dict(ZERO_FIELDS, op=8)
    with pytest.raises(ValueError, match="opcode"):
        encode(dict(MINIMA, op=8))


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("which", ["min", "second", "max"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_field_extreme_round_trips_and_matches_python_packer(field, which, seed):
    rng = random.Random(seed * 1000 + FIELDS.index(field))
    fields = random_fields(rng)
    fields[field] = {"min": MINIMA, "second": SECOND, "max": MAXIMA}[which][field]
    lo, hi = encode(fields)
    assert (lo, hi) == py_pack(fields)
    assert wire.decode_cmd(lo, hi) == fields


def test_all_fields_at_max_together():
    lo, hi = encode(MAXIMA)
    assert (lo, hi) == py_pack(MAXIMA)
    assert wire.decode_cmd(lo, hi) == MAXIMA


@pytest.mark.parametrize("field", FIELDS)
def test_single_field_at_max_changes_only_its_own_bits(field):
    base_lo, base_hi = encode(MINIMA)
    lo, hi = encode(dict(MINIMA, **{field: MAXIMA[field]}))
    word, shift, width = BIT_TABLE[field]
    mask = ((1 << width) - 1) << shift
    delta = {"lo": lo ^ base_lo, "hi": hi ^ base_hi}
    assert delta[word] != 0 and delta[word] & ~mask == 0
    assert delta["hi" if word == "lo" else "lo"] == 0


@pytest.mark.parametrize("seed", range(5))
def test_random_commands_round_trip_and_match_python_packer(seed):
    rng = random.Random(seed)
    for _ in range(2000):
        fields = random_fields(rng)
        lo, hi = encode(fields)
        assert (lo, hi) == py_pack(fields)
        assert lo != 0
        assert wire.decode_cmd(lo, hi) == fields


@pytest.mark.parametrize("seed", range(3))
def test_decoder_matches_python_unpacker_on_arbitrary_words(seed):
    rng = random.Random(seed)
    for _ in range(2000):
        lo, hi = rng.getrandbits(64), rng.getrandbits(64)
        assert wire.decode_cmd(lo, hi) == py_unpack(lo, hi)


OUT_OF_RANGE = (
    [("dst_rank", v, "8192") for v in (8192, 8193, 12345, (1 << 13) + 77, (1 << 32) - 1, 1 << 32, 1 << 40)]
    + [("size", v, "16 MiB") for v in (SIZE_LIMIT + 1, SIZE_LIMIT + 16, (1 << 25) - 1, 1 << 25, 1 << 32, 1 << 33)]
    + [
        ("stream", v, "262144")
        for v in (STREAM_LIMIT, STREAM_LIMIT + 1, (1 << 19) + 3, (1 << 32) - 1, 1 << 32, 1 << 50)
    ]
    + [
        (f, v, "64 GiB")
        for f in OFFSET_FIELDS
        for v in (OFFSET_LIMIT + 16, 64 * GiB, 64 * GiB + 16, 1 << 40, (1 << 64) - 16)
    ]
    + [(f, v, "16 bytes") for f in OFFSET_FIELDS for v in (1, 8, 15, 17, 4104, OFFSET_LIMIT - 1)]
    + [("op", v, "opcode") for v in (0, 6, 7, 15, 16, 255, (1 << 32) - 1)]
    + [("flags", v, "4 bits") for v in (16, 17, 255, 1 << 20, (1 << 32) - 1)]
)


@pytest.mark.parametrize("field,value,fragment", OUT_OF_RANGE)
def test_out_of_range_field_raises_value_error_naming_the_limit(field, value, fragment):
    fields = dict(valid_base(), **{field: value})
    with pytest.raises(ValueError, match=fragment):
        encode(fields)


@pytest.mark.parametrize("seed", range(3))
def test_random_out_of_range_values_never_encode(seed):
    rng = random.Random(seed)
    limits = {"dst_rank": RANK_LIMIT, "size": SIZE_LIMIT + 1, "stream": STREAM_LIMIT}
    for _ in range(500):
        field = rng.choice(list(limits) + list(OFFSET_FIELDS))
        fields = random_fields(rng)
        if field in OFFSET_FIELDS:
            fields[field] = rng.randint(OFFSET_LIMIT + 1, (1 << 64) - 1)
        else:
            fields[field] = rng.randint(limits[field], (1 << 32) + 5)
        with pytest.raises(ValueError):
            encode(fields)


@pytest.mark.parametrize(
    "field,value",
    [
        ("op", 1 << 32),
        ("flags", 1 << 32),
        ("dst_rank", -1),
        ("size", -16),
        ("stream", -1),
        ("remote_off", 1 << 64),
        ("local_off", -16),
    ],
)
def test_unrepresentable_values_are_refused_not_wrapped(field, value):
    fields = dict(valid_base(), **{field: value})
    with pytest.raises((TypeError, ValueError, OverflowError)):
        encode(fields)


def test_design_minimum_4096_ranks():
    assert wire.MAX_RANKS >= 4096
    for rank in (4095, wire.MAX_RANKS - 1):
        lo, hi = encode(dict(valid_base(), dst_rank=rank))
        assert wire.decode_cmd(lo, hi)["dst_rank"] == rank


def test_design_minimum_16_mib_per_command():
    assert wire.MAX_CMD_BYTES >= 16 * MiB
    lo, hi = encode(dict(valid_base(), size=16 * MiB))
    assert wire.decode_cmd(lo, hi)["size"] == 16 * MiB


def test_design_minimum_64_gib_reach():
    assert wire.MAX_OFFSET + 16 >= 64 * GiB
    fields = dict(valid_base(), remote_off=64 * GiB - 16, local_off=64 * GiB - 32)
    assert wire.decode_cmd(*encode(fields)) == fields


def test_design_minimum_4096_experts_in_stream_field():
    assert wire.MAX_STREAMS >= 4096
    for stream in (4095, 4096, wire.MAX_STREAMS - 1):
        lo, hi = encode(dict(valid_base(), stream=stream))
        assert wire.decode_cmd(lo, hi)["stream"] == stream


def test_every_valid_op_and_flag_combination_round_trips():
    for op, flags in itertools.product(VALID_OPS, range(16)):
        fields = dict(valid_base(), op=op, flags=flags)
        lo, hi = encode(fields)
        assert (lo, hi) == py_pack(fields)
        assert wire.decode_cmd(lo, hi) == fields
