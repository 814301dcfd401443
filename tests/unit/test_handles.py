"""The typed handles (portep/handles.py), normal mode and low-latency: they are DeepEP's tuples, position for
position, and a tuple or list a caller rebuilt comes back typed."""

import pytest
import torch

from portep.handles import InternodeHandle, IntranodeHandle, LLHandle, handle_length, ll_handle, normal_handle
from portep.validation import check_normal_handle


def _tensors(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 1000, (3 + i,), generator=g, dtype=torch.int32) for i in range(n)]


def test_deepep_positions_are_the_named_fields():
    intra = IntranodeHandle(*_tensors(6, 1))
    assert intra[4] is intra.is_token_in_rank and intra[1] is intra.send_channel_prefix
    assert intra[2] is intra.recv_channel_prefix and intra.num_recv_tokens == intra[3].size(0)
    inter = InternodeHandle(*_tensors(10, 2))
    assert inter[0] is inter.is_token_in_rank and inter[2] is inter.send_channel_prefix
    assert inter[5] is inter.recv_channel_prefix and inter.num_recv_tokens == inter[7].size(0)
    assert inter[-4] is inter.recv_gbl_rank_prefix_sum  # where DeepEP's test_internode.py reads it
    assert inter[8] is inter.send_rdma_head and inter[9] is inter.send_nvl_head
    assert (handle_length(False), handle_length(True)) == (6, 10)


@pytest.mark.parametrize("internode", [False, True])
def test_a_handle_is_the_tuple_deepep_code_unpacks(internode):
    items = _tensors(handle_length(internode), 3)
    h = normal_handle(items, internode)
    assert isinstance(h, tuple) and len(h) == len(items)
    unpacked = list(h)
    assert all(a is b for a, b in zip(unpacked, items))
    assert normal_handle(h, internode) is h
    assert type(normal_handle(tuple(h), internode)) is type(h)
    assert type(normal_handle(list(h), internode)) is type(h)


@pytest.mark.parametrize("num_nodes", [1, 2])
def test_a_rebuilt_tuple_passes_the_buffer_checks_typed(num_nodes):
    R, C, N, M = 4, 3, 5, 7
    g = torch.Generator().manual_seed(11 + num_nodes)
    in_rank = torch.rand(N, R, generator=g) < 0.5
    prefix = torch.randint(0, 9, (R, C), generator=g, dtype=torch.int32)
    if num_nodes == 1:
        fields = [prefix.new_zeros(R, R), prefix, prefix, torch.zeros(M, dtype=torch.int32), in_rank, prefix]
    else:
        Nn = num_nodes
        fields = [in_rank, prefix[:Nn], prefix, prefix[:Nn], torch.zeros(Nn, dtype=torch.int32), prefix]
        fields += [torch.zeros(R, dtype=torch.int32), torch.zeros(M, 8, dtype=torch.uint8), in_rank, prefix]
    handle, num_tokens, num_recv, channels = check_normal_handle(tuple(fields), R, num_nodes)
    assert type(handle) is (IntranodeHandle if num_nodes == 1 else InternodeHandle)
    assert (num_tokens, num_recv, channels) == (N, M, C)
    with pytest.raises(ValueError, match="handle has 6 elements; a dispatch handle of this Buffer has 10"):
        check_normal_handle(tuple(fields[:6]), R, 2)


def test_the_ll_handle_is_deepeps_5_tuple_with_named_fields():
    src_info, layout_range = _tensors(2, 4)
    h = LLHandle(src_info, layout_range, 128, 7168, 256)
    assert isinstance(h, tuple) and len(h) == 5
    a, b, T, H, E = h  # as DeepEP code unpacks it
    assert a is h.src_info is src_info and b is h.layout_range is layout_range
    assert (T, H, E) == (h.num_max_dispatch_tokens_per_rank, h.hidden, h.num_experts) == (128, 7168, 256)
    assert h[2:] == (128, 7168, 256)
    assert ll_handle(h) is h
    assert type(ll_handle(tuple(h))) is LLHandle and ll_handle(list(h)) == h
