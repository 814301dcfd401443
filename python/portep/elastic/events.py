"""DeepEP V2's `EventHandle`: an event recorded on the current CUDA stream when it is made (complete at once where
no CUDA context is in use: the host backend)."""

import torch


class EventHandle:
    """An event of the current stream at construction (DeepEP V2's `deep_ep.EventHandle`, what capture() returns
    and `previous_event` takes)."""

    def __init__(self) -> None:
        self.event = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.event = torch.cuda.Event()
            self.event.record()

    def current_stream_wait(self) -> None:
        """Make the current stream wait for the event (nothing to wait for without CUDA)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def query(self) -> bool:
        """Whether the event completed."""
        return self.event is None or self.event.query()

    def synchronize(self) -> None:
        """Block the CPU until the event completed."""
        if self.event is not None:
            self.event.synchronize()

    def __repr__(self) -> str:
        return f"EventHandle({'complete' if self.event is None else self.event!r})"
