"""portep: portable expert-parallel (MoE) communication.

GPU kernels (or host threads on the host backend) push 16-byte commands into FIFOs; C++ proxy threads turn
them into transfers on whatever transport the machine has. `portep.Buffer` is DeepEP V1's `deep_ep.Buffer` API
on top of this; `portep.Channel` is the low-level one-sided API it builds on.
"""

from . import config as _config  # noqa: F401  (first: asks CUDA for its most hardware queues, see config.py)
from ._native import native, native_error
from .channel import Channel, DEFAULT_TIMEOUT_S
from .deepep_config import Config
from .errors import DroppedInput
from .event import EventOverlap
from .lockstep import AgreedRefusal, OutOfStep

__version__ = "0.1.0"

__all__ = [
    "AgreedRefusal",
    "Buffer",
    "Channel",
    "Config",
    "DEFAULT_TIMEOUT_S",
    "DroppedInput",
    "ElasticBuffer",
    "EPHandle",
    "EventHandle",
    "EventOverlap",
    "OutOfStep",
    "native",
    "native_error",
    "get_logical_domain_size",
    "get_physical_domain_size",
    "topk_idx_t",
    "__version__",
]


_ELASTIC = ("ElasticBuffer", "EPHandle", "EventHandle", "get_logical_domain_size", "get_physical_domain_size")


def __getattr__(name):
    # Buffer and topk_idx_t need torch; importing them lazily keeps `import portep` (and portep.doctor) torch-free.
    if name in ("Buffer", "topk_idx_t"):
        from . import buffer

        return getattr(buffer, name)
    if name in _ELASTIC:
        from . import elastic

        return getattr(elastic, name)
    raise AttributeError(f"module 'portep' has no attribute {name!r}")
