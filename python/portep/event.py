"""DeepEP's `EventOverlap`, and the event the host backend hands out. Pure Python, no torch."""

from typing import Callable, Optional

from .errors import NoEventError


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
    """A wrapper of an operation's completion event, for overlapping, as in DeepEP (V1's, with V2's additions).

    Attributes:
        event: the event, or None when the operation was not asked for `async_finish` (V1) or
            `async_with_compute_stream` (V2).
        extra_tensors: tensors kept alive until the event is consumed (DeepEP's CUDA-graph-friendly
            substitute for `record_stream`; the low-latency operations fill it).
    """

    event = None  # (class attributes: the LL fast path makes instances without calling __init__)
    extra_tensors = None
    _hook = None
    _release_on_exit = False

    def __init__(self, event: object = None, extra_tensors: Optional[tuple] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """Make the current stream wait for the event (DeepEP asserts that there is one), then run the hook
        registered with register_hook_after_wait (once); release_handle=True drops the event afterwards."""
        if self.event is None:
            raise NoEventError(
                "EventOverlap.current_stream_wait() needs an event; this one has none "
                "(the operation was not called with async_finish=True / async_with_compute_stream=True)"
            )
        self.event.current_stream_wait()
        hook, self._hook = self._hook, None
        if hook is not None:
            hook()
        if release_handle:
            self.event = None
            self.extra_tensors = None

    def register_hook_after_wait(self, hook: Callable[[], None]) -> None:
        """hook() runs once, right after the next current_stream_wait() (V2; at most one hook)."""
        if self._hook is not None:
            raise ValueError("EventOverlap.register_hook_after_wait: a hook is already registered")
        self._hook = hook

    def __call__(self, release_handle: bool = False) -> "EventOverlap":
        # DeepEP V1's docstring writes `with event_overlap():`, V2's `with event(release_handle=True):`
        self._release_on_exit = release_handle
        return self

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type: object, exc_value: object, traceback: object) -> None:
        release, self._release_on_exit = self._release_on_exit, False
        if self.event is not None:
            self.current_stream_wait(release_handle=release)

    def __repr__(self) -> str:
        return f"EventOverlap(event={self.event!r})"
