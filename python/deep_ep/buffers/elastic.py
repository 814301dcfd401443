"""`deep_ep.buffers.elastic` (DeepEP V2's module of `ElasticBuffer`), served by portep."""

from portep import ElasticBuffer, EPHandle

__all__ = ["ElasticBuffer", "EPHandle"]
