"""Low-latency dispatch and combine on the host backend (see host_backend.py for the model).

Layout of one half h of the communication memory (DeepEP's, so get_low_latency_rdma_size_hint sizes it):
  send area  [0, send)          dispatch: one message per token (T slots); combine: [E_l][M] rows of comb_pitch
  recv area  [send, send+recv)  dispatch: [E_l][R][T] message slots; combine: [E][T] rows of comb_pitch
A dispatch message is a 16-byte header (int32 source token index, 3 reserved) and the payload: H FP8 bytes and
H/128 float32 scales, or 2H bytes of BF16. Every LL call flips the half. A (half, phase, local expert) stream
per source carries one final signal per call whose unit count is the number of messages.
"""

import time

import torch

from . import host_backend as hb

FP8_MAX = 448.0


class LLState:
    def __init__(self):
        self.pending = None  # the receive phase of a hook-mode call not run yet


class _Layout:
    def __init__(self, eng, T, H, E):
        R = eng.num_ranks
        if H % 512:
            raise ValueError(f"hidden={H} must be a multiple of 512 for low-latency mode (DeepEP supports 2048..8192 "
                             f"in steps of 512)")
        self.T, self.H, self.E, self.E_l, self.M = T, H, E, E // R, R * T
        self.disp = 16 + max(2 * H, H + H // 128 * 4)
        self.comb = 2 * H + H // 128 * 4  # multiple of 16 for hidden % 512 == 0
        self.send = max(T * self.disp, E * T * self.comb)
        self.recv = max(E * T * self.disp, E * T * self.comb)
        self.half = self.send + self.recv
        eng.require_bytes(2 * self.half, f"low-latency mode with {T} tokens, hidden {H}, {E} experts")

    def send_off(self, half):
        return half * self.half

    def recv_off(self, half):
        return half * self.half + self.send


def _stream(eng, half, phase, local_expert):
    return hb.STREAM_LL_BASE + (half * 2 + phase) * eng.max_local_experts + local_expert


def per_token_cast(x, round_scale):
    """DeepEP's per-(token, 128 channels) FP8 cast: returns (fp8 [N, H], float32 scales [N, H/128])."""
    N, H = x.shape
    xf = x.float().view(N, H // 128, 128)
    amax = xf.abs().amax(-1).clamp(min=1e-4)
    scale = amax / FP8_MAX
    if round_scale:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
        scale_inv = 1.0 / scale
    else:
        scale_inv = FP8_MAX / amax
    q = (xf * scale_inv.unsqueeze(-1)).to(torch.float8_e4m3fn).view(N, H)
    return q, scale


def _ue8m0(scale):
    """Exponent bytes of power-of-two float32 scales, packed 4 per int32 along the last dim."""
    exp = ((scale.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    return exp.view(torch.int32)


def _pack_messages(x, use_fp8, round_scale, lay):
    N, H = x.shape
    msgs = torch.zeros(N, lay.disp, dtype=torch.uint8)
    msgs[:, :4] = torch.arange(N, dtype=torch.int32).view(N, 1).view(torch.uint8)
    if use_fp8:
        q, scale = per_token_cast(x, round_scale)
        msgs[:, 16:16 + H] = q.view(torch.uint8)
        msgs[:, 16 + H:16 + H + H // 128 * 4] = scale.view(torch.uint8).view(N, -1)
    else:
        msgs[:, 16:16 + 2 * H] = x.contiguous().view(torch.uint8).view(N, 2 * H)
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


def dispatch(eng, x, topk_idx, T, E, use_fp8, round_scale, use_ue8m0, cumulative_stats, wait_stats,
             return_recv_hook):
    lay = _Layout(eng, T, x.size(1), E)
    R, me, E_l = eng.num_ranks, eng.rank, lay.E_l
    half = eng.ll_half
    eng.ll_half ^= 1
    msgs = _pack_messages(x, use_fp8, round_scale, lay)
    send, recv = lay.send_off(half), lay.recv_off(half)
    N = x.size(0)
    eng.region[send:send + N * lay.disp].view(N, lay.disp).copy_(msgs)
    tokens, experts, slot, counts = _slots(topk_idx, E)
    dst = experts // E_l
    for d in range(R):
        sel = dst == d
        le = experts[sel] % E_l
        rows = (le * R + me) * T + slot[sel]
        if eng.direct(d, low_latency=True):
            view = eng.peer_view(d)[recv:recv + E_l * R * T * lay.disp].view(-1, lay.disp)
            view.index_copy_(0, rows, msgs[tokens[sel]])
        else:
            for e in torch.unique(le).tolist():
                pick = le == e
                eng.put_rows(d, send + tokens[sel][pick] * lay.disp, recv + rows[pick] * lay.disp, lay.disp,
                             _stream(eng, half, 0, e), merge=False)
    for e in range(E):
        eng.signal(e // E_l, _stream(eng, half, 0, e % E_l), direct_units=int(counts[e]))

    recv_x, recv_scales = _alloc_recv_x(lay, use_fp8, use_ue8m0)
    recv_count = torch.zeros(E_l, dtype=torch.int32)
    src_info = torch.full((E_l, lay.M), -1, dtype=torch.int32)
    layout_range = torch.zeros(E_l, R, dtype=torch.int64)

    def receive():
        _dispatch_receive(eng, lay, half, use_fp8, use_ue8m0, recv_x, recv_scales, recv_count, src_info,
                          layout_range, cumulative_stats, wait_stats)

    handle = (src_info, layout_range, T, x.size(1), E)
    out_x = (recv_x, recv_scales) if use_fp8 else recv_x
    if return_recv_hook:
        return out_x, recv_count, handle, receive
    receive()
    return out_x, recv_count, handle, None


def _alloc_recv_x(lay, use_fp8, use_ue8m0):
    if not use_fp8:
        return torch.empty(lay.E_l, lay.M, lay.H, dtype=torch.bfloat16), None
    x = torch.empty(lay.E_l, lay.M, lay.H, dtype=torch.float8_e4m3fn)
    if use_ue8m0:
        scales = torch.empty(lay.E_l, lay.H // 512, lay.M, dtype=torch.int32).transpose(1, 2)
    else:
        scales = torch.empty(lay.E_l, lay.H // 128, lay.M, dtype=torch.float32).transpose(1, 2)
    return x, scales


def _dispatch_receive(eng, lay, half, use_fp8, use_ue8m0, recv_x, recv_scales, recv_count, src_info, layout_range,
                      cumulative_stats, wait_stats):
    R, T, H, E_l = eng.num_ranks, lay.T, lay.H, lay.E_l
    counts = torch.zeros(E_l, R, dtype=torch.int64)
    for le in range(E_l):
        for src in range(R):
            t0 = time.perf_counter_ns()
            counts[le, src] = eng.consume(src, _stream(eng, half, 0, le))
            if wait_stats is not None:
                wait_stats[src] += time.perf_counter_ns() - t0
    recv = lay.recv_off(half)
    slots = eng.region[recv:recv + E_l * R * T * lay.disp].view(E_l, R, T, lay.disp)
    begins = torch.cumsum(counts, 1) - counts
    for le in range(E_l):
        packed = torch.cat([slots[le, src, :int(counts[le, src])] for src in range(R)])
        n = packed.size(0)
        src_info[le, :n] = packed[:, :4].contiguous().view(torch.int32).view(-1)
        if use_fp8:
            recv_x[le, :n] = packed[:, 16:16 + H].contiguous().view(torch.float8_e4m3fn)
            scale = packed[:, 16 + H:16 + H + H // 128 * 4].contiguous().view(torch.float32).view(n, -1)
            recv_scales[le, :n] = _ue8m0(scale) if use_ue8m0 else scale
        else:
            recv_x[le, :n] = packed[:, 16:16 + 2 * H].contiguous().view(torch.bfloat16).view(n, H)
    recv_count.copy_(counts.sum(1).to(torch.int32))
    layout_range.copy_((begins << 32) | counts)
    if cumulative_stats is not None:
        cumulative_stats += recv_count


def next_combine_buffer(eng, handle):
    _, _, T, H, E = handle
    lay = _Layout(eng, T, H, E)
    return _combine_send_view(eng, lay, eng.ll_half)


def _combine_send_view(eng, lay, half):
    off = lay.send_off(half)
    rows = eng.region[off:off + lay.E_l * lay.M * lay.comb].view(lay.E_l, lay.M, lay.comb)
    return rows.view(torch.bfloat16)[:, :, :lay.H]


def combine(eng, x, topk_idx, topk_weights, handle, zero_copy, out, return_recv_hook, wait_stats):
    src_info, layout_range, T, H, E = handle
    lay = _Layout(eng, T, H, E)
    R, me, E_l = eng.num_ranks, eng.rank, lay.E_l
    half = eng.ll_half
    eng.ll_half ^= 1
    send_rows = _combine_send_view(eng, lay, half)
    if not zero_copy:
        send_rows.copy_(x)
    send, recv = lay.send_off(half), lay.recv_off(half)
    begins, counts = layout_range >> 32, layout_range & 0xFFFFFFFF
    for le in range(E_l):
        stream = _stream(eng, half, 1, le)
        for src in range(R):
            b, c = int(begins[le, src]), int(counts[le, src])
            j = torch.arange(b, b + c)
            rows = (me * E_l + le) * T + src_info[le, b:b + c].to(torch.int64)
            if eng.direct(src, low_latency=True):
                view = eng.peer_view(src)[recv:recv + E * T * lay.comb].view(E * T, lay.comb)
                view[:, :2 * H].index_copy_(0, rows, send_rows[le, b:b + c].contiguous().view(torch.uint8).view(c, -1))
            else:
                eng.put_rows(src, send + (le * lay.M + j) * lay.comb, recv + rows * lay.comb, 2 * H, stream,
                             merge=False)
            eng.signal(src, stream, direct_units=c)

    N = topk_idx.size(0)
    result = out if out is not None else torch.empty(N, H, dtype=torch.bfloat16)

    def receive():
        _combine_receive(eng, lay, half, topk_idx, topk_weights, result, wait_stats)

    if return_recv_hook:
        return result, receive
    receive()
    return result, None


def _combine_receive(eng, lay, half, topk_idx, topk_weights, result, wait_stats):
    E, E_l, T, H = lay.E, lay.E_l, lay.T, lay.H
    for e in range(E):
        owner = e // E_l
        t0 = time.perf_counter_ns()
        eng.consume(owner, _stream(eng, half, 1, e % E_l))
        if wait_stats is not None:
            wait_stats[owner] += time.perf_counter_ns() - t0
    recv = lay.recv_off(half)
    rows = eng.region[recv:recv + E * T * lay.comb].view(E, T, lay.comb)
    y = rows.view(torch.bfloat16)[:, :, :H]  # [E, T, H]
    N, K = topk_idx.shape
    acc = torch.zeros(N, H, dtype=torch.float32)
    tokens = torch.arange(N)
    for k in range(K):
        e = topk_idx[:, k]
        valid = e >= 0
        if bool(valid.any()):
            contrib = y[e[valid], tokens[valid]].float() * topk_weights[valid, k].unsqueeze(1)
            acc[valid] += contrib
    result.copy_(acc.to(torch.bfloat16))


def clean(eng, T, H, E):
    """Forget every LL signal of this rank (both halves) between two barriers, as DeepEP's clean does."""
    eng.barrier()
    E_l = E // eng.num_ranks
    signals = eng.channel.signals
    for half in (0, 1):
        for phase in (0, 1):
            base = _stream(eng, half, phase, 0)
            signals[:, base:base + E_l].zero_()
    eng.barrier()
