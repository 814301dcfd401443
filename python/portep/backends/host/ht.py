"""HT (normal-mode) layout, dispatch and combine on the host backend (see backends/host/engine.py for the model).

Dispatch, per call: (1) exchange counts, so every rank knows every rank's memory layout for this call; (2) write
each token once to every same-node destination, at its final row (source-rank blocks in ascending order, source
token order inside a block), and once per other node to that node's forwarder, in chunks through the proxies;
(3) forwarders place what they received for their node peers; (4) each rank waits for the final signal of every
same-node writer and unpacks. Combine runs the same paths backwards: same-node contributions are stored into
the source's memory, other-node contributions are summed in FP32 by the forwarder (node ranks ascending) and sent
back as one partial per token; the source adds bias, same-node rows (ranks ascending) and partials (nodes
ascending), so results are bitwise reproducible.

Record of one dispatched token (16-byte aligned): [src_token i32, node_mask i32, src_rank i32, 0 i32]
[x bytes][scales S x 4][0-4 bytes to an 8-byte boundary][topk ids K x i64 (global)][topk weights K x f32].
"""

import torch

from .. import common as hb
from ...handles import InternodeHandle, IntranodeHandle

HEADER = 16


def dispatch_layout(eng, topk_idx, num_experts):
    R = eng.num_ranks
    E_l = num_experts // R
    N = topk_idx.size(0)
    valid = topk_idx >= 0
    owner = torch.where(valid, topk_idx // E_l, torch.full_like(topk_idx, R))
    in_rank = torch.zeros(N, R + 1, dtype=torch.bool)
    in_rank.scatter_(1, owner, True)
    is_token_in_rank = in_rank[:, :R].contiguous()
    per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
    per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
    per_node = None
    if eng.num_nodes > 1:
        per_node = is_token_in_rank.view(N, eng.num_nodes, eng.ranks_per_node).any(2).sum(0, dtype=torch.int32)
    return per_rank, per_node, per_expert, is_token_in_rank


def channel_ids(num_tokens, num_channels):
    """DeepEP's split of tokens into contiguous channel ranges."""
    per = (num_tokens + num_channels - 1) // num_channels if num_tokens else 1
    return torch.arange(num_tokens) // max(per, 1)


class _Record:
    def __init__(self, hidden_bytes, num_scales, num_topk):
        self.x = HEADER
        self.scales = self.x + hidden_bytes
        self.topk = hb.align(self.scales + 4 * num_scales, 8)  # int64 ids: read in place as int64 (also one row)
        self.weights = self.topk + 8 * num_topk
        self.bytes = hb.align(self.weights + 4 * num_topk)
        self.hidden_bytes, self.num_scales, self.num_topk = hidden_bytes, num_scales, num_topk


class _RecordParts:
    """A dispatch's records in three parts, written straight into their destinations with native row copies:
    the header (its node mask set per destination node), the payload rows of x itself, and the tail (scales,
    top-k ids and weights, padding)."""

    def __init__(self, eng, rec, x, x_scales, topk_idx, topk_weights):
        N = x.size(0)
        self.rec = rec
        header = torch.zeros(N, 4, dtype=torch.int32)
        header[:, 0] = torch.arange(N, dtype=torch.int32)
        header[:, 2] = eng.rank
        self.header = header
        self.x = x.contiguous().view(torch.uint8).view(N, rec.hidden_bytes)
        tail = torch.zeros(N, rec.bytes - rec.scales, dtype=torch.uint8)
        if rec.num_scales:
            tail[:, : 4 * rec.num_scales] = x_scales.contiguous().view(torch.uint8).view(N, 4 * rec.num_scales)
        o = rec.topk - rec.scales
        if rec.num_topk:
            K = rec.num_topk
            tail[:, o : o + 8 * K] = topk_idx.to(torch.int64).contiguous().view(torch.uint8).view(N, 8 * K)
            tail[:, o + 8 * K : o + 12 * K] = (
                topk_weights.to(torch.float32).contiguous().view(torch.uint8).view(N, 4 * K)
            )
        self.tail = tail

    def write(self, eng, dst, rows, node_mask):
        """Records of `rows` (int64 token indices), back to back from dst (a uint8 tensor at the block start)."""
        rec = self.rec
        self.header[:, 1] = node_mask
        header = self.header.view(torch.uint8).view(-1, HEADER)
        eng.copy_rows(dst, rec.bytes, None, header, HEADER, rows, HEADER)
        eng.copy_rows(dst[rec.x :], rec.bytes, None, self.x, rec.hidden_bytes, rows, rec.hidden_bytes)
        eng.copy_rows(dst[rec.scales :], rec.bytes, None, self.tail, self.tail.size(1), rows, self.tail.size(1))


def _node_masks(eng, is_token_in_rank):
    """[N, num_nodes] int32: bit l set when local rank l of that node receives the token."""
    N = is_token_in_rank.size(0)
    bits = 1 << torch.arange(eng.ranks_per_node, dtype=torch.int32)
    per_node = is_token_in_rank.view(N, eng.num_nodes, eng.ranks_per_node).to(torch.int32)
    return (per_node * bits).sum(2, dtype=torch.int32)


class _Plan:
    """Everyone's counts for one call, and from them every rank's memory layout."""

    def __init__(self, eng, counts, rec_bytes):
        R, Nn, rpn = eng.num_ranks, eng.num_nodes, eng.ranks_per_node
        self.cnt = counts["rank"]  # [R src, R dst]
        self.node_cnt = counts["node"]  # [R src, Nn]
        self.rec = rec_bytes
        start = eng.data_start
        self.staging, self.rdma, self.nvl, self.end = [], [], [], []
        for r in range(R):
            node, local = r // rpn, r % rpn
            other = [n for n in range(Nn) if n != node]
            staging = {}
            off = start
            for n in other:
                staging[n] = off
                off += int(self.node_cnt[r, n]) * rec_bytes
            rdma = {}
            for n in other:
                s = n * rpn + local
                rdma[s] = off
                off += int(self.node_cnt[s, node]) * rec_bytes
            nvl = {}
            for s in range(R):
                nvl[s] = off
                off += int(self.cnt[s, r]) * rec_bytes
            self.staging.append(staging)
            self.rdma.append(rdma)
            self.nvl.append(nvl)
            self.end.append(off)

    def needed(self):
        return max(self.end)


def _exchange_counts(eng, is_token_in_rank, extra=None):
    N, R = is_token_in_rank.shape
    rank_cnt = is_token_in_rank.sum(0, dtype=torch.int64)
    node_cnt = is_token_in_rank.view(N, eng.num_nodes, eng.ranks_per_node).any(2).sum(0, dtype=torch.int64)
    parts = [rank_cnt, node_cnt] + ([extra.flatten().to(torch.int64)] if extra is not None else [])
    row = torch.cat(parts)
    table = eng.exchange_rows(row)
    counts = {"rank": table[:, :R], "node": table[:, R : R + eng.num_nodes], "extra": table[:, R + eng.num_nodes :]}
    return counts


def _send_and_forward(eng, plan, parts, is_token_in_rank, node_masks):
    me, rec = eng.rank, plan.rec
    for d in eng.node_ranks():
        rows = torch.nonzero(is_token_in_rank[:, d])[:, 0]
        parts.write(eng, eng.peer_view(d)[plan.nvl[d][me] :], rows, node_masks[:, eng.node])
    for n in range(eng.num_nodes):
        if n == eng.node:
            continue
        rows = torch.nonzero(is_token_in_rank.view(-1, eng.num_nodes, eng.ranks_per_node)[:, n].any(1))[:, 0]
        off = plan.staging[me][n]
        parts.write(eng, eng.region[off:], rows, node_masks[:, n])
        f = eng.forwarder(n)
        eng.put_block(f, off, plan.rdma[f][me], rows.numel() * rec, hb.STREAM_HT_TO_FORWARDER)
        eng.signal(f, hb.STREAM_HT_TO_FORWARDER)
    nvl_head = _forward(eng, plan)
    for d in eng.node_ranks():
        eng.signal(d, hb.STREAM_HT_PLACED)
    return nvl_head


def _forward(eng, plan):
    """Place what other nodes' ranks (with this rank's local index) sent here into the node peers' memory.
    Returns send_nvl_head rows for the forwarded tokens: position in each local peer's block, or -1."""
    me, rec = eng.rank, plan.rec
    heads = []
    for s in sorted(plan.rdma[me]):
        eng.consume(s, hb.STREAM_HT_TO_FORWARDER)
        n_rows = int(plan.node_cnt[s, eng.node])
        off = plan.rdma[me][s]
        block = eng.region[off : off + n_rows * rec].view(n_rows, rec)
        masks = block[:, 4:8].contiguous().view(torch.int32).view(-1)
        head = torch.full((n_rows, max(8, eng.ranks_per_node)), -1, dtype=torch.int32)
        for local, d in enumerate(eng.node_ranks()):
            rows = (masks >> local) & 1 == 1
            head[rows, local] = torch.arange(int(rows.sum()), dtype=torch.int32)
            eng.copy_rows(eng.peer_view(d)[plan.nvl[d][s] :], rec, None, block, rec, torch.nonzero(rows)[:, 0], rec)
        heads.append(head)
    if not heads:
        return torch.empty(0, max(8, eng.ranks_per_node), dtype=torch.int32)
    return torch.cat(heads)


def dispatch(
    eng,
    x,
    x_scales,
    topk_idx,
    topk_weights,
    num_tokens_per_rank,
    num_tokens_per_rdma_rank,
    is_token_in_rank,
    num_tokens_per_expert,
    expert_alignment,
    num_worst_tokens,
    num_channels,
    handle,
):
    cached = handle is not None
    if cached:
        is_token_in_rank = handle.is_token_in_rank
    N, R = x.size(0), eng.num_ranks
    hidden_bytes = x.size(1) * x.element_size()
    rec = _Record(
        hidden_bytes, 0 if x_scales is None else x_scales.size(1), 0 if topk_idx is None else topk_idx.size(1)
    )
    rec.scale_dtype = None if x_scales is None else x_scales.dtype
    chan = channel_ids(N, num_channels)
    one_hot = torch.nn.functional.one_hot(chan, num_channels).to(torch.int64)  # [N, C]
    per_channel = is_token_in_rank.to(torch.int64).T @ one_hot  # [R, C]
    E = 0 if cached else num_tokens_per_expert.numel()
    extra = torch.cat(
        [
            per_channel.flatten(),
            num_tokens_per_expert.to(torch.int64) if not cached else torch.zeros(0, dtype=torch.int64),
        ]
    )
    counts = _exchange_counts(eng, is_token_in_rank, extra)
    plan = _Plan(eng, counts, rec.bytes)
    eng.require_bytes(plan.needed(), f"this dispatch ({rec.bytes}-byte rows)")
    node_masks = _node_masks(eng, is_token_in_rank)
    parts = _RecordParts(eng, rec, x, x_scales, topk_idx, topk_weights)
    nvl_head = _send_and_forward(eng, plan, parts, is_token_in_rank, node_masks)
    for w in eng.node_ranks():  # every rank of the node stores here (at least its final signal)
        eng.consume(w, hb.STREAM_HT_PLACED)
    num_recv = int(counts["rank"][:, eng.rank].sum())
    off = plan.nvl[eng.rank][0]
    recv = eng.region[off : off + num_recv * rec.bytes].view(num_recv, rec.bytes)
    all_channel = counts["extra"][:, : R * num_channels].view(R, R, num_channels)
    return _unpack(
        eng,
        x,
        rec,
        recv,
        counts,
        all_channel,
        num_channels,
        cached,
        num_worst_tokens,
        expert_alignment,
        E,
        is_token_in_rank,
        chan,
        nvl_head,
        handle,
    )


def _unpack(
    eng,
    x,
    rec,
    recv,
    counts,
    all_channel,
    C,
    cached,
    num_worst_tokens,
    expert_alignment,
    E,
    is_token_in_rank,
    chan,
    nvl_head,
    handle,
):
    me, R = eng.rank, eng.num_ranks
    num_recv = recv.size(0)
    rows = num_worst_tokens if num_worst_tokens > 0 else num_recv
    if num_recv > rows:
        raise RuntimeError(f"rank {me} received {num_recv} tokens but num_worst_tokens={num_worst_tokens}")
    H = x.size(1)
    recv_x = torch.empty(rows, H, dtype=x.dtype)
    recv_x[num_recv:] = 0
    recv_x[:num_recv].view(torch.uint8).view(num_recv, rec.hidden_bytes).copy_(recv[:, rec.x : rec.scales])
    recv_scales = None
    if rec.num_scales:
        recv_scales = torch.zeros(rows, rec.num_scales, dtype=rec.scale_dtype)
        scales = recv[:, rec.scales : rec.scales + 4 * rec.num_scales].contiguous().view(rec.scale_dtype)
        recv_scales[:num_recv] = scales.view(num_recv, rec.num_scales)
    if cached:
        return recv_x, recv_scales, None, None, None, None
    recv_topk_idx = recv_topk_weights = None
    if rec.num_topk:
        K = rec.num_topk
        gidx = recv[:, rec.topk : rec.weights].contiguous().view(torch.int64).view(num_recv, K)
        w = recv[:, rec.weights : rec.weights + 4 * K].contiguous().view(torch.float32).view(num_recv, K)
        E_l = E // R
        local = (gidx >= me * E_l) & (gidx < (me + 1) * E_l)
        recv_topk_idx = torch.full((rows, K), -1, dtype=torch.int64)
        recv_topk_idx[:num_recv] = torch.where(local, gidx - me * E_l, torch.full_like(gidx, -1))
        recv_topk_weights = torch.zeros(rows, K, dtype=torch.float32)
        recv_topk_weights[:num_recv] = torch.where(local, w, torch.zeros_like(w))
    expert_counts = counts["extra"][:, R * C : R * C + E].sum(0)
    E_l = E // R
    mine = expert_counts[me * E_l : (me + 1) * E_l]
    aligned = ((mine + expert_alignment - 1) // expert_alignment * expert_alignment).tolist()
    recv_list = [] if num_worst_tokens > 0 else [int(v) for v in aligned]
    src_idx = recv[:, 0:4].contiguous().view(torch.int32).view(-1)
    recv = recv[:, :HEADER].clone()  # the handle keeps provenance; the memory is reused by the next call
    new_handle = _make_handle(eng, counts, all_channel, C, is_token_in_rank, chan, recv, src_idx, nvl_head)
    return recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_list, new_handle


def _make_handle(eng, counts, all_channel, C, is_token_in_rank, chan, recv, src_idx, nvl_head):
    me = eng.rank
    cnt = counts["rank"]
    send_channel = all_channel[me]  # [R dst, C]
    channel_prefix = torch.cumsum(send_channel, 1).to(torch.int32)
    recv_channel_prefix = (torch.cumsum(all_channel[:, me, :], 1) - all_channel[:, me, :]).to(torch.int32)
    if eng.num_nodes == 1:
        rank_prefix = torch.cumsum(cnt, 0).to(torch.int32)
        send_head = hb.positions(is_token_in_rank)
        return IntranodeHandle(
            rank_prefix, channel_prefix, recv_channel_prefix, src_idx.clone(), is_token_in_rank, send_head
        )
    N = is_token_in_rank.size(0)
    Nn, rpn = eng.num_nodes, eng.ranks_per_node
    to_node = is_token_in_rank.view(N, Nn, rpn).any(2)
    node_channel = torch.zeros(Nn, C, dtype=torch.int64)
    for n in range(Nn):
        node_channel[n] = torch.bincount(chan[to_node[:, n]], minlength=C)[:C]
    rdma_channel_prefix = torch.cumsum(node_channel, 1).to(torch.int32)
    served = [n * rpn + eng.local_of(me) for n in range(Nn)]
    recv_rdma = torch.stack([counts["node"][s, eng.node] for s in served])
    recv_rdma_channel_prefix = torch.zeros(Nn, C, dtype=torch.int32)
    recv_rdma_rank_prefix_sum = torch.cumsum(recv_rdma, 0).to(torch.int32)
    recv_gbl_rank_prefix_sum = torch.cumsum(cnt[:, me], 0).to(torch.int32)
    header = recv[:, 0:16].contiguous().view(torch.int32).view(-1, 4)
    meta = torch.zeros(recv.size(0), 2, dtype=torch.int32)
    meta[:, 0] = header[:, 2] // rpn
    meta[:, 1] = header[:, 1]
    recv_src_meta = meta.view(torch.uint8).view(-1, 8)
    send_rdma_head = hb.positions(to_node)
    return InternodeHandle(
        is_token_in_rank,
        rdma_channel_prefix,
        channel_prefix,
        recv_rdma_channel_prefix,
        recv_rdma_rank_prefix_sum,
        recv_channel_prefix,
        recv_gbl_rank_prefix_sum,
        recv_src_meta,
        send_rdma_head,
        nvl_head,
    )


# ---------------------------------------------------------------- combine


def _combine_plan(eng, is_token_in_rank, crec, prec):
    """Layout of the combine areas: direct area at the source (same-node contributions, ranks ascending), the
    to-forwarder area at forwarders (per served source, node ranks ascending), partial staging at forwarders
    and the partial area at the source (other nodes ascending)."""
    counts = _exchange_counts(eng, is_token_in_rank)
    R, Nn, rpn = eng.num_ranks, eng.num_nodes, eng.ranks_per_node
    cnt, node_cnt = counts["rank"], counts["node"]
    start = eng.data_start
    plan = {"cnt": cnt, "node_cnt": node_cnt, "direct": [], "to_fwd": [], "staging": [], "partial": [], "end": []}
    for r in range(R):
        node, local = r // rpn, r % rpn
        off = start
        direct = {}
        for d in range(node * rpn, (node + 1) * rpn):
            direct[d] = off
            off += int(cnt[r, d]) * crec
        to_fwd, staging = {}, {}
        for n in range(Nn):
            if n == node:
                continue
            s = n * rpn + local
            for d in range(node * rpn, (node + 1) * rpn):
                to_fwd[(s, d)] = off
                off += int(cnt[s, d]) * crec
            staging[s] = off
            off += int(node_cnt[s, node]) * prec
        partial = {}
        for n in range(Nn):
            if n != node:
                partial[n] = off
                off += int(node_cnt[r, n]) * prec
        for key, value in (("direct", direct), ("to_fwd", to_fwd), ("staging", staging), ("partial", partial)):
            plan[key].append(value)
        plan["end"].append(off)
    return plan


def _recv_block_starts(eng, handle):
    if eng.num_nodes == 1:
        inclusive = handle.rank_prefix_matrix[:, eng.rank].to(torch.int64)
    else:
        inclusive = handle.recv_gbl_rank_prefix_sum.to(torch.int64)
    return torch.cat([torch.zeros(1, dtype=torch.int64), inclusive])


def combine(eng, x, handle, topk_weights, bias):
    me, R = eng.rank, eng.num_ranks
    is_token_in_rank = handle.is_token_in_rank
    N, H = is_token_in_rank.size(0), x.size(1)
    K = 0 if topk_weights is None else topk_weights.size(1)
    crec = hb.align(2 * H + 4 * K)
    prec = hb.align(4 * H + 4 * K)
    plan = _combine_plan(eng, is_token_in_rank, crec, prec)
    eng.require_bytes(max(plan["end"]), f"this combine ({crec}-byte rows)")
    x_rows = x.contiguous().view(torch.uint8).view(x.size(0), 2 * H)
    w_rows = topk_weights.to(torch.float32).contiguous().view(torch.uint8).view(-1, 4 * K) if K else None
    starts = _recv_block_starts(eng, handle)
    for s in range(R):
        b, e = int(starts[s]), int(starts[s + 1])
        if eng.node_of(s) == eng.node:
            dst = eng.peer_view(s)[plan["direct"][s][me] :]
        else:
            f = eng.forwarder(eng.node, eng.local_of(s))
            dst = eng.peer_view(f)[plan["to_fwd"][f][(s, me)] :]
        rows = torch.arange(b, e)
        eng.copy_rows(dst, crec, None, x_rows, 2 * H, rows, 2 * H)
        if K:
            eng.copy_rows(dst[2 * H :], crec, None, w_rows, 4 * K, rows, 4 * K)
    for d in eng.node_ranks():
        eng.signal(d, hb.STREAM_HT_COMBINE_DIRECT)
        if eng.num_nodes > 1:
            eng.signal(d, hb.STREAM_HT_COMBINE_TO_FORWARDER)
    if eng.num_nodes > 1:
        _forward_partials(eng, plan, handle, H, K, crec, prec)
    return _reduce_at_source(eng, plan, is_token_in_rank, handle, H, K, crec, prec, bias, N)


def _forward_partials(eng, plan, handle, H, K, crec, prec):
    """Sum, per token of each served source, the contributions of this node's ranks (ascending) in FP32 and send
    one partial row per token back to the source."""
    me = eng.rank
    for w in eng.node_ranks():
        eng.consume(w, hb.STREAM_HT_COMBINE_TO_FORWARDER)
    nvl_head = handle.send_nvl_head.to(torch.int64)
    row0 = 0
    for s in sorted(plan["staging"][me]):
        n_rows = int(plan["node_cnt"][s, eng.node])
        head = nvl_head[row0 : row0 + n_rows]
        row0 += n_rows
        off = plan["staging"][me][s]
        out = eng.region[off:]
        blocks = [
            (eng.region[plan["to_fwd"][me][(s, d)] :], head[:, local]) for local, d in enumerate(eng.node_ranks())
        ]
        eng.reduce_rows(out, prec, hb.F32, n_rows, H, [(b, crec, hb.BF16, i, None) for b, i in blocks])
        if K:
            eng.reduce_rows(
                out[4 * H :], prec, hb.F32, n_rows, K, [(b[2 * H :], crec, hb.F32, i, None) for b, i in blocks]
            )
        eng.put_block(s, off, plan["partial"][s][eng.node], n_rows * prec, hb.STREAM_HT_COMBINE_PARTIAL)
        eng.signal(s, hb.STREAM_HT_COMBINE_PARTIAL)


def _reduce_at_source(eng, plan, is_token_in_rank, handle, H, K, crec, prec, bias, N):
    """bias, then same-node rows (ranks ascending), then partials (nodes ascending), FP32, one pass per token."""
    me = eng.rank
    for d in eng.node_ranks():
        eng.consume(d, hb.STREAM_HT_COMBINE_DIRECT)
    for n in range(eng.num_nodes):
        if n != eng.node:
            eng.consume(eng.forwarder(n), hb.STREAM_HT_COMBINE_PARTIAL)
    pos = hb.positions(is_token_in_rank).to(torch.int64)
    rows = [(eng.region[plan["direct"][me][d] :], crec, 2 * H, hb.BF16, pos[:, d]) for d in eng.node_ranks()]
    if eng.num_nodes > 1:
        rdma_head = handle.send_rdma_head.to(torch.int64)
        rows += [
            (eng.region[plan["partial"][me][n] :], prec, 4 * H, hb.F32, rdma_head[:, n])
            for n in range(eng.num_nodes)
            if n != eng.node
        ]
    init = None
    if bias:
        init = bias[0].float() if len(bias) == 1 else bias[0].float() + bias[1].float()
    out = torch.empty(N, H, dtype=torch.bfloat16)
    eng.reduce_rows(out.view(torch.uint8), 2 * H, hb.BF16, N, H, [(b, p, dt, i, None) for b, p, _, dt, i in rows], init)
    weights = None
    if K:
        weights = torch.empty(N, K, dtype=torch.float32)
        eng.reduce_rows(
            weights.view(torch.uint8),
            4 * K,
            hb.F32,
            N,
            K,
            [(b[w_off:], p, hb.F32, i, None) for b, p, w_off, _, i in rows],
        )
    return out, weights
