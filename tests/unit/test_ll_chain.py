"""The sequence-number chain of graph-launched LL calls (gpu_kernels/cuda/ll_api.h, "The sequence-number chain";
LLPlanTable::launch in ll_plan.h), on the CPU: portep_testing.ll_chain drives the real table against fake launches
that do what the kernels do with the chain. A host model here (a Buffer's half and lockstep numbers) checks that every
launch that runs carries the host's number for its call, whichever way it was launched, and that calls launch as
graphs where the table can tell the chain holds their number."""

import random

import pytest

from portep_testing import ll_chain

BOTH = ll_chain.PHASE_SEND | ll_chain.PHASE_RECV
MAX_WIRE = 0xFFFFFFFF


class Host:
    """What a Buffer's host side gives each LL call: the next half (every call flips it) and lockstep.wire_seq of
    the calls counted so far."""

    def __init__(self, model, first_seq=0):
        self.model, self.half, self.count = model, 0, first_seq

    def wire(self):
        return self.count % MAX_WIRE + 1

    def call(self, dispatch=True, phases=BOTH):
        half, seq = self.half, self.wire()
        self.half ^= 1
        self.count += 1
        return half, seq, self.model.launch(dispatch, half, seq, phases)

    def round_trip(self):
        return [self.call(True), self.call(False)]


def hows(results):
    """How each call was launched: "kernel", "graph" or "captured"."""
    return [how for _, _, (how, _, _) in results]


def carried_is_the_hosts(results):
    return [(seq, how, carried) for _, seq, (how, _, carried) in results if carried != seq]


def test_eager_calls_launch_as_graphs_after_the_first():
    host = Host(ll_chain.ChainModel())
    results = host.round_trip() + host.round_trip() + host.round_trip()
    assert hows(results) == ["kernel"] + ["graph"] * 5
    assert carried_is_the_hosts(results) == []
    assert results[1][2][1] == ll_chain.SEQ_FROM_CHAIN | ll_chain.SEQ_WRITE_CHAIN
    assert results[0][2][1] == ll_chain.SEQ_WRITE_CHAIN


def test_the_numbers_wrap_as_lockstep_wire_seq_does():
    host = Host(ll_chain.ChainModel(), first_seq=MAX_WIRE - 3)
    results = [host.call(i % 2 == 0) for i in range(8)]
    assert [seq for _, seq, _ in results] == [MAX_WIRE - 2, MAX_WIRE - 1, MAX_WIRE, 1, 2, 3, 4, 5]
    assert carried_is_the_hosts(results) == []
    assert hows(results)[1:] == ["graph"] * 7


def test_a_hook_launches_kernels_and_keeps_the_chain():
    model = ll_chain.ChainModel()
    host = Host(model)
    results = host.round_trip()
    half, seq, send = host.call(True, ll_chain.PHASE_SEND)  # the send now, the hook's receive later
    results.append((half, seq, send))
    results += host.round_trip()  # another call's round trip between the two phases
    recv = model.launch(True, half, seq, ll_chain.PHASE_RECV)
    results.append((half, seq, recv))
    results += host.round_trip()
    assert send[0] == "kernel" and recv[0] == "kernel" and recv[1] == 0  # the receive leaves the chain alone
    assert carried_is_the_hosts(results) == []
    assert hows(results[-2:]) == ["graph", "graph"]


def test_captured_calls_leave_the_chain_and_eager_ones_take_it_up_again():
    model = ll_chain.ChainModel()
    host = Host(model)
    results = host.round_trip() + host.round_trip()
    chain = model.chain
    model.capturing = True
    captured = host.round_trip()
    model.capturing = False
    assert [r[2][:2] for r in captured] == [("captured", 0), ("captured", 0)]
    assert model.chain == chain  # replays run what was baked: the chain never sees them
    after = host.round_trip() + host.round_trip()
    assert hows(after) == ["kernel", "graph", "graph", "graph"]
    assert carried_is_the_hosts(results + after) == []


@pytest.mark.parametrize("skip", ["count", "half"])
def test_a_call_that_counted_or_took_a_half_without_launching_makes_the_next_a_kernel_launch(skip):
    host = Host(ll_chain.ChainModel())
    results = host.round_trip()
    if skip == "count":
        host.count += 1  # a call counted by lockstep that launched nothing
    else:
        host.half ^= 1  # a half taken by a call that failed before its launch
    after = host.round_trip()
    assert hows(after) == ["kernel", "graph"]
    assert carried_is_the_hosts(results + after) == []


def test_reset_half_makes_the_next_a_kernel_launch():
    model = ll_chain.ChainModel()
    host = Host(model)
    results = host.round_trip() + [host.call()]  # ends on half 1 next
    model.reset_half()  # clean_low_latency_buffer: the ranks restart on half 0, numbers from 1
    host.half, host.count = 0, 0
    after = host.round_trip()
    assert hows(after) == ["kernel", "graph"]
    assert carried_is_the_hosts(results + after) == []


def test_a_failed_graph_launch_falls_back_to_a_kernel_and_turns_graphs_off():
    model = ll_chain.ChainModel()
    host = Host(model)
    results = host.round_trip()
    model.graph_fails = True
    after = host.round_trip() + host.round_trip()
    assert hows(after) == ["kernel"] * 4
    assert not model.graphs_on and model.graph_error == 3
    assert carried_is_the_hosts(results + after) == []


def test_a_failure_stays_named_after_graphs_are_turned_on_again():
    model = ll_chain.ChainModel()
    host = Host(model)
    results = host.round_trip()
    model.graph_fails = True
    results += host.round_trip()
    model.graph_fails, model.graphs_on = False, True
    after = host.round_trip()
    assert hows(after) == ["graph", "graph"]
    assert model.graph_error == 3  # the first error, not cleared by the launches that worked since
    assert carried_is_the_hosts(results + after) == []


def test_a_declined_graph_launches_a_kernel_and_keeps_graphs_on():
    model = ll_chain.ChainModel()
    host = Host(model)
    results = host.round_trip()
    model.graph_declines = True  # another GPU current than the cache's
    results += host.round_trip()
    model.graph_declines = False
    after = host.round_trip()
    assert hows(results[2:] + after) == ["kernel", "kernel", "graph", "graph"]
    assert model.graphs_on and model.graph_error == 0
    assert carried_is_the_hosts(results + after) == []


@pytest.mark.parametrize("seed", [1, 7, 2026])
def test_random_sequences_always_carry_the_hosts_numbers(seed):
    rng = random.Random(seed)
    model = ll_chain.ChainModel()
    host = Host(model, first_seq=rng.choice([0, MAX_WIRE - 20]))
    results, pending_hook, graphs = [], None, 0
    for _ in range(400):
        op = rng.random()
        if op < 0.6:
            r = host.call(rng.random() < 0.5)
            results.append(r)
            graphs += r[2][0] == "graph"
        elif op < 0.7 and pending_hook is None:
            half, seq, send = host.call(True, ll_chain.PHASE_SEND)
            results.append((half, seq, send))
            pending_hook = (half, seq)
        elif op < 0.8 and pending_hook is not None:
            half, seq = pending_hook
            results.append((half, seq, model.launch(True, half, seq, ll_chain.PHASE_RECV)))
            pending_hook = None
        elif op < 0.85:
            model.capturing = not model.capturing
        elif op < 0.9:
            host.count += 1
        elif op < 0.95:
            host.half ^= 1
        else:
            model.reset_half()
            host.half = 0
    assert carried_is_the_hosts([r for r in results if r[2][0] != "captured"]) == []
    assert graphs > 50  # graphs are taken where they can be, not only refused
