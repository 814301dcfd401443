"""`deep_ep_cpp`, DeepEP V1's extension module, as V1 code imports from it (xtuner: `from deep_ep_cpp import
EventHandle`; DeepEP's own `Config`): served by portep. Installed beside `deep_ep`; like it, it shadows a real
DeepEP's module of that name (python/deep_ep/__init__.py says how to keep both)."""

from portep import Config, EventHandle

__all__ = ["Config", "EventHandle"]
