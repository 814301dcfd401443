"""`deep_ep.buffers.legacy` (DeepEP V2's module of the V1 `Buffer`), served by portep."""

from portep import Buffer

__all__ = ["Buffer"]
