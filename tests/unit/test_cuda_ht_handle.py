"""The CUDA backend's internode (one GPU per node) dispatch handle, built from the notify kernel's matrices by
CudaHT._internode_handle, against DeepEP's definitions computed from the routing alone (CPU tensors; no GPU)."""

import types

import pytest
import torch

from portep.backends.cuda.ht import CudaHT


def _routing(seed, world, n_tokens):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(n, world, generator=g) < 0.6 for n in n_tokens]


def _kernel_outputs(in_rank, me, C):
    """What the notify and dispatch kernels hand to _internode_handle on rank me: the inclusive [R][R] rank prefix,
    this rank's inclusive channel prefix and exclusive receive channel prefix, and send_head (positions)."""
    world = len(in_rank)
    counts = torch.stack([m.sum(0) for m in in_rank]).to(torch.int32)  # [src, dst]
    rank_prefix = torch.cumsum(counts, 0).to(torch.int32)

    def per_channel(m):  # [R, C]: tokens to each rank per channel
        n = m.size(0)
        per = -(-n // C) if n else 1
        ch = torch.arange(n) // per
        return torch.stack([torch.bincount(ch[m[:, d]], minlength=C)[:C] for d in range(world)]).to(torch.int32)

    channel_prefix = torch.cumsum(per_channel(in_rank[me]), 1).to(torch.int32)
    from_src = torch.stack([per_channel(in_rank[s])[me] for s in range(world)])
    rcp = (torch.cumsum(from_src, 1) - from_src).to(torch.int32)
    send_head = torch.where(in_rank[me], torch.cumsum(in_rank[me].to(torch.int32), 0) - 1, -1).to(torch.int32)
    return counts, rank_prefix, channel_prefix, rcp, send_head


@pytest.mark.parametrize("world,n_tokens,C,seed", [(2, [37, 21], 3, 1), (4, [16, 40, 9, 25], 5, 2),
                                                     (3, [0, 12, 30], 2, 3)])
def test_internode_handle_matches_deepep_definitions(world, n_tokens, C, seed):
    in_rank = _routing(seed, world, n_tokens)
    for me in range(world):
        counts, rank_prefix, channel_prefix, rcp, send_head = _kernel_outputs(in_rank, me, C)
        ht = CudaHT.__new__(CudaHT)
        ht.eng = types.SimpleNamespace(rank=me, device=torch.device("cpu"), launch_stream=None)
        num_recv = int(counts[:, me].sum())
        self_begin = int(counts[:me, me].sum())
        h = ht._internode_handle(in_rank[me], rank_prefix, channel_prefix, rcp, send_head, num_recv,
                                 (self_begin, int(counts[me, me])))
        assert len(h) == 10
        assert torch.equal(h[0], in_rank[me])
        assert torch.equal(h[1], channel_prefix) and torch.equal(h[2], channel_prefix)
        assert torch.equal(h[3], rcp) and torch.equal(h[5], rcp)
        recv_prefix = torch.cumsum(counts[:, me], 0).to(torch.int32)
        assert torch.equal(h[4], recv_prefix) and torch.equal(h[6], recv_prefix)
        src = torch.cat([torch.full((int(counts[s, me]),), s, dtype=torch.int32) for s in range(world)])
        meta = h[7].view(torch.int32)
        assert h[7].dtype == torch.uint8 and h[7].shape == (num_recv, 8)
        assert torch.equal(meta[:, 0], src) and bool((meta[:, 1] == 1).all())
        assert torch.equal(h[8], send_head)
        # rows this rank serves as its node's forwarder: every other source's block, column 0 = index in the block
        others = [torch.arange(int(counts[s, me]), dtype=torch.int32) for s in range(world) if s != me]
        expected = torch.full((num_recv - int(counts[me, me]), 8), -1, dtype=torch.int32)
        expected[:, 0] = torch.cat(others) if others else torch.empty(0, dtype=torch.int32)
        assert torch.equal(h[9], expected)


def test_internode_handle_with_num_worst_tokens_pads_rows():
    in_rank = _routing(7, 2, [20, 11])
    counts, rank_prefix, channel_prefix, rcp, send_head = _kernel_outputs(in_rank, 1, 2)
    ht = CudaHT.__new__(CudaHT)
    ht.eng = types.SimpleNamespace(rank=1, device=torch.device("cpu"), launch_stream=None)
    worst = 40
    h = ht._internode_handle(in_rank[1], rank_prefix, channel_prefix, rcp, send_head, worst, None)
    num_recv = int(counts[:, 1].sum())
    assert h[7].shape == (worst, 8) and h[9].shape == (worst, 8)
    meta = h[7].view(torch.int32)
    assert bool((meta[num_recv:, 0] == 2).all())  # past the real rows: no source rank (== world)
    head = h[9][:, 0]
    from0 = int(counts[0, 1])
    assert torch.equal(head[:from0], torch.arange(from0, dtype=torch.int32))
    assert bool((head[from0:num_recv] == -1).all())  # rank 1's own rows are not forwarded


@pytest.mark.parametrize("world,rpn,n_tokens,seed", [(4, 2, [37, 21, 0, 15], 4),
                                                     (8, 4, [9, 30, 12, 5, 22, 0, 17, 8], 5)])
def test_forwarding_handle_matches_deepep_definitions(world, rpn, n_tokens, seed):
    """With forwarders (CudaHT._forwarding_handle): the kernels' matrices pass through in DeepEP's slots, the receive
    prefix is this rank's column of the rank prefix, recv_src_meta is the kernels' (node, mask) pairs as bytes, and
    send_rdma_head is each token's position among this rank's tokens to each node (-1 where none goes)."""
    in_rank = _routing(seed, world, n_tokens)
    nodes = world // rpn
    g = torch.Generator().manual_seed(seed + 100)
    for me in range(world):
        counts, rank_prefix, channel_prefix, rcp, _ = _kernel_outputs(in_rank, me, 3)
        fwd = tuple(torch.randint(0, 50, shape, generator=g, dtype=torch.int32) for shape in ((nodes, 3),) * 2 +
                    ((nodes,),))
        meta = torch.randint(-1, 9, (int(counts[:, me].sum()), 2), generator=g, dtype=torch.int32)
        nvl_head = torch.randint(-1, 20, (11, 8), generator=g, dtype=torch.int32)
        ht = CudaHT.__new__(CudaHT)
        ht.eng = types.SimpleNamespace(rank=me, device=torch.device("cpu"), launch_stream=None, num_nodes=nodes,
                                       ranks_per_node=rpn)
        h = ht._forwarding_handle(in_rank[me], rank_prefix, channel_prefix, rcp, fwd, meta, nvl_head)
        assert len(h) == 10
        assert h[0] is in_rank[me] and h[1] is fwd[0] and h[2] is channel_prefix and h[3] is fwd[1]
        assert h[4] is fwd[2] and h[5] is rcp and h[9] is nvl_head
        assert torch.equal(h[6], torch.cumsum(counts[:, me], 0).to(torch.int32))
        assert h[7].dtype == torch.uint8 and h[7].shape == (meta.size(0), 8)
        assert torch.equal(h[7].view(torch.int32), meta)
        expected = torch.full((n_tokens[me], nodes), -1, dtype=torch.int32)
        for n in range(nodes):
            k = 0
            for t in range(n_tokens[me]):
                if bool(in_rank[me][t, n * rpn:(n + 1) * rpn].any()):
                    expected[t, n] = k
                    k += 1
        assert torch.equal(h[8], expected)
