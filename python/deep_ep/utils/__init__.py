"""`deep_ep.utils` as DeepEP code imports it: V1's module (`EventOverlap`, `EventHandle`, `check_nvlink_connections`)
and V2's package (its `__init__` exports `EventHandle`; `deep_ep.utils.event` holds both event classes). Megatron-core
imports `from deep_ep.utils import EventHandle, EventOverlap` and turns DeepEP off where that import fails."""

from typing import Any

from portep import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap", "check_nvlink_connections"]


def check_nvlink_connections(group: Any) -> None:
    """DeepEP's check that every pair of the group's GPUs on a node has NVLink (it refuses PCIe GPUs beyond two
    ranks). portep needs no NVLink between any pair: same-node peers that CUDA IPC maps are reached by stores, and
    every other peer through the proxies (docs/design.md §6), so no group is refused; `group` (a
    torch.distributed.ProcessGroup) is taken as DeepEP takes it."""
    del group
