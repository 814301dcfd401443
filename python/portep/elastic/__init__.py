"""DeepEP V2's API (`ElasticBuffer`, `EPHandle`, `EventHandle` and the domain helpers) over portep's V1 Buffer."""

from .buffer import ElasticBuffer, get_logical_domain_size, get_physical_domain_size
from .events import EventHandle
from .handle import EPHandle

__all__ = ["EPHandle", "ElasticBuffer", "EventHandle", "get_logical_domain_size", "get_physical_domain_size"]
