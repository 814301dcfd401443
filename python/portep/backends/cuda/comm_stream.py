"""DeepEP's stream rules for the normal-mode operations on the CUDA backend (reference deepep-api.md §1.6): the
kernels run on the Buffer's communication stream, which first waits on `previous_event` (else on the current
stream); `async_finish=False` makes the current stream wait for it afterwards; `async_finish=True` returns an event
on it and keeps inputs and outputs alive for it (`record_stream`); `allocate_on_comm_stream=True` allocates the
outputs with the communication stream current and keeps them alive for the current stream."""

import torch

from ...event import EventOverlap
from .engine import CudaEvent


def _tensors(value):
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


class CommStream:
    def __init__(self, engine):
        self.engine = engine
        self.stream = engine.comm_stream

    def run(self, fn, previous_event, async_finish, allocate_on_comm_stream, inputs=()):
        """fn() with the engine's kernels launched on the communication stream; returns (fn's result, EventOverlap)."""
        engine = self.engine
        compute = torch.cuda.current_stream(self.stream.device)
        prev = getattr(previous_event, "event", None)
        if isinstance(prev, CudaEvent):
            self.stream.wait_event(prev.event)
        elif prev is not None:  # the LL fast path's native event (python/src/ll_torch_event.cpp)
            with torch.cuda.stream(self.stream):
                prev.current_stream_wait()
        else:
            self.stream.wait_stream(compute)
        engine.launch_stream = self.stream
        try:
            if allocate_on_comm_stream:
                with torch.cuda.stream(self.stream):
                    out = fn()
            else:
                out = fn()
        finally:
            engine.launch_stream = None
        with torch.cuda.stream(self.stream):
            event = EventOverlap(CudaEvent() if async_finish else None)
        outputs = _tensors(out)
        if allocate_on_comm_stream:
            for t in outputs:
                t.record_stream(compute)
        elif async_finish:
            for t in outputs:
                t.record_stream(self.stream)
        if async_finish:
            for t in _tensors(inputs):
                t.record_stream(self.stream)
        else:
            compute.wait_stream(self.stream)
        return out, event
