"""The signal protocols of a proxy thread (ordering/signal_protocol.h), driven through a poster that records what
they ask for: what goes out for each WRITE and SIGNAL under the native and the tagged protocol, the epoch window,
the implicit signal of a full epoch, and a tagged sender and receiver end to end under random delivery orders."""

import random

import pytest

from portep_testing import ordering, wire

KIND_WRITE, KIND_SIGNAL = 0, 1
NUM_EPOCHS, MAX_UNITS = 16, 4095


def test_native_posts_the_bytes_and_one_atomic_add_per_signal():
    p = ordering.SignalProtocol(4, 8, native=True)
    p.write(2, 5, 64, 128, 48)
    p.write(2, 5, 112, 176, 16, placed=True)  # placed: the signal counts it, nothing goes out
    p.write(3, 5, 0, 0, 8)
    p.signal(2, 5, final=True)
    p.signal(3, 5, final=False)
    assert p.posted == [
        ("write", 2, 64, 128, 48, None),
        ("write", 3, 0, 0, 8, None),
        ("add", 2, 5, 2, True),
        ("add", 3, 5, 1, False),
    ]


def test_tagged_posts_carry_stream_epoch_and_units():
    p = ordering.SignalProtocol(4, 8, native=False)
    p.write(1, 7, 0, 256, 32)
    p.write(1, 7, 32, 288, 32, placed=True)  # placed: a zero-byte write with its immediate
    p.signal(1, 7, final=False)
    p.write(1, 7, 64, 320, 16)
    p.signal(1, 7, final=True)
    kinds = [(e[0], e[1], e[4]) for e in p.posted]
    assert kinds == [("write", 1, 32), ("write", 1, 0), ("write", 1, 0), ("write", 1, 16), ("write", 1, 0)]
    imms = [wire.decode_imm(e[5]) for e in p.posted]
    assert [(d["kind"], d["stream"], d["epoch"]) for d in imms] == [
        (KIND_WRITE, 7, 0),
        (KIND_WRITE, 7, 0),
        (KIND_SIGNAL, 7, 0),
        (KIND_WRITE, 7, 1),
        (KIND_SIGNAL, 7, 1),
    ]
    assert [(imms[2]["units"], imms[2]["final"]), (imms[4]["units"], imms[4]["final"])] == [(2, False), (1, True)]


def test_tagged_epoch_waits_for_the_signal_sixteen_epochs_back():
    p = ordering.SignalProtocol(2, 2, native=False)
    closing = []
    for _ in range(NUM_EPOCHS):
        p.write(1, 0, 0, 0, 8)
        p.signal(1, 0, final=False)
        closing.append(len(p.posted) - 1)  # the recorder's sequence numbers are the posts' indices
    assert not [e for e in p.posted if e[0] == "wait"], "no epoch may wait before the window wraps"
    p.write(1, 0, 0, 0, 8)
    assert p.posted[-2] == ("wait", closing[0], 1), p.posted[-3:]
    assert wire.decode_imm(p.posted[-1][5])["epoch"] == 0  # epoch 16 reuses number 0 once epoch 0 retired


def test_a_full_epoch_is_closed_by_an_implicit_signal():
    p = ordering.SignalProtocol(2, 1, native=False)
    for _ in range(MAX_UNITS + 1):
        p.write(1, 0, 0, 0, 4)
    signals = [wire.decode_imm(e[5]) for e in p.posted if wire.decode_imm(e[5])["kind"] == KIND_SIGNAL]
    assert [(s["epoch"], s["units"], s["final"]) for s in signals] == [(0, MAX_UNITS, False)]
    assert wire.decode_imm(p.posted[-1][5])["epoch"] == 1


def test_barrier_and_unknown_notices():
    p = ordering.SignalProtocol(2, 1, native=False)
    assert p.on_notice(1, ordering.SignalProtocol.barrier_imm(37))[:2] == ("barrier", 37)
    with pytest.raises(RuntimeError, match="sequenced add from rank 1"):
        p.on_notice(1, wire.imm_seq_add(3, 4, 5))
    with pytest.raises(RuntimeError, match="unknown control message"):
        p.on_notice(1, wire.imm_control(7, 0))


@pytest.mark.parametrize("seed", range(6))
def test_tagged_sender_to_receiver_under_any_delivery_order(seed):
    """Random writes and signals from 3 senders; their posts reach the receiver in any order (fewer than 16 epochs
    per stream, so the order never breaks the epoch window the sender's waits keep). At every moment a slot counts
    no more units than have arrived, and in the end it counts them all, with one final mark per final signal."""
    rng = random.Random(seed)
    streams, receiver = 3, ordering.SignalProtocol(4, 3, native=False)
    arrived, slots, expected, epochs = {}, {}, {}, {}
    pending = []  # (src, post index, imm)
    for src in (1, 2, 3):
        sender = ordering.SignalProtocol(4, streams, native=False)
        for _ in range(rng.randint(40, 200)):
            stream = rng.randrange(streams)
            if rng.random() < 0.8:
                sender.write(0, stream, 0, 0, 8)
                expected.setdefault((src, stream), [0, 0])[0] += 1
            elif epochs.get((src, stream), 0) < NUM_EPOCHS - 2:  # room for the closing signal below
                epochs[(src, stream)] = epochs.get((src, stream), 0) + 1
                final = rng.random() < 0.5
                sender.signal(0, stream, final)
                expected.setdefault((src, stream), [0, 0])[1] += final
        for stream in range(streams):
            sender.signal(0, stream, True)
            expected.setdefault((src, stream), [0, 0])[1] += 1
        pending += [(src, i, e[5]) for i, e in enumerate(sender.posted) if e[0] == "write"]
    rng.shuffle(pending)
    for src, _, imm in pending:
        d = wire.decode_imm(imm)
        if d["kind"] == KIND_WRITE:
            arrived[(src, d["stream"])] = arrived.get((src, d["stream"]), 0) + 1
        _, _, _, releases = receiver.on_notice(src, imm)
        for r_src, r_stream, units, final in releases:
            slot = slots.setdefault((r_src, r_stream), [0, 0])
            slot[0] += units
            slot[1] += final
            assert slot[0] <= arrived.get((r_src, r_stream), 0), f"slot {(r_src, r_stream)} counts writes not in"
    assert receiver.held == 0
    assert {k: v for k, v in slots.items()} == {k: v for k, v in expected.items()}
