"""portep: portable expert-parallel (MoE) communication.

GPU kernels (or host threads on the host backend) push 16-byte commands into FIFOs; C++ proxy threads turn
them into transfers on whatever transport the machine has. This release provides the native core and the
low-level channel API (`portep.Channel`); the DeepEP-compatible `Buffer` builds on it.
"""

from ._native import native, native_error
from .channel import Channel, DEFAULT_TIMEOUT_S

__version__ = "0.1.0"

__all__ = ["Channel", "DEFAULT_TIMEOUT_S", "native", "native_error", "__version__"]
