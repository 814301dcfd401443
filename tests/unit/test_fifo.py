"""Command FIFO (proxy/fifo.h) exercised by host producers through fifo_selftest."""

import pytest

from portep_testing import fifo_selftest

TOTAL_COMMANDS = 64000


@pytest.mark.parametrize("capacity", [64, 4096])
@pytest.mark.parametrize("producers", [1, 8, 32])
def test_every_command_arrives_once_in_producer_order(producers, capacity):
    per_producer = TOTAL_COMMANDS // producers
    r = fifo_selftest(producers, per_producer, capacity, 20.0)
    assert r["producer_timeout"] is False
    assert r["popped"] == producers * per_producer
    assert r["out_of_order"] == 0


def test_single_producer_wraps_a_small_ring_many_times():
    r = fifo_selftest(1, 200 * 64, 64, 20.0)
    assert (r["popped"], r["out_of_order"], r["producer_timeout"]) == (200 * 64, 0, False)


def test_zero_commands_finishes_empty():
    r = fifo_selftest(4, 0, 64, 5.0)
    assert (r["popped"], r["out_of_order"], r["producer_timeout"]) == (0, 0, False)


@pytest.mark.parametrize("producers,capacity", [(0, 64), (4097, 64), (1, 32), (1, 100), (1, 4095)])
def test_invalid_configuration_rejected(producers, capacity):
    with pytest.raises(ValueError):
        fifo_selftest(producers, 10, capacity, 1.0)
