"""`deep_ep` drop-in: DeepEP's Python API served by portep, V1 (`Buffer`) and V2 (`ElasticBuffer`, `EPHandle`).

Existing code keeps its imports::

    import deep_ep
    from deep_ep import Buffer, Config, EventOverlap
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=4096, hidden=7168)
    topk_idx = topk_idx.to(deep_ep.topk_idx_t)

Keeping a real DeepEP installed side by side: this module and DeepEP's both install a top-level package named
`deep_ep`, so whichever was installed last owns the name (pip does not merge them, and uninstalling one can
remove files of the other; reinstall the one you want to own `deep_ep` afterwards). To run both in one
environment, let DeepEP own `deep_ep` and reach portep under its own name, which always works::

    import portep as deep_ep          # or: from portep import Buffer, Config, EventOverlap, topk_idx_t

Which implementation is active: `deep_ep.Buffer.__module__` is "portep.buffer" for portep.
"""

from portep import (
    Buffer,
    Config,
    ElasticBuffer,
    EPHandle,
    EventHandle,
    EventOverlap,
    get_logical_domain_size,
    get_physical_domain_size,
    topk_idx_t,
)

# The DeepEP release whose API this drop-in serves (V1 and V2 of DeepEP 2.1); portep's own is portep.__version__.
__version__ = "2.1.0"

__all__ = [
    "Buffer",
    "Config",
    "ElasticBuffer",
    "EPHandle",
    "EventHandle",
    "EventOverlap",
    "get_logical_domain_size",
    "get_physical_domain_size",
    "topk_idx_t",
    "__version__",
]
