"""Keyword arguments that exist only on DeepEP branches (../shared/reference/deepep-clients.md: SGLang's Blackwell
builds pass use_nvfp4 and x_global_scale; the hybrid-ep branch's Buffer takes allow_nvlink_for_normal_mode) are refused
with a TypeError, which clients catch to retry without them, naming each and what portep serves instead; any other
unknown keyword gets Python's own TypeError, and the signatures clients inspect do not list them."""

import inspect

import pytest
import torch

import portep

X, IDX = torch.zeros(2, 512, dtype=torch.bfloat16), torch.zeros(2, 2, dtype=torch.int64)


def test_an_nvfp4_dispatch_is_refused_naming_what_portep_dispatches():
    with pytest.raises(TypeError) as e:
        portep.Buffer.low_latency_dispatch(object(), X, IDX, 2, 4, use_nvfp4=True, x_global_scale=None)
    text = str(e.value)
    assert "low_latency_dispatch() got keyword arguments that portep does not serve" in text
    assert "use_nvfp4: NVFP4 low-latency dispatch" in text and "x_global_scale: NVFP4's global scale" in text
    assert "use_fp8, round_scale, use_ue8m0" in text


def test_the_hybrid_ep_branchs_constructor_argument_is_refused_before_any_collective():
    with pytest.raises(TypeError, match="allow_nvlink_for_normal_mode: the hybrid-ep branch's normal-mode kernels"):
        portep.Buffer(None, 1 << 20, allow_nvlink_for_normal_mode=True)


def test_other_unknown_keywords_get_pythons_own_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'not_an_argument'"):
        portep.Buffer.low_latency_dispatch(object(), X, IDX, 2, 4, not_an_argument=1)


def test_the_signatures_clients_inspect_list_no_branch_keyword():
    for method in (portep.Buffer.__init__, portep.Buffer.low_latency_dispatch):
        params = inspect.signature(method).parameters
        assert not {"use_nvfp4", "x_global_scale", "use_ue8m0_for_sf", "allow_nvlink_for_normal_mode"} & set(params)
        assert "self" in params
