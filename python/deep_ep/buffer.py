"""`deep_ep.buffer` (DeepEP V1's module of `Buffer`), served by portep."""

from portep import Buffer, Config, EventOverlap, topk_idx_t

__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t"]
