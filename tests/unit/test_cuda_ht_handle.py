"""The CUDA backend's internode (one GPU per node) dispatch handle, built from the notify kernel's matrices by
CudaHT._internode_handle, against DeepEP's definitions computed from the routing alone (CPU tensors; no GPU)."""

import types

import pytest
import torch

from portep.backends.cuda.ht import CudaHT


def _ht(rank, num_nodes=None, ranks_per_node=1):
    """A CudaHT with only what building handles reads (no kernels, no GPU)."""
    ht = CudaHT.__new__(CudaHT)
    ht.owner = types.SimpleNamespace(launch_stream=None)
    ht.rank, ht.device = rank, torch.device("cpu")
    ht.num_nodes, ht.ranks_per_node = num_nodes, ranks_per_node
    ht.native = types.SimpleNamespace(HT_NVL_HEAD_COLUMNS=8)  # DeepEP's send_nvl_head width (NUM_MAX_NVL_PEERS)
    return ht


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


@pytest.mark.parametrize(
    "world,n_tokens,C,seed", [(2, [37, 21], 3, 1), (4, [16, 40, 9, 25], 5, 2), (3, [0, 12, 30], 2, 3)]
)
def test_internode_handle_matches_deepep_definitions(world, n_tokens, C, seed):
    in_rank = _routing(seed, world, n_tokens)
    for me in range(world):
        counts, rank_prefix, channel_prefix, rcp, send_head = _kernel_outputs(in_rank, me, C)
        ht = _ht(me)
        num_recv = int(counts[:, me].sum())
        self_begin = int(counts[:me, me].sum())
        h = ht._internode_handle(
            in_rank[me],
            rank_prefix[:, me].contiguous(),
            channel_prefix,
            rcp,
            send_head,
            num_recv,
            (self_begin, int(counts[me, me])),
        )
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
    ht = _ht(1)
    worst = 40
    h = ht._internode_handle(in_rank[1], rank_prefix[:, 1].contiguous(), channel_prefix, rcp, send_head, worst, None)
    num_recv = int(counts[:, 1].sum())
    assert h[7].shape == (worst, 8) and h[9].shape == (worst, 8)
    meta = h[7].view(torch.int32)
    assert bool((meta[num_recv:, 0] == 2).all())  # past the real rows: no source rank (== world)
    head = h[9][:, 0]
    from0 = int(counts[0, 1])
    assert torch.equal(head[:from0], torch.arange(from0, dtype=torch.int32))
    assert bool((head[from0:num_recv] == -1).all())  # rank 1's own rows are not forwarded


@pytest.mark.parametrize(
    "world,rpn,n_tokens,seed", [(4, 2, [37, 21, 0, 15], 4), (8, 4, [9, 30, 12, 5, 22, 0, 17, 8], 5)]
)
def test_forwarding_handle_matches_deepep_definitions(world, rpn, n_tokens, seed):
    """With forwarders (CudaHT._forwarding_handle): the kernels' matrices pass through in DeepEP's slots, the receive
    prefix is this rank's column of the rank prefix, recv_src_meta is the kernels' (node, mask) pairs as bytes, and
    send_rdma_head is each token's position among this rank's tokens to each node (-1 where none goes)."""
    in_rank = _routing(seed, world, n_tokens)
    nodes = world // rpn
    g = torch.Generator().manual_seed(seed + 100)
    for me in range(world):
        counts, rank_prefix, channel_prefix, rcp, _ = _kernel_outputs(in_rank, me, 3)
        fwd = tuple(
            torch.randint(0, 50, shape, generator=g, dtype=torch.int32) for shape in ((nodes, 3),) * 2 + ((nodes,),)
        )
        meta = torch.randint(-1, 9, (int(counts[:, me].sum()), 2), generator=g, dtype=torch.int32)
        nvl_head = torch.randint(-1, 20, (11, 8), generator=g, dtype=torch.int32)
        ht = _ht(me, nodes, rpn)
        h = ht._forwarding_handle(
            in_rank[me], rank_prefix[:, me].contiguous(), channel_prefix, rcp, fwd, meta, nvl_head
        )
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
                if bool(in_rank[me][t, n * rpn : (n + 1) * rpn].any()):
                    expected[t, n] = k
                    k += 1
        assert torch.equal(h[8], expected)


# ---- the kernels' arguments: CudaHT's calls against the binding's signatures (no GPU: a recorder stands in) ----
def _signature(method):
    """(names, required names) of a keyword-only method of native.HTKernels, from the binding's docstring."""
    from portep import native

    text = getattr(native.HTKernels, method).__doc__.splitlines()[0]
    params = text[text.index("*, ") + 3 : text.rindex(") ->")].split(", ")
    names = [p.split(":")[0] for p in params]
    return set(names), {n for n, p in zip(names, params) if " = " not in p}


class _Kernels:
    """Records each call of CudaHT after checking its keywords against native.HTKernels."""

    def __init__(self, counts=None):
        self.calls, self.counts = [], counts

    def _record(self, method, kw):
        names, required = _signature(method)
        assert set(kw) <= names, f"{method}: unknown {sorted(set(kw) - names)}"
        assert required <= set(kw), f"{method}: missing {sorted(required - set(kw))}"
        self.calls.append((method, kw))

    def notify(self, **kw):
        self._record("notify", kw)

    def dispatch(self, **kw):
        self._record("dispatch", kw)

    def combine(self, **kw):
        self._record("combine", kw)

    def wait_counts(self, ticket, num_local_experts):
        assert ticket == 1
        return self.counts


def _recording_ht(R, L, rank, counts=None):
    from portep import native

    ht = _ht(rank, R // L, L)
    assert native.HT_NVL_HEAD_COLUMNS == ht.native.HT_NVL_HEAD_COLUMNS
    ht.native, ht.num_ranks, ht.device_sms, ht.timeout_s, ht.ticket = native, R, 132, 1.0, 0
    ht.proxy = L < R
    ht.layout = native.HTLayout(
        num_ranks=R, ranks_per_node=L, proxy=ht.proxy, ctrl_off=1 << 30, area_off=0, area_bytes=1 << 28
    )
    ht.forward = ht.layout.forwarding
    ht.owner.raw_stream = lambda: 1234
    ht.owner.lockstep = types.SimpleNamespace(sending=lambda: None)
    ht.kernels = _Kernels(counts)
    return ht


def _inputs(N, H, R, E, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, E, (N, K), generator=g)
    in_rank = torch.zeros(N, R, dtype=torch.bool).scatter_(1, idx // (E // R), True)
    return x, idx, torch.rand(N, K, generator=g), in_rank, torch.bincount(idx.flatten(), minlength=E).int()


def _needs_kernels():
    from portep import native

    import ci_expect

    return ci_expect.needs("cuda-kernels", native.build_info()["gpu_built"], "this build has no GPU kernels")


def _same(got, want):
    """Whether the kernels got exactly these tensors (the same objects; None for None)."""
    return len(got) == len(want) and all(g is w for g, w in zip(got, want))


@_needs_kernels()
def test_dispatch_and_combine_name_every_tensor_they_pass():
    N, H, R, E, K, C, me = 40, 256, 2, 8, 2, 3, 1
    x, idx, w, in_rank, per_expert = _inputs(N, H, R, E, K)
    ht = _recording_ht(R, R, me, counts=(30, 10, 12, 0, [3] * (E // R)))
    recv_x, _, recv_idx, recv_w, counts, handle = ht.dispatch(x, None, idx, w, in_rank, per_expert, 1, 0, C, None)
    (_, n), (_, d) = ht.kernels.calls
    rank_prefix, channel_prefix, rcp, src_idx, _, send_head = handle
    tensors = ("is_token_in_rank", "rank_prefix", "channel_prefix", "recv_channel_prefix")
    assert _same([n[k] for k in tensors], [in_rank, rank_prefix, channel_prefix, rcp])
    fwd = ("node_channel_prefix", "fwd_channel_prefix", "fwd_rank_prefix")
    assert _same([n[k] for k in fwd], [None] * 3)
    assert {k: n[k] for k in ("channels", "stream", "count_mode", "num_tokens", "num_experts", "ticket")} == dict(
        channels=C, stream=1234, count_mode=True, num_tokens=N, num_experts=E, ticket=1
    )
    assert torch.equal(n["tokens_per_expert"], per_expert) and n["tokens_per_expert"].dtype == torch.int32
    assert n["recv_rank_prefix"].shape == (R,) and n["recv_rank_prefix"].dtype == torch.int32
    assert counts == [3] * (E // R) and recv_x.shape == (30, H) and recv_idx.shape == recv_w.shape == (30, K)
    assert d["x"] is x and d["row_bytes"] == 2 * H and d["num_tokens"] == N and d["num_topk"] == K
    assert n["recv_rank_prefix"] is not rank_prefix  # one node: the vector, and the [R][R] matrix for the handle
    assert d["recv_prefix"] is n["recv_rank_prefix"] and "rank_prefix_matrix" not in d
    assert _same([d["recv_x"], d["recv_topk_idx"], d["recv_topk_weights"]], [recv_x, recv_idx, recv_w])
    assert d["max_recv"] == 30 and d["topk_idx"] is idx and d["num_local_experts"] == E // R and d["scales"] is None
    assert _same([d["recv_src_idx"], d["send_head"], d["nvl_head"]], [src_idx, send_head, None])

    ht.kernels.calls.clear()  # cached, FP8-like rows with scales: the handle's matrices, no top-k
    scales = torch.rand(N, 4)
    recv, recv_scales = ht.dispatch(x, scales, None, None, None, None, 1, 0, C, handle)[:2]
    (_, n), (_, d) = ht.kernels.calls
    assert n == dict(channels=C, stream=1234)  # a flag: no tensors
    assert _same([d["channel_prefix"], d["recv_channel_prefix"]], [channel_prefix, rcp])
    assert d["rank_prefix_matrix"] is rank_prefix and "recv_prefix" not in d  # the kernels read column `me`
    assert d["max_recv"] == src_idx.size(0) and d["num_scales"] == 4
    assert _same([d["scales"], d["recv_scales"], d["recv_x"]], [scales, recv_scales, recv])
    assert d["topk_idx"] is None and d["num_topk"] == 0 and d["recv_topk_idx"] is None

    ht.kernels.calls.clear()
    bias = (torch.zeros(N, H, dtype=torch.bfloat16), torch.ones(N, H, dtype=torch.bfloat16))
    out, out_w = ht.combine(recv_x, handle, recv_w, bias)
    (_, n), (_, c) = ht.kernels.calls
    assert n == dict(channels=C, stream=1234)
    assert c["x"] is recv_x and (c["hidden"], c["num_tokens"], c["num_topk"]) == (H, N, K)
    assert _same([c["out"], c["out_weights"], c["topk_weights"]], [out, out_w, recv_w])
    assert _same([c["bias0"], c["bias1"], c["recv_channel_prefix"]], [bias[0], bias[1], rcp])
    assert c["rank_prefix_matrix"] is rank_prefix and c["is_token_in_rank"] is in_rank
    assert _same([c["fwd_channel_prefix"], c["fwd_rank_prefix"], c["nvl_head"]], [None] * 3)


@_needs_kernels()
def test_forwarding_passes_the_node_matrices_both_ways():
    N, H, R, L, E, K, C, me, worst = 24, 128, 4, 2, 8, 2, 2, 2, 50
    x, idx, w, in_rank, per_expert = _inputs(N, H, R, E, K, seed=3)
    ht = _recording_ht(R, L, me)
    recv_x, _, _, recv_w, _, handle = ht.dispatch(x, None, idx, w, in_rank, per_expert, 1, worst, C, None)
    (_, n), (_, d) = ht.kernels.calls
    assert n["max_recv"] == worst and "ticket" not in n
    assert _same(
        [n["node_channel_prefix"], n["fwd_channel_prefix"], n["fwd_rank_prefix"]], [handle[1], handle[3], handle[4]]
    )
    assert _same([d["fwd_channel_prefix"], d["fwd_rank_prefix"], d["nvl_head"]], [handle[3], handle[4], handle[9]])
    assert d["nvl_rows"] == worst * L
    assert d["recv_src_meta"].data_ptr() == handle[7].data_ptr() and d["recv_src_meta"].dtype == torch.int32
    assert d["recv_src_idx"] is None and d["send_head"] is None
    assert n["rank_prefix"] is None  # several nodes: no [R][R] matrix, the receive prefix vector is the handle's
    assert d["recv_prefix"] is n["recv_rank_prefix"] is handle[6] and "rank_prefix_matrix" not in d
    ht.kernels.calls.clear()
    ht.combine(recv_x, handle, recv_w, ())
    ((_, c),) = [call for call in ht.kernels.calls if call[0] == "combine"]
    assert _same([c["fwd_channel_prefix"], c["fwd_rank_prefix"], c["nvl_head"]], [handle[3], handle[4], handle[9]])
    assert c["recv_prefix"] is handle[6] and "rank_prefix_matrix" not in c
    assert c["recv_channel_prefix"] is handle[5] and c["is_token_in_rank"] is handle[0]
