"""The nccl transport's records (transport/nccl/nccl_records.h) at the wrap-arounds no run reaches: the sequence tag's
24 bits, the 32-bit sequence and put counts. A receiver must take a slot's record only when both 8-byte halves are
this lap's (a half left from the previous lap is a torn read), and trust it only once it has counted the record's put
count of signals, modulo 2^32."""

import pytest

from portep_testing import nccl_records as r

SLOTS = r.RECORD_SLOTS
SEQS = [1, 2, SLOTS, SLOTS + 1, (1 << 24) - 1, 1 << 24, (1 << 24) + 1, (1 << 32) - 1, 1 << 32, (1 << 32) + SLOTS + 3]


@pytest.mark.parametrize("seq", SEQS)
def test_a_record_holds_its_own_sequence_number_only(seq):
    imm, channel = 0x9E3779B9 ^ seq & 0xFFFFFFFF, seq % 251
    w0, w1 = r.encode(imm, seq, 777, channel)
    assert r.fields(w0, w1) == {"imm": imm, "put_count": 777, "channel": channel}
    assert r.holds(w0, w1, seq)
    # A slot holds this lap's record or the previous lap's; sequence numbers 2^32 apart never meet there.
    for other in (seq + SLOTS, seq - SLOTS, seq + 1, seq - 1, seq + (1 << 24)):
        if other > 0:
            assert not r.holds(w0, w1, other), (seq, other)


@pytest.mark.parametrize("seq", [s for s in SEQS if s > SLOTS])
def test_a_torn_slot_is_not_taken_for_the_new_record(seq):
    new = r.encode(0x11111111, seq, 5000, 3)
    old = r.encode(0x22222222, seq - SLOTS, 4000, 7)  # the previous lap's record in the same slot
    assert r.slot_offset(0, seq) == r.slot_offset(0, seq - SLOTS)
    assert not r.holds(new[0], old[1], seq) and not r.holds(old[0], new[1], seq)
    assert r.holds(*new, seq) and not r.holds(*old, seq)


@pytest.mark.parametrize("base", [0, (1 << 32) - 10, 5 << 32])
def test_a_record_is_trusted_once_its_put_count_is_counted_modulo_2_to_the_32(base):
    put_count = base + 7
    w0, w1 = r.encode(1, 1, put_count, 0)
    assert not r.counted(w0, w1, put_count - 1)
    assert not r.counted(w0, w1, put_count - 7)
    if put_count > 1 << 20:
        assert not r.counted(w0, w1, put_count - (1 << 20))
    assert r.counted(w0, w1, put_count)
    assert r.counted(w0, w1, put_count + 1)
    assert r.counted(w0, w1, put_count + (1 << 30))


def test_slots_and_inboxes_do_not_overlap():
    assert r.slot_offset(0, 1) == 64 and r.slot_offset(0, SLOTS) == 64 + (SLOTS - 1) * r.RECORD_BYTES
    assert r.slot_offset(0, SLOTS + 1) == r.slot_offset(0, 1)
    assert r.slot_offset(0, SLOTS) + r.RECORD_BYTES == r.inbox_offset(1)
    assert r.slot_offset(3, 1) == r.inbox_offset(3) + 64
