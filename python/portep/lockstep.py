"""Keeping the ranks of a Buffer in step, or failing loudly when they are not (both engines).

Every collective call (dispatch, combine and their low-latency forms) moves per-call state on: the LL buffer half,
the parity of the count exchange, signals consumed. A rank that refuses a call after its peers started it, or a call
that fails half way (a timeout), leaves the ranks one call apart, and later calls would read each other's stale
data. So:
- a rank that refuses a call (invalid input) tells every rank (a REFUSED status event, proxy/
  peer_watch.h); peers waiting for it in that call give up at once and raise. At its next call the refusing rank
  checks that every peer refused that call too (then nothing happened anywhere and all go on) or else that the
  peer failed it, which leaves the Buffer out of step;
- a call that fails after it started tells every rank (FAILED) and leaves this rank's Buffer out of step: every
  later call raises, saying how to resynchronise (clean_low_latency_buffer on every rank, which `resync` serves), and
  counts as refused, so peers do not wait for it;
- every call has a sequence number that travels with its data (LL messages and rows, the normal mode's count
  exchange), so a peer one call ahead or behind is detected and raised, naming both calls.
"""

import time
from typing import Any, Optional

CLEAN_HINT = (
    "call clean_low_latency_buffer(...) on every rank to resynchronise (a normal-mode Buffer: destroy it "
    "and create a new one on every rank)"
)


class OutOfStep(RuntimeError):
    """The ranks of a Buffer are not in step: this rank refuses calls until they resynchronise."""


class AgreedRefusal(ValueError):
    """A refusal every rank reaches alike, from what all of them know (the buffer's size against counts they all
    exchanged): raised after the call's first traffic, it leaves the ranks in step."""


def wire_seq(seq: int) -> int:
    """A call's sequence number as the LL messages carry it: 32 bits, never 0 (zeroed memory must not match a call),
    so seq 2**32 - 1 is followed by 1."""
    return (seq - 1) % 0xFFFFFFFF + 1


class Lockstep:
    """A Buffer's call protocol. Its counters live in one native object, `state` (native.LockstepState,
    python/src/ll_shared.h), which the LL fast path (backends/cuda/ll_fast.py) reads and advances directly."""

    def __init__(self, channel: Any, native: Any, rank: int, num_ranks: int, timeout_s: float) -> None:
        self.channel, self.native = channel, native
        self.rank, self.num_ranks, self.timeout_s = rank, num_ranks, timeout_s
        self.state = native.LockstepState()
        self._broken = None  # why this rank is out of step (None: in step); state.broken mirrors it
        self.mask = None  # shrink mode: the engine's uint8 [R] mask (1 = masked), whose ranks are not waited for

    @property
    def seq(self) -> int:
        """Collective calls this rank made or refused since the last resync."""
        return self.state.seq

    @property
    def sent(self) -> bool:
        """Whether the current call sent anything yet (sending())."""
        return self.state.sent

    @property
    def broken(self) -> Optional[str]:
        """Why this rank is out of step (None: in step)."""
        return self._broken

    @broken.setter
    def broken(self, why: Optional[str]) -> None:
        self._broken = why
        self.state.broken = why is not None

    # ---- the call protocol ----
    def begin(self) -> None:
        """A collective call begins (made or refused, it counts: every rank numbers its calls alike)."""
        self.state.begin()

    def enter(self, what: str) -> int:
        """Before a call's first traffic: raise if out of step; settle this rank's earlier refusals; returns the
        call's sequence number."""
        if self.broken is not None:
            self.refuse()
            raise OutOfStep(
                f"rank {self.rank}: {what} refused: this Buffer is out of step ({self.broken}); {CLEAN_HINT}"
            )
        if not self.state.in_step:
            self._settle_refusals(what)
        return self.seq

    def sending(self) -> None:
        """The current call's first traffic (a signal, a write, a kernel launch) goes out now."""
        self.state.sent = True

    def refuse(self) -> None:
        """This rank will not make the call its peers may be making, and has sent nothing of it: tell them, so
        their waits give up."""
        self.state.refused += 1
        self.channel.announce(self.native.EVENT_REFUSED)

    def fail(self, what: str, error: BaseException) -> None:
        """A call failed after it started: this rank is out of step until the ranks resynchronise. Its FAILED
        event goes out before any later REFUSED one (direct stores in program order), which _settle_refusals
        relies on."""
        if self.broken is None:
            self.broken = f"{what} #{self.seq} failed on rank {self.rank}: {error}"
            self.channel.announce(self.native.EVENT_FAILED)

    def check_seq(self, what: str, got: Any, src: int, seq: Optional[int] = None) -> None:
        """Sequence numbers that arrived with src's data for a call (a tensor or an int): `seq`, the call's own
        number, taken when it began (a receive hook runs after later calls may have begun), else the current one."""
        seq = self.seq if seq is None else seq
        if hasattr(got, "numel"):
            if got.numel() == 0 or bool((got == seq).all()):
                return
            got = int(got[got != seq][0])
        if got != seq:
            raise OutOfStep(
                f"rank {self.rank}: {what} #{seq} received data of rank {src}'s call #{got}: the ranks are out of step"
            )

    def resynced(self) -> None:
        """After every rank zeroed its REFUSED and FAILED status slots between two synchronisations."""
        self.state.seq = self.state.refused = self.state.resolved = 0
        self.broken = None

    # ---- internals ----
    def _settle_refusals(self, what):
        """Every peer refused this rank's refused calls too (nothing happened anywhere), or some peer failed one."""
        ch, n = self.channel, self.native
        deadline = time.monotonic() + self.timeout_s
        pending = {p for p in range(self.num_ranks) if p != self.rank and not (self.mask is not None and self.mask[p])}
        while pending:
            for p in list(pending):
                status = ch.peer_status(p)  # (the watch's: a few milliseconds old)
                if status in (n.PEER_LEFT, n.PEER_GONE) and self.mask is not None:
                    pending.discard(p)
                elif status in (n.PEER_LEFT, n.PEER_GONE) or ch.status_events(p, n.EVENT_FAILED):
                    self.broken = (
                        f"rank {p} {n.peer_status_text(max(status, n.PEER_FAILED))} after this rank refused a call"
                    )
                elif ch.status_events(p, n.EVENT_REFUSED) >= self.state.refused:  # read after FAILED: see fail()
                    pending.discard(p)
            if self.broken is None and pending and time.monotonic() > deadline:
                self.broken = (
                    f"ranks {sorted(pending)} neither refused the call this rank refused nor reported "
                    f"failing it within {self.timeout_s} s"
                )
            if self.broken is not None:
                self.fail(what, self.broken)
                raise OutOfStep(
                    f"rank {self.rank}: {what} refused: this Buffer is out of step ({self.broken}); {CLEAN_HINT}"
                )
            if pending:
                time.sleep(0.0005)
        self.state.resolved = self.state.refused
