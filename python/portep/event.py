"""DeepEP's `EventOverlap`, and the event the host backend hands out. Pure Python, no torch."""

from typing import Optional


class HostEvent:
    """An event of the host backend. Host operations finish before they return, so it is always complete;
    it exists so that `async_finish=True` code (current_stream_wait(), `with event:`) runs unchanged."""

    def current_stream_wait(self) -> None:
        """Nothing to wait for: the operation finished before it returned."""

    def query(self) -> bool:
        """Always True: complete."""
        return True

    def synchronize(self) -> None:
        """Nothing to wait for: the operation finished before it returned."""

    def __repr__(self):
        return "HostEvent(complete)"


class EventOverlap:
    """A wrapper of an operation's completion event, for overlapping, as in DeepEP.

    Attributes:
        event: the event, or None when the operation was not asked for `async_finish`.
        extra_tensors: tensors kept alive until the event is consumed (DeepEP's CUDA-graph-friendly
            substitute for `record_stream`; the low-latency operations fill it).
    """

    event = None  # (class attributes: the LL fast path makes instances without calling __init__)
    extra_tensors = None

    def __init__(self, event: object = None, extra_tensors: Optional[tuple] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Make the current stream wait for the event (DeepEP asserts that there is one)."""
        if self.event is None:
            raise RuntimeError(
                "EventOverlap.current_stream_wait() needs an event; this one has none "
                "(the operation was not called with async_finish=True)"
            )
        self.event.current_stream_wait()

    def __call__(self):
        # DeepEP's docstring writes `with event_overlap():`; both spellings work.
        return self

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        if self.event is not None:
            self.event.current_stream_wait()

    def __repr__(self):
        return f"EventOverlap(event={self.event!r})"
