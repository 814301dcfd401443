"""Immediate-data encodings (ordering/imm.h)."""

import itertools
import random

import pytest

from portep_testing import ordering, wire

STREAM_WRITE, STREAM_SIGNAL, SEQ_ADD, CONTROL = 0, 1, 2, 3

# Literal bit table of imm.h: kind -> {field: (shift, width)}; "reserved" must be zero.
LAYOUT = {
    STREAM_WRITE: {"epoch": (26, 4), "stream": (13, 13), "reserved": (0, 13)},
    STREAM_SIGNAL: {"final": (29, 1), "epoch": (25, 4), "stream": (12, 13), "units": (0, 12)},
    SEQ_ADD: {"slot": (18, 12), "seq": (10, 8), "value": (0, 10)},
    CONTROL: {"op": (26, 4), "arg": (0, 26)},
}
ARGS = {
    STREAM_WRITE: ("stream", "epoch"),
    STREAM_SIGNAL: ("stream", "epoch", "units", "final"),
    SEQ_ADD: ("slot", "seq", "value"),
    CONTROL: ("op", "arg"),
}
NATIVE = {
    STREAM_WRITE: wire.imm_stream_write,
    STREAM_SIGNAL: wire.imm_stream_signal,
    SEQ_ADD: wire.imm_seq_add,
    CONTROL: wire.imm_control,
}
KIND_MASK = 0b11 << 30
WORD_MASK = 0xFFFFFFFF
DECODED_DEFAULTS = {
    "stream": 0,
    "epoch": 0,
    "units": 0,
    "final": False,
    "slot": 0,
    "seq": 0,
    "value": 0,
    "op": 0,
    "arg": 0,
}


def field_max(kind, name):
    return (1 << LAYOUT[kind][name][1]) - 1


def py_encode(kind, **fields):
    word = kind << 30
    for name, (shift, width) in LAYOUT[kind].items():
        if name == "reserved":
            continue
        value = int(fields[name])
        assert 0 <= value < (1 << width), name
        word |= value << shift
    return word


def expected_decode(kind, valid=True, **fields):
    d = dict(DECODED_DEFAULTS, kind=kind, valid=valid)
    d.update({k: (bool(v) if k == "final" else v) for k, v in fields.items()})
    return d


def native_encode(kind, **fields):
    return NATIVE[kind](*(fields[a] for a in ARGS[kind]))


def random_fields(rng, kind):
    out = {}
    for name in ARGS[kind]:
        value = rng.randint(0, field_max(kind, name))
        out[name] = bool(value) if name == "final" else value
    return out


def extreme_values(kind, name):
    top = field_max(kind, name)
    return (False, True) if name == "final" else sorted({0, 1, top // 2 + 1, top})


def table_mask(kind, name):
    shift, width = LAYOUT[kind][name]
    return ((1 << width) - 1) << shift


def zero_fields(kind):
    return {name: (False if name == "final" else 0) for name in ARGS[kind]}


def encoder_mask(kind, name):
    """Word bits the native encoder changes when only `name` moves off zero, one argument bit at a time."""
    base = native_encode(kind, **zero_fields(kind))
    values = (True,) if name == "final" else [1 << bit for bit in range(32)]
    mask = 0
    for value in values:
        mask |= native_encode(kind, **dict(zero_fields(kind), **{name: value})) ^ base
    return mask


def test_exposed_constants_match_header():
    assert wire.IMM_NUM_EPOCHS == 16
    assert wire.IMM_MAX_STREAMS == 8192
    assert wire.IMM_MAX_UNITS == 4095
    assert wire.IMM_MAX_SLOTS == 4096
    assert wire.IMM_SEQ_SPACE == 256


@pytest.mark.parametrize("kind", sorted(LAYOUT))
def test_encoder_field_masks_match_the_table_and_fill_the_word_without_overlap(kind):
    assert native_encode(kind, **zero_fields(kind)) == kind << 30
    covered = KIND_MASK
    for name in ARGS[kind]:
        mask = encoder_mask(kind, name)
        assert mask == table_mask(kind, name), name
        assert covered & mask == 0, name
        covered |= mask
    reserved = table_mask(kind, "reserved") if "reserved" in LAYOUT[kind] else 0
    assert covered == WORD_MASK & ~reserved


def test_no_stream_write_field_ever_sets_the_reserved_bits():
    reserved = table_mask(STREAM_WRITE, "reserved")
    for name in ARGS[STREAM_WRITE]:
        assert encoder_mask(STREAM_WRITE, name) & reserved == 0, name
    assert wire.imm_stream_write(WORD_MASK, WORD_MASK) & reserved == 0
    rng = random.Random(0)
    for _ in range(2000):
        assert wire.imm_stream_write(rng.getrandbits(32), rng.getrandbits(32)) & reserved == 0


@pytest.mark.parametrize("kind", sorted(LAYOUT))
def test_every_extreme_combination_round_trips_and_matches_python(kind):
    names = ARGS[kind]
    for values in itertools.product(*(extreme_values(kind, n) for n in names)):
        fields = dict(zip(names, values))
        imm = native_encode(kind, **fields)
        assert imm == py_encode(kind, **fields)
        assert wire.decode_imm(imm) == expected_decode(kind, **fields)


@pytest.mark.parametrize("kind", sorted(LAYOUT))
@pytest.mark.parametrize("seed", range(4))
def test_random_values_round_trip_and_match_python(kind, seed):
    rng = random.Random(seed * 10 + kind)
    for _ in range(2000):
        fields = random_fields(rng, kind)
        imm = native_encode(kind, **fields)
        assert imm == py_encode(kind, **fields)
        assert imm >> 30 == kind
        assert wire.decode_imm(imm) == expected_decode(kind, **fields)


@pytest.mark.parametrize("seed", range(3))
def test_kind_is_the_top_two_bits_of_any_word(seed):
    rng = random.Random(seed)
    for _ in range(4000):
        imm = rng.getrandbits(32)
        assert wire.decode_imm(imm)["kind"] == imm >> 30


@pytest.mark.parametrize("seed", range(3))
def test_decoder_matches_python_on_arbitrary_words(seed):
    rng = random.Random(seed)
    for _ in range(4000):
        imm = rng.getrandbits(32)
        kind = imm >> 30
        fields = {
            name: (imm >> shift) & ((1 << width) - 1)
            for name, (shift, width) in LAYOUT[kind].items()
            if name != "reserved"
        }
        valid = kind != STREAM_WRITE or imm & 0x1FFF == 0
        assert wire.decode_imm(imm) == expected_decode(kind, valid=valid, **fields)


@pytest.mark.parametrize("bit", range(13))
def test_each_reserved_bit_of_stream_write_marks_it_invalid(bit):
    imm = wire.imm_stream_write(4095, 9) | (1 << bit)
    d = wire.decode_imm(imm)
    assert d["valid"] is False
    assert d["kind"] == STREAM_WRITE


@pytest.mark.parametrize("seed", range(2))
def test_random_reserved_patterns_invalid_and_clean_writes_valid(seed):
    rng = random.Random(seed)
    for _ in range(2000):
        clean = wire.imm_stream_write(rng.randrange(8192), rng.randrange(16))
        assert wire.decode_imm(clean)["valid"] is True
        assert wire.decode_imm(clean | rng.randint(1, 0x1FFF))["valid"] is False


@pytest.mark.parametrize("kind", [STREAM_SIGNAL, SEQ_ADD, CONTROL])
def test_kinds_without_reserved_bits_are_always_valid(kind):
    rng = random.Random(kind)
    for _ in range(1000):
        assert wire.decode_imm((kind << 30) | rng.getrandbits(30))["valid"] is True


def test_decoded_notifications_carry_no_rank_field():
    for kind in LAYOUT:
        keys = set(wire.decode_imm(kind << 30))
        assert not keys & {"rank", "src", "source", "dst", "dst_rank"}


def test_4096_experts_times_two_phases_fit_the_stream_field():
    assert wire.IMM_MAX_STREAMS >= 4096
    seen_write, seen_signal = set(), set()
    for stream in range(2 * 4096):
        seen_write.add(wire.decode_imm(wire.imm_stream_write(stream, 15))["stream"])
        seen_signal.add(wire.decode_imm(wire.imm_stream_signal(stream, 15, 4095, True))["stream"])
    assert seen_write == seen_signal == set(range(8192))


def test_pending_table_accepts_4096_streams_from_one_connection():
    table = ordering.PendingSignalTable(1, 4096)
    for stream in (0, 2047, 4095):
        d = wire.decode_imm(wire.imm_stream_write(stream, 3))
        assert table.on_write(0, d["stream"], d["epoch"]) == []
    released = []
    for stream in (0, 2047, 4095):
        for epoch in range(4):
            units = 1 if epoch == 3 else 0
            d = wire.decode_imm(wire.imm_stream_signal(stream, epoch, units, epoch == 3))
            released += table.on_signal(0, d["stream"], d["epoch"], d["units"], d["final"])
    assert released == [(0, s, u, f) for s in (0, 2047, 4095) for u, f in ((0, False),) * 3 + ((1, True),)]
    assert table.held == 0


@pytest.mark.parametrize("num_sources", [1024, 2048, 8192])
def test_source_rank_comes_from_the_connection_for_1024_plus_ranks(num_sources):
    table = ordering.PendingSignalTable(num_sources, 2)
    rng = random.Random(num_sources)
    sources = [0, num_sources - 1] + rng.sample(range(1, num_sources - 1), 30)
    released = []
    for src in sources:
        stream, units = src % 2, 1 + src % 7
        write = wire.decode_imm(wire.imm_stream_write(stream, 0))
        signal = wire.decode_imm(wire.imm_stream_signal(stream, 0, units, True))
        released += table.on_signal(src, signal["stream"], signal["epoch"], signal["units"], signal["final"])
        for _ in range(units):
            released += table.on_write(src, write["stream"], write["epoch"])
    assert released == [(src, src % 2, 1 + src % 7, True) for src in sources]
    assert table.held == 0 and table.released == len(sources)
