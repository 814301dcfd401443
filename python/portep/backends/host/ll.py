"""Low-latency dispatch and combine on the host backend (see backends/host/engine.py for the model).

Layout of one half h of the communication memory (DeepEP's, so get_low_latency_rdma_size_hint sizes it):
  send area  [0, send)          dispatch: one message per token (T slots); combine: [E_l][M] rows of comb_pitch
  recv area  [send, send+recv)  dispatch: [E_l][R][T] message slots; combine: [E][T] rows of comb_pitch
A dispatch message is a 16-byte header (int32 source token index, int32 the call's sequence number, 2 reserved) and
the payload: H FP8 bytes and H/128 float32 scales, or 2H bytes of BF16. A combine row is the BF16 row and a tail of
H/128 * 4 bytes whose first int32 is the call's sequence number; with use_logfmt, the row in LogFMT-10, its metadata
carrying the sequence number (gpu_kernels/logfmt.h). Every LL call flips the half. A (half, phase, local
expert) stream per source carries one final signal per call whose unit count is the number of messages. The
sequence numbers must be the receiver's own (lockstep.py). Shrink mode: masked ranks get nothing and give nothing.
"""

import torch

from ...handles import LLHandle
from .. import common as hb

FP8_MAX = 448.0


def _stream(eng, half, phase, local_expert):
    return hb.STREAM_LL_BASE + (half * 2 + phase) * eng.max_local_experts + local_expert


# float32(1/448), as DeepEP's kernels hold it: the stored scale is amax times this constant (one rounding)
FP8_MAX_INV = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)


def per_token_cast(x, round_scale):
    """DeepEP's per-(token, 128 channels) FP8 cast (its kernels' calculate_fp8_scales): amax = max(|x|, 1e-4);
    stored scale float32(amax * float32(1/448)) and x multiplied by float32(448 / amax), one correctly rounded
    division; with round_scale, e = ceil(log2(amax * float32(1/448))) from the float's bits, stored 2^e and x
    multiplied by 2^-e. Returns (fp8 [N, H], float32 scales [N, H/128])."""
    N, H = x.shape
    xf = x.float().view(N, H // 128, 128)
    amax = xf.abs().amax(-1).clamp(min=1e-4)
    scale = amax * FP8_MAX_INV
    if round_scale:
        bits = scale.view(torch.int32)
        exp = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
        scale = ((exp + 127) << 23).view(torch.float32)  # 2^exp and 2^-exp, built from their bits: exact
        scale_inv = ((127 - exp) << 23).view(torch.float32)
    else:
        scale_inv = torch.full_like(amax, FP8_MAX) / amax  # tensor / tensor: IEEE division, as the kernel's
    q = (xf * scale_inv.unsqueeze(-1)).to(torch.float8_e4m3fn).view(N, H)
    return q, scale


def _ue8m0(scale):
    """Exponent bytes of power-of-two float32 scales, packed 4 per int32 along the last dim."""
    exp = ((scale.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    return exp.view(torch.int32)


def _pack_messages(x, use_fp8, round_scale, lay, seq):
    N, H = x.shape
    msgs = torch.zeros(N, lay.disp, dtype=torch.uint8)
    msgs[:, :4] = torch.arange(N, dtype=torch.int32).view(N, 1).view(torch.uint8)
    msgs[:, 4:8] = torch.full((N, 1), seq, dtype=torch.int32).view(torch.uint8)
    if use_fp8:
        q, scale = per_token_cast(x, round_scale)
        msgs[:, 16 : 16 + H] = q.view(torch.uint8)
        msgs[:, 16 + H : 16 + H + H // 128 * 4] = scale.view(torch.uint8).view(N, H // 128 * 4)
    else:
        msgs[:, 16 : 16 + 2 * H] = x.contiguous().view(torch.uint8).view(N, 2 * H)
    return msgs


def _slots(topk_idx, num_experts):
    """Per valid (token, k) in row-major order: token, global expert, and slot = its rank among the selections
    of that expert (so each expert's messages fill slots 0..count-1 in token order)."""
    valid = topk_idx >= 0
    tokens = torch.nonzero(valid)[:, 0]
    experts = topk_idx[valid]
    order = torch.argsort(experts, stable=True)
    counts = torch.bincount(experts, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(experts)
    slot[order] = torch.arange(experts.numel()) - starts[experts[order]]
    return tokens, experts, slot, counts


def dispatch(eng, x, topk_idx, T, E, use_fp8, round_scale, use_ue8m0, cumulative_stats, wait_stats, return_recv_hook):
    lay = hb.LLLayout(eng, T, x.size(1), E)
    R, me, E_l = eng.num_ranks, eng.rank, lay.E_l
    half, seq = eng.ll_half, eng.lockstep.seq  # the call's own, which a receive hook checks after later calls began
    eng.ll_half ^= 1
    msgs = _pack_messages(x, use_fp8, round_scale, lay, seq)
    send, recv = lay.send_off(half), lay.recv_off(half)
    N = x.size(0)
    if not all(eng.direct(d, low_latency=True) for d in range(R)):  # proxies copy from registered memory
        eng.region[send : send + N * lay.disp].view(N, lay.disp).copy_(msgs)
    tokens, experts, slot, counts = _slots(topk_idx, E)
    dst = experts // E_l
    for d in range(R):
        if eng.masked(d):
            continue
        sel = dst == d
        le = experts[sel] % E_l
        rows = (le * R + me) * T + slot[sel]
        if eng.direct(d, low_latency=True):
            eng.copy_rows(eng.peer_view(d)[recv:], lay.disp, rows, msgs, lay.disp, tokens[sel], lay.disp)
        else:
            eng.put_rows_streams(
                d, send + tokens[sel] * lay.disp, recv + rows * lay.disp, _stream(eng, half, 0, le), lay.disp
            )
    all_experts = torch.arange(E)
    live = _unmasked(eng, all_experts // E_l)
    eng.signal_many(all_experts[live] // E_l, _stream(eng, half, 0, all_experts[live] % E_l), counts[live])

    recv_x, recv_scales = _alloc_recv_x(lay, use_fp8, use_ue8m0)
    recv_count = torch.zeros(E_l, dtype=torch.int32)
    src_info = torch.full((E_l, lay.M), -1, dtype=torch.int32)
    layout_range = torch.zeros(E_l, R, dtype=torch.int64)

    def receive():
        _dispatch_receive(
            eng,
            lay,
            half,
            seq,
            use_fp8,
            use_ue8m0,
            recv_x,
            recv_scales,
            recv_count,
            src_info,
            layout_range,
            cumulative_stats,
            wait_stats,
        )

    handle = LLHandle(src_info, layout_range, T, x.size(1), E)
    out_x = (recv_x, recv_scales) if use_fp8 else recv_x
    if return_recv_hook:
        return out_x, recv_count, handle, receive
    receive()
    return out_x, recv_count, handle, None


def _unmasked(eng, ranks):
    """Which of the ranks are not masked (shrink mode), as a bool tensor."""
    return torch.ones(ranks.numel(), dtype=torch.bool) if eng.mask is None else eng.mask[ranks] == 0


def _alloc_recv_x(lay, use_fp8, use_ue8m0):
    if not use_fp8:
        return torch.empty(lay.E_l, lay.M, lay.H, dtype=torch.bfloat16), None
    x = torch.empty(lay.E_l, lay.M, lay.H, dtype=torch.float8_e4m3fn)
    if use_ue8m0:
        scales = torch.empty(lay.E_l, lay.H // 512, lay.M, dtype=torch.int32).transpose(1, 2)
    else:
        scales = torch.empty(lay.E_l, lay.H // 128, lay.M, dtype=torch.float32).transpose(1, 2)
    return x, scales


def _dispatch_receive(
    eng,
    lay,
    half,
    seq,
    use_fp8,
    use_ue8m0,
    recv_x,
    recv_scales,
    recv_count,
    src_info,
    layout_range,
    cumulative_stats,
    wait_stats,
):
    R, T, H, E_l, M = eng.num_ranks, lay.T, lay.H, lay.E_l, lay.M
    le = torch.arange(E_l).repeat_interleave(R)
    src = torch.arange(R).repeat(E_l)
    units, waited = eng.consume_many(src, _stream(eng, half, 0, le))
    if wait_stats is not None:
        wait_stats += torch.bincount(src, weights=waited.double(), minlength=R).to(wait_stats.dtype)
    counts = units.view(E_l, R)
    begins = torch.cumsum(counts, 1) - counts
    # every valid slot (expert, source, i < count) and the packed row it lands in (expert, begin + i)
    n = int(counts.sum())
    pair = torch.arange(E_l * R).repeat_interleave(counts.flatten())
    i = torch.arange(n) - (torch.cumsum(counts.flatten(), 0) - counts.flatten())[pair]
    slot_rows = pair * T + i
    packed_rows = (pair // R) * M + begins.flatten()[pair] + i
    recv = lay.recv_off(half)
    slots = eng.region[recv:]
    seqs = torch.empty(n, dtype=torch.int32)
    eng.copy_rows(seqs.view(torch.uint8), 4, None, slots[4:], lay.disp, slot_rows, 4)
    _check_seqs(eng, "low_latency_dispatch", seqs, pair % R, seq)
    eng.copy_rows(src_info.view(torch.uint8), 4, packed_rows, slots, lay.disp, slot_rows, 4)
    row_bytes = H if use_fp8 else 2 * H
    eng.copy_rows(recv_x.view(torch.uint8), row_bytes, packed_rows, slots[16:], lay.disp, slot_rows, row_bytes)
    if use_fp8:
        scale = slots[: E_l * R * T * lay.disp].view(-1, lay.disp)[slot_rows, 16 + H : 16 + H + H // 128 * 4]
        scale = scale.contiguous().view(torch.float32).view(n, H // 128)
        recv_scales[packed_rows // M, packed_rows % M] = _ue8m0(scale) if use_ue8m0 else scale
    recv_count.copy_(counts.sum(1).to(torch.int32))
    layout_range.copy_((begins << 32) | counts)
    if cumulative_stats is not None:
        cumulative_stats += recv_count


def _check_seqs(eng, what, seqs, srcs, seq):
    """The sequence numbers that came with each source's messages or rows are this call's (seq)."""
    bad = seqs != seq
    if bool(bad.any()):
        first = int(torch.nonzero(bad)[0, 0])
        eng.lockstep.check_seq(what, int(seqs[first]), int(srcs[first]), seq)


def next_combine_buffer(eng, handle):
    T, H, E = handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts
    lay = hb.LLLayout(eng, T, H, E)
    return _combine_send_view(eng, lay, eng.ll_half)


def _combine_send_view(eng, lay, half):
    off = lay.send_off(half)
    rows = eng.region[off : off + lay.E_l * lay.M * lay.comb].view(lay.E_l, lay.M, lay.comb)
    return rows.view(torch.bfloat16)[:, :, : lay.H]


def combine(eng, x, topk_idx, topk_weights, handle, zero_copy, out, return_recv_hook, wait_stats, use_logfmt=False):
    src_info, layout_range, T, H, E = handle  # an LLHandle (buffer.py types it)
    lay = hb.LLLayout(eng, T, H, E)
    R, E_l = eng.num_ranks, lay.E_l
    half, seq = eng.ll_half, eng.lockstep.seq  # the call's own (see dispatch)
    eng.ll_half ^= 1
    counts = layout_range & 0xFFFFFFFF
    routes = _combine_routes(eng, lay, src_info, layout_range)
    if use_logfmt:
        _send_logfmt(eng, lay, half, x, routes, seq)
    else:
        _send_bf16(eng, lay, half, x, zero_copy, counts, routes, seq)
    pairs = torch.arange(E_l * R)
    live = _unmasked(eng, pairs % R)
    eng.signal_many(pairs[live] % R, _stream(eng, half, 1, pairs[live] // R), counts.flatten()[live])

    result = out if out is not None else torch.empty(topk_idx.size(0), H, dtype=torch.bfloat16)

    def receive():
        _combine_receive(eng, lay, half, seq, topk_idx, topk_weights, result, wait_stats, use_logfmt)

    if return_recv_hook:
        return result, receive
    receive()
    return result, None


def _combine_routes(eng, lay, src_info, layout_range):
    """Per source rank s with rows here (and not masked): (s, local experts [n], rows in the send area's layout [n],
    rows at s's receive area [n]) of the expert outputs that go back to s."""
    R, me, E_l, T = eng.num_ranks, eng.rank, lay.E_l, lay.T
    begins, counts = layout_range >> 32, layout_range & 0xFFFFFFFF
    n = int(counts.sum())
    pair = torch.arange(E_l * R).repeat_interleave(counts.flatten())  # (local expert, source) of each row
    j = begins.flatten()[pair] + torch.arange(n) - (torch.cumsum(counts.flatten(), 0) - counts.flatten())[pair]
    le, src = pair // R, pair % R
    token = src_info.view(-1)[le * lay.M + j].to(torch.int64)
    rows = (me * E_l + le) * T + token
    routes = []
    for s_rank in range(R):
        sel = src == s_rank
        if bool(sel.any()) and not eng.masked(s_rank):
            routes.append((s_rank, le[sel], le[sel] * lay.M + j[sel], rows[sel]))
    return routes


def _send_bf16(eng, lay, half, x, zero_copy, counts, routes, seq):
    """BF16 rows, the call's sequence number in each row's tail: stored at direct peers, staged and written to proxy
    peers; with zero_copy they are already in the send area."""
    H, E_l = lay.H, lay.E_l
    send, recv = lay.send_off(half), lay.recv_off(half)
    send_rows = _combine_send_view(eng, lay, half)
    x_rows = None  # where direct stores read from: x itself, or the registered send buffer
    if not zero_copy and x.is_contiguous():
        x_rows = x.view(torch.uint8).view(E_l * lay.M, 2 * H)
    elif not zero_copy:  # only the valid rows: each expert's are packed from row 0
        for le, n in enumerate(counts.sum(1).tolist()):
            send_rows[le, :n].copy_(x[le, :n])
    tail = torch.tensor([seq], dtype=torch.int32).view(torch.uint8)
    for s_rank, le, src_rows, rows in routes:
        once = torch.zeros_like(src_rows)  # every row's tail gets the one sequence number
        if eng.direct(s_rank, low_latency=True):
            dst = eng.peer_view(s_rank)[recv:]
            if x_rows is not None:
                eng.copy_rows(dst, lay.comb, rows, x_rows, 2 * H, src_rows, 2 * H)
            else:
                eng.copy_rows(dst, lay.comb, rows, eng.region[send:], lay.comb, src_rows, 2 * H)
            eng.copy_rows(dst[2 * H :], lay.comb, rows, tail, 0, once, 4)
            continue
        if x_rows is not None:  # stage the rows the proxies will send
            eng.copy_rows(eng.region[send:], lay.comb, src_rows, x_rows, 2 * H, src_rows, 2 * H)
        eng.copy_rows(eng.region[send + 2 * H :], lay.comb, src_rows, tail, 0, once, 4)
        eng.put_rows_streams(
            s_rank, send + src_rows * lay.comb, recv + rows * lay.comb, _stream(eng, half, 1, le), 2 * H + 16
        )


def _send_logfmt(eng, lay, half, x, routes, seq):
    """Rows in LogFMT-10 (gpu_kernels/logfmt.h): each encoded straight into its slot at a direct peer, or into this
    rank's send area and written whole (its largest size) to a proxy peer; the call's sequence number rides in the
    rows' metadata. x is read as it is (zero_copy is refused with use_logfmt)."""
    H = lay.H
    send, recv = lay.send_off(half), lay.recv_off(half)
    x_rows = x.contiguous().view(torch.uint8).view(lay.E_l * lay.M, 2 * H)
    seq = seq & 0xFFFFFFFF
    for s_rank, le, src_rows, rows in routes:
        if eng.direct(s_rank, low_latency=True):
            eng.logfmt_encode_rows(eng.peer_view(s_rank)[recv:], lay.comb, rows, x_rows, 2 * H, src_rows, H, seq)
            continue
        eng.logfmt_encode_rows(eng.region[send:], lay.comb, src_rows, x_rows, 2 * H, src_rows, H, seq)
        eng.put_rows_streams(
            s_rank, send + src_rows * lay.comb, recv + rows * lay.comb, _stream(eng, half, 1, le), lay.comb
        )


def _combine_receive(eng, lay, half, seq, topk_idx, topk_weights, result, wait_stats, logfmt=False):
    E, E_l, T, H = lay.E, lay.E_l, lay.T, lay.H
    experts = torch.arange(E)
    owners = experts // E_l
    _, waited = eng.consume_many(owners, _stream(eng, half, 1, experts % E_l))
    if wait_stats is not None:
        wait_stats += torch.bincount(owners, weights=waited.double(), minlength=eng.num_ranks).to(wait_stats.dtype)
    recv = lay.recv_off(half)
    N, K = topk_idx.shape
    tokens = torch.arange(N)
    if eng.mask is not None:  # shrink mode: a masked owner's selections are absent
        topk_idx = torch.where((topk_idx >= 0) & (eng.mask[topk_idx.clamp(min=0) // E_l] != 0), -1, topk_idx)
    used = torch.nonzero(topk_idx >= 0)
    used_rows = topk_idx[used[:, 0], used[:, 1]] * T + used[:, 0]
    if logfmt:
        seqs = eng.logfmt_row_seqs(eng.region[recv:], lay.comb, used_rows, H)
    else:
        seqs = torch.empty(used.size(0), dtype=torch.int32)
        eng.copy_rows(seqs.view(torch.uint8), 4, None, eng.region[recv + 2 * H :], lay.comb, used_rows, 4)
    _check_seqs(eng, "low_latency_combine", seqs, topk_idx[used[:, 0], used[:, 1]] // E_l, seq)
    # Per owner rank, its rows in top-k order, then those sums in rank order, FP32 with every product and sum
    # rounded: deterministic, and the order in which the CUDA backend's direct peers send partial sums.
    partials = []
    for owner in torch.unique(topk_idx[topk_idx >= 0] // E_l).tolist():
        sources = []
        for k in range(K):
            e = topk_idx[:, k]
            index = torch.where((e >= 0) & (e // E_l == owner), e * T + tokens, -1)
            sources.append((eng.region[recv:], lay.comb, hb.LOGFMT if logfmt else hb.BF16, index, topk_weights[:, k]))
        partial = torch.empty(N, H, dtype=torch.float32)
        eng.reduce_rows(partial.view(torch.uint8), 4 * H, hb.F32, N, H, sources)
        partials.append((partial.view(torch.uint8), 4 * H, hb.F32, tokens, None))
    out = result if result.is_contiguous() else torch.empty(N, H, dtype=torch.bfloat16)
    eng.reduce_rows(out.view(torch.uint8), 2 * H, hb.BF16, N, H, partials)
    if out is not result:
        result.copy_(out)
