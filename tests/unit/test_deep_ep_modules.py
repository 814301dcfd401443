"""DeepEP's module layout, as the frameworks import it (../shared/reference/deepep-clients.md): every module path and
name DeepEP V1 and V2 code reaches resolves to portep's object, so that (for instance) Megatron-core's
`from deep_ep.utils import EventHandle, EventOverlap` succeeds instead of turning DeepEP off."""

import importlib

import pytest
import torch

import portep

# (module, names it must hold): V1's layout, V2's, and what each client imports
LAYOUT = [
    ("deep_ep", ["Buffer", "Config", "ElasticBuffer", "EPHandle", "EventHandle", "EventOverlap", "topk_idx_t"]),
    ("deep_ep.utils", ["EventHandle", "EventOverlap", "check_nvlink_connections"]),
    ("deep_ep.utils.event", ["EventHandle", "EventOverlap"]),
    ("deep_ep.buffer", ["Buffer", "Config", "EventOverlap", "topk_idx_t"]),
    ("deep_ep.buffers.legacy", ["Buffer"]),
    ("deep_ep.buffers.elastic", ["ElasticBuffer", "EPHandle"]),
    ("deep_ep_cpp", ["Config", "EventHandle"]),
]


@pytest.mark.parametrize("module, names", LAYOUT, ids=[m for m, _ in LAYOUT])
def test_each_deepep_module_holds_portep_objects(module, names):
    mod = importlib.import_module(module)
    for name in names:
        got = getattr(mod, name)
        if name == "check_nvlink_connections":
            assert callable(got)
        else:
            assert got is getattr(portep, name), f"{module}.{name} is not portep.{name}"
    assert set(names) <= set(mod.__all__)


def test_megatron_and_xtuner_imports_succeed():
    from deep_ep import Buffer  # noqa: F401
    from deep_ep.utils import EventHandle, EventOverlap
    from deep_ep_cpp import EventHandle as CppEventHandle

    assert CppEventHandle is EventHandle
    overlap = EventOverlap(EventHandle())  # Megatron's previous_event on the host: an event complete at once
    assert overlap.event.query()


def test_check_nvlink_connections_accepts_any_group():
    from deep_ep.utils import check_nvlink_connections

    store = torch.distributed.HashStore()
    group = torch.distributed.ProcessGroupGloo(store, 0, 1)
    assert check_nvlink_connections(group) is None
