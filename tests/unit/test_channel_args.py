"""Argument checking and single-rank behaviour of portep.Channel, in this process (a 1-rank gloo group)."""

import os

import pytest
import torch
import torch.distributed as dist

import portep
from dist_util import one_rank_group
from shm_probe import mapped_segments


@pytest.fixture(scope="module")
def group():
    one_rank_group()
    yield None
    dist.destroy_process_group()


@pytest.fixture
def channel(group):
    ch = portep.Channel(group, 1 << 16, transport="shm-unordered", num_streams=4, num_proxy_threads=2, timeout_s=5)
    yield ch
    ch.destroy()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"nbytes": 100}, "nbytes=100 must be a multiple of 16"),
        ({"nbytes": (64 << 30) + 16}, "nbytes=.* must be in 16..68719476736"),
        ({"num_streams": 8193, "transport": "shm-unordered"}, "num_streams=8193 must be in 1..8192"),
        ({"num_streams": 0}, "num_streams=0 must be in 1..262144"),
        ({"fifo_capacity": 1000}, "fifo_capacity=1000 must be a power of two"),
        ({"num_proxy_threads": 0}, "num_proxy_threads=0 must be in 1..64"),
        ({"num_fifos": 2, "num_proxy_threads": 4}, "num_fifos=2 must be in 4..4096"),
        ({"timeout_s": -1}, "timeout_s=-1.0 must be > 0"),
        ({"transport": "ib"}, "transport='ib' is not available"),
    ],
)
def test_bad_configuration_is_refused_with_the_limit(group, kwargs, match):
    args = {"nbytes": 1 << 16}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        portep.Channel(group, args.pop("nbytes"), **args)


def test_timeout_from_environment_is_checked(group, monkeypatch):
    monkeypatch.setenv("PORTEP_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="PORTEP_TIMEOUT_S='soon'"):
        portep.Channel(group, 1 << 16)


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda ch: ch.write(1, 0, 0, 16), ValueError, "dst=1 must be in 0..0"),
        (lambda ch: ch.write(0, 8, 0, 16), ValueError, "local_offset=8 must be a multiple of 16"),
        (lambda ch: ch.write(0, 0, 24, 16), ValueError, "remote_offset=24 must be a multiple of 16"),
        (lambda ch: ch.write(0, 0, 0, (16 << 20) + 1), ValueError, "nbytes=16777217 must be in 0..16777216"),
        (lambda ch: ch.write(0, 65520, 0, 32), ValueError, "local_offset=65520 \\+ nbytes=32 exceeds"),
        (lambda ch: ch.write(0, 0, 0, 16, stream=4), ValueError, "stream=4 must be in 0..3"),
        (lambda ch: ch.write(0, 0, 0, 16.0), TypeError, "nbytes must be an int"),
        (lambda ch: ch.signal(-1), ValueError, "dst=-1 must be in 0..0"),
        (lambda ch: ch.wait_signal(0, 9, 1), ValueError, "stream=9 must be in 0..3"),
    ],
)
def test_bad_transfer_arguments_are_refused_and_channel_stays_usable(channel, call, exc, match):
    with pytest.raises(exc, match=match):
        call(channel)
    channel.buffer[:64] = torch.arange(64, dtype=torch.uint8)
    channel.write_signal(0, 0, 1024, 64, stream=2)
    assert channel.wait_signal(0, 2, 1) & 0xFFFFFFFF >= 1
    assert torch.equal(channel.buffer[1024:1088], torch.arange(64, dtype=torch.uint8))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_self_writes_match_reference(channel, seed):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (8192,), dtype=torch.uint8, generator=g)
    channel.buffer[:8192] = src
    lengths = {}
    for start in range(0, 8192, 1024):
        lengths[start] = 16 * int(torch.randint(1, 65, (1,), generator=g))
        channel.write(0, start, 32768 + start, lengths[start], stream=1)
    channel.signal(0, stream=1, final=True)
    value = channel.wait_signal(0, 1, len(lengths))
    assert value & 0xFFFFFFFF == len(lengths) and value >> 32 == 1
    expected = torch.zeros(8192, dtype=torch.uint8)
    for start, length in lengths.items():
        expected[start : start + length] = src[start : start + length]
    assert torch.equal(channel.buffer[32768 : 32768 + 8192], expected)


def test_wait_signal_times_out_with_a_clear_error(channel):
    with pytest.raises(RuntimeError, match=r"signal \(src 0, stream 3\) reached 0 of 1 within 0.2"):
        channel.wait_signal(0, 3, 1, timeout_s=0.2)


def test_destroy_stops_threads_and_releases_memory(group):
    before, mapped_before = portep.native.live_proxy_threads(), mapped_segments()
    ch = portep.Channel(group, 1 << 16, num_proxy_threads=3)
    assert portep.native.live_proxy_threads() == before + 3
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("portep.")], "segments never get a name"
    assert len(mapped_segments() - mapped_before) >= 2, "the channel's data, signal and inbox segments are mapped"
    ch.destroy()
    ch.destroy()
    assert portep.native.live_proxy_threads() == before
    assert mapped_segments() == mapped_before
    with pytest.raises(RuntimeError, match="destroyed"):
        ch.quiet()
