"""`deep_ep.utils.event` (DeepEP V2): the event classes."""

from portep import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
