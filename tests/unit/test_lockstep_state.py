"""The lockstep counters' one native object (native.LockstepState, python/src/ll_shared.h) and the Python protocol
around it (portep.lockstep.Lockstep), without a Buffer: what each protocol step leaves in the counters the LL fast
path reads (in_step, seq) and advances. The protocol through real Buffers and peers: tests/host/test_robustness.py."""

import pytest

from portep import native
from portep.lockstep import Lockstep, OutOfStep


class Channel:  # what Lockstep calls on a Channel: its announcements and the peers' status events
    def __init__(self, peer_refusals=0):
        self.announced, self.peer_refusals = [], peer_refusals

    def announce(self, kind):
        self.announced.append(kind)

    def peer_status(self, peer):
        return native.PEER_OK

    def status_events(self, src, kind):
        return self.peer_refusals if kind == native.EVENT_REFUSED else 0


def test_the_native_counters_step_as_the_protocol_says():
    s = native.LockstepState()
    assert (s.seq, s.refused, s.resolved, s.sent, s.broken, s.in_step) == (0, 0, 0, False, False, True)
    s.made_call()
    assert (s.seq, s.sent) == (1, True)
    s.begin()
    assert (s.seq, s.sent) == (2, False)
    s.refused = 3
    assert not s.in_step
    s.resolved = 3
    assert s.in_step
    s.broken = True
    assert not s.in_step
    with pytest.raises(TypeError):
        s.seq = -1  # unsigned, as the kernels' sequence numbers are


def test_lockstep_keeps_its_counters_in_its_state_object():
    ch = Channel(peer_refusals=1)
    ls = Lockstep(ch, native, rank=0, num_ranks=3, timeout_s=1.0)
    state = ls.state
    ls.begin()
    assert ls.enter("dispatch") == 1 == state.seq and not state.sent
    ls.sending()
    assert state.sent and ls.sent
    ls.begin()
    ls.refuse()  # this rank refuses call #2; both peers have refused one call (Channel's peer_refusals)
    assert (state.refused, state.resolved, state.in_step) == (1, 0, False)
    assert ch.announced == [native.EVENT_REFUSED]
    ls.begin()
    assert ls.enter("combine") == 3 and (state.resolved, state.in_step) == (1, True)  # settled: every peer refused
    ls.fail("combine", RuntimeError("timed out"))
    assert state.broken and ls.broken.startswith("combine #3 failed on rank 0: timed out")
    assert ch.announced == [native.EVENT_REFUSED, native.EVENT_FAILED]
    ls.begin()
    with pytest.raises(OutOfStep, match="rank 0: dispatch refused: this Buffer is out of step"):
        ls.enter("dispatch")
    assert state.refused == 2
    ls.resynced()
    assert (state.seq, state.refused, state.resolved, state.broken, ls.broken) == (0, 0, 0, False, None)


def test_an_unmatched_refusal_breaks_the_step_once_the_wait_times_out():
    ls = Lockstep(Channel(peer_refusals=0), native, rank=1, num_ranks=2, timeout_s=0.05)
    ls.begin()
    ls.refuse()
    ls.begin()
    with pytest.raises(OutOfStep, match=r"ranks \[0\] neither refused the call"):
        ls.enter("dispatch")
    assert ls.state.broken and not ls.state.in_step
