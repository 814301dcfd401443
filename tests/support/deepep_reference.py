"""Independent torch references for the DeepEP V1 acceptance tests.

Written from the DeepEP API description (shared/reference/deepep-api.md §1-§3), not from portep's code. Everything
runs on the CPU; sums that the tests compare against are done in float64.
"""

import hashlib

import torch

FP8_MAX = 448.0
FP8_AMAX_MIN = 1e-4


# ---------------------------------------------------------------------------------------------------------------
# Numerics helpers (DeepEP tests/utils.py semantics)


def calc_diff(x, y):
    """1 - 2*sum(xy) / sum(x^2 + y^2) on (x+1, y+1), in float64; 0 means identical."""
    x = x.double() + 1
    y = y.double() + 1
    denom = (x * x + y * y).sum()
    if denom == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denom)


def dense(t):
    """A copy with standard row-major strides (.contiguous() keeps odd strides on size-1 dims, which view(dtype)
    rejects)."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t)


def _ceil_log2_exact(v):
    """ceil(log2(v)) for positive float32 values, from the bits (exact, no log rounding)."""
    bits = v.float().contiguous().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) - 127
    man = bits & 0x7FFFFF
    return exp + (man != 0).to(torch.int32)


def per_token_cast_to_fp8(x, round_scale=False, use_ue8m0=False):
    """Per row and per 128 channels: amax = max(|x|, 1e-4); fp8 = x * 448/amax; scale = amax/448 (multiply back).

    round_scale: scale = 2^ceil(log2(amax/448)) and fp8 = x / scale. use_ue8m0 (needs round_scale): the scales
    are the exponent bytes (e + 127), packed 4 per int32 along the scale dimension (little-endian: byte i of
    int32 j is group 4j+i), shape [m, n/512]. Returns (x_fp8 [m, n] float8_e4m3fn, scales) with row-major scales.
    """
    assert x.dim() == 2 and x.size(1) % 128 == 0
    assert not use_ue8m0 or round_scale
    m, n = x.shape
    xv = x.float().reshape(m, n // 128, 128)
    amax = xv.abs().amax(dim=2).clamp(min=FP8_AMAX_MIN)
    if round_scale:
        e = _ceil_log2_exact(amax / FP8_MAX)
        scale = torch.ldexp(torch.ones_like(amax), e.float())
        q = xv * torch.ldexp(torch.ones_like(amax), (-e).float()).unsqueeze(2)
    else:
        scale = amax / FP8_MAX
        q = xv * (FP8_MAX / amax).unsqueeze(2)
    x_fp8 = q.to(torch.float8_e4m3fn).reshape(m, n)
    if use_ue8m0:
        assert n % 512 == 0
        b = (e + 127).to(torch.uint8).reshape(m, n // 512, 4).contiguous()
        return x_fp8, b.view(torch.int32).reshape(m, n // 512)
    return x_fp8, scale


FP8_AMAX_INV = torch.tensor(1.0 / 448.0, dtype=torch.float32)  # float32(1/448), as DeepEP's kernels hold it


def ll_fp8_scales_ref(x, round_scale):
    """The scales of DeepEP's low-latency dispatch cast (its kernels' calculate_fp8_scales), per row and 128 channels.

    amax = max(max |x|, 1e-4) in float32. Without round_scale: stored scale = float32(amax * float32(1/448)), and
    the kernel multiplies x by float32(448 / amax) (one correctly rounded division). With round_scale: e =
    ceil(log2(amax * float32(1/448))) read from the float's bits, stored scale 2^e, multiplier 2^-e.
    x: [N, H] (H a multiple of 128). Returns (stored float32 [N, H/128], multiplier float32 [N, H/128])."""
    n, h = x.shape
    amax = x.float().reshape(n, h // 128, 128).abs().amax(dim=2).clamp(min=FP8_AMAX_MIN)
    prod = (amax * FP8_AMAX_INV).to(torch.float32)
    if round_scale:
        e = _ceil_log2_exact(prod).float()
        one = torch.ones_like(prod)
        return torch.ldexp(one, e), torch.ldexp(one, -e)
    return prod, (torch.full_like(amax, FP8_MAX) / amax).to(torch.float32)


def ll_fp8_round_trip(x, round_scale):
    """BF16 [N, H]: the rows x as an expert sees them after an FP8 low-latency dispatch, DeepEP's cast
    (ll_fp8_scales_ref) then dequantized: bf16(float32(e4m3(x * multiplier)) * stored scale)."""
    n, h = x.shape
    stored, mult = ll_fp8_scales_ref(x, round_scale)
    q = (x.float().reshape(n, h // 128, 128) * mult.unsqueeze(2)).to(torch.float8_e4m3fn)
    return (q.float() * stored.unsqueeze(2)).reshape(n, h).to(torch.bfloat16)


def e4m3_rounding_mismatch(q, x, multiplier):
    """Mask of FP8 values q [N, H] that are not x * multiplier rounded to E4M3: |q - v| must stay within half an
    E4M3 step at v (the step is 2^(floor(log2 |v|) - 3), 2^-9 below 2^-6), v = x * multiplier in float64; values
    past 448 must be +-448; NaN always mismatches. x: [N, H]; multiplier: float32 [N, H/128]."""
    n, h = x.shape
    v = (x.double().reshape(n, h // 128, 128) * multiplier.double().unsqueeze(2)).reshape(n, h)
    exp = torch.floor(torch.log2(v.abs().clamp(min=2.0**-6)))
    half_step = torch.ldexp(torch.ones_like(v), exp - 4) * (1 + 2.0**-20)
    target = v.clamp(-FP8_MAX, FP8_MAX)
    return ~((q.double() - target).abs() <= half_step)


def unpack_scales(scales):
    """Float32 scales of shape [..., S] from float32 scales or UE8M0-packed int32 scales [..., S/4]."""
    if scales.dtype == torch.int32:
        b = dense(scales).view(torch.uint8)  # [..., S]
        return (b.to(torch.int32) << 23).view(torch.float32)
    assert scales.dtype == torch.float32, scales.dtype
    return scales


def per_token_cast_back(x_fp8, scales):
    """Dequantize to float32: x_fp8 [..., n] times the per-128-channel scales [..., n/128] (or UE8M0 int32)."""
    s = unpack_scales(scales).float()
    shape = x_fp8.shape
    xf = x_fp8.float().reshape(*shape[:-1], shape[-1] // 128, 128)
    return (xf * s.reshape(*shape[:-1], shape[-1] // 128, 1)).reshape(shape)


# ---------------------------------------------------------------------------------------------------------------
# Routing / layout (§2.1)


def layout_ref(topk_idx, num_experts, num_ranks, ranks_per_node):
    """(num_tokens_per_rank [R], num_tokens_per_rdma_rank [R/rpn] or None, num_tokens_per_expert [E],
    is_token_in_rank [N, R]) as int32 / bool. Node of rank r = r // ranks_per_node; -1 entries are ignored."""
    n = topk_idx.size(0)
    idx = topk_idx.long()
    e_l = num_experts // num_ranks
    valid = idx >= 0
    per_expert = torch.bincount(idx[valid].flatten(), minlength=num_experts)[:num_experts]
    owner = torch.where(valid, idx // e_l, torch.full_like(idx, -1))
    is_in = torch.zeros(n, num_ranks, dtype=torch.bool)
    for r in range(num_ranks):
        is_in[:, r] = (owner == r).any(dim=1) if idx.numel() else False
    per_rank = is_in.sum(dim=0)
    num_nodes = num_ranks // ranks_per_node
    if num_nodes == 1:
        per_node = None
    else:
        per_node = is_in.reshape(n, num_nodes, ranks_per_node).any(dim=2).sum(dim=0).to(torch.int32)
    return per_rank.to(torch.int32), per_node, per_expert.to(torch.int32), is_in


def align_up(v, a):
    return (v + a - 1) // a * a


def local_topk(topk_idx, rank, num_local_experts):
    """recv_topk_idx of rows received by `rank`: local ids in [0, E_l) for this rank's experts, -1 elsewhere."""
    idx = topk_idx.long()
    mine = (idx >= 0) & (idx // num_local_experts == rank)
    return torch.where(mine, idx - rank * num_local_experts, torch.full_like(idx, -1)), mine


def ht_dispatch_ref(rank, num_ranks, num_experts, all_topk_idx, all_topk_weights=None, expert_alignment=1):
    """What `rank` receives from a normal dispatch, given every rank's top-k (lists indexed by source rank).

    Returns a dict:
      src_rank [M] / src_token [M]: provenance of each received row, in receive order (source rank ascending,
        then source token ascending);
      recv_topk_idx [M, k] int64 / recv_topk_weights [M, k] float32 (zero where idx is -1), if weights given;
      per_expert [E_l] (unaligned), per_expert_list (aligned, Python ints);
      counts [R, R]: counts[i][j] = tokens rank i sends to rank j; rank_prefix_matrix = cumsum over i (inclusive);
      gbl_rank_prefix_sum [R] = cumsum of counts[:, rank].
    """
    e_l = num_experts // num_ranks
    counts = torch.zeros(num_ranks, num_ranks, dtype=torch.int64)
    src_rank, src_token, r_idx, r_w = [], [], [], []
    per_expert = torch.zeros(e_l, dtype=torch.int64)
    for src, idx in enumerate(all_topk_idx):
        _, _, _, is_in = layout_ref(idx, num_experts, num_ranks, num_ranks)
        counts[src] = is_in.sum(dim=0)
        toks = is_in[:, rank].nonzero().flatten()
        src_rank.append(torch.full((toks.numel(),), src, dtype=torch.int64))
        src_token.append(toks)
        lidx, mine = local_topk(idx[toks], rank, e_l)
        r_idx.append(lidx)
        per_expert += torch.bincount(lidx[lidx >= 0].flatten(), minlength=e_l)[:e_l]
        if all_topk_weights is not None:
            w = all_topk_weights[src][toks].float()
            r_w.append(torch.where(mine, w, torch.zeros_like(w)))
    k = all_topk_idx[0].size(1)
    out = {
        "src_rank": torch.cat(src_rank),
        "src_token": torch.cat(src_token),
        "recv_topk_idx": torch.cat(r_idx) if r_idx else torch.zeros(0, k, dtype=torch.int64),
        "per_expert": per_expert,
        "per_expert_list": [align_up(int(c), expert_alignment) for c in per_expert],
        "counts": counts,
        "rank_prefix_matrix": counts.cumsum(dim=0).to(torch.int32),
        "gbl_rank_prefix_sum": counts[:, rank].cumsum(dim=0).to(torch.int32),
    }
    if all_topk_weights is not None:
        out["recv_topk_weights"] = torch.cat(r_w)
    out["num_recv"] = int(out["src_rank"].numel())
    return out


def gather_rows(per_src, src_rank, src_token):
    """Rows per_src[src_rank[i]][src_token[i]] stacked in order (per_src: list of [N_src, ...] tensors)."""
    if src_rank.numel() == 0:
        t = per_src[0]
        return t.new_empty((0,) + tuple(t.shape[1:]))
    parts = []
    for src in range(len(per_src)):
        sel = src_rank == src
        if sel.any():
            parts.append((sel.nonzero().flatten(), per_src[src][src_token[sel]]))
    rows = torch.cat([p[1] for p in parts])
    order = torch.cat([p[0] for p in parts])
    out = torch.empty_like(rows)
    out[order] = rows
    return out


def ht_combine_weights_ref(topk_idx, topk_weights, is_token_in_rank, num_local_experts, fill_by_rank=False):
    """combined_topk_weights when every receiving rank r echoes its recv_topk_weights back (float64).

    Plain echo: each slot k is non-zero on exactly one rank (the owner of its expert, which always receives t),
    so the sum is the original weight where idx >= 0 and 0 elsewhere. fill_by_rank: every receiving rank r first
    writes (r + 1) into its -1 slots, so slot k gets w[t,k] (0 if idx is -1) plus (r + 1) for every rank r that
    got t and does not own slot k's expert.
    """
    idx = topk_idx.long()
    w = topk_weights.double()
    valid = idx >= 0
    owner = torch.where(valid, idx // num_local_experts, torch.full_like(idx, -1))
    ref = torch.where(valid, w, torch.zeros_like(w))
    if fill_by_rank:
        for r in range(is_token_in_rank.size(1)):
            got = is_token_in_rank[:, r].unsqueeze(1).expand_as(idx)
            ref = ref + torch.where(got & (owner != r), torch.full_like(w, r + 1.0), torch.zeros_like(w))
    return ref


# ---------------------------------------------------------------------------------------------------------------
# Low-latency (§1.10, §2.4)


def ll_expected(rank, num_ranks, num_experts, all_topk_idx):
    """counts [E_l, R] and tokens[e][j] (sorted int64 tensor, one entry per (t, k) selecting global expert
    rank*E_l + e on source j)."""
    e_l = num_experts // num_ranks
    counts = torch.zeros(e_l, num_ranks, dtype=torch.int64)
    tokens = [[None] * num_ranks for _ in range(e_l)]
    for j, idx in enumerate(all_topk_idx):
        for e in range(e_l):
            hit = (idx.long() == rank * e_l + e).nonzero()
            toks = hit[:, 0].sort().values if hit.numel() else torch.zeros(0, dtype=torch.int64)
            tokens[e][j] = toks
            counts[e, j] = toks.numel()
    return counts, tokens


def ll_struct_x(rank, num_tokens, hidden):
    """DeepEP's structured LL input: every value is rank - 128, the last 128 columns hold the token index."""
    x = torch.ones(num_tokens, hidden, dtype=torch.bfloat16) * (rank - 128)
    x[:, -128:] = torch.arange(num_tokens, dtype=torch.float32).to(torch.bfloat16).view(-1, 1)
    return x


# ---------------------------------------------------------------------------------------------------------------
# Expert outputs that tell apart what a combine could confuse
#
# A combine that fed the received rows back unchanged would hide a weight applied to the wrong top-k slot, a row
# reduced from the wrong expert or one rank's contribution counted twice: every confusion gives the same sum. The
# test experts below return rows that differ per unit (the global expert of an LL row, the receiving rank of a
# normal-mode row) by a factor, and per (unit, source rank) by an offset. They run on the CPU in float32 and round
# once to BF16; the references read the same BF16 values and sum in float64.

EXPERT_FACTOR_MOD = 251  # units that differ modulo this get different factors


def expert_factor(unit):
    """float32 factor in (1, 2] of a unit (int or int tensor): 1 + ((37 * unit) % 251 + 1) / 256."""
    u = torch.as_tensor(unit, dtype=torch.int64)
    return (1.0 + ((37 * u) % EXPERT_FACTOR_MOD + 1).to(torch.float32) / 256.0).to(torch.float32)


def expert_offset(unit, src_rank):
    """float32 offset of a (unit, source rank) pair, never 0: (((11 * unit + 29 * src) % 63) - 31.5) / 16."""
    u = torch.as_tensor(unit, dtype=torch.int64)
    s = torch.as_tensor(src_rank, dtype=torch.int64)
    return ((((11 * u + 29 * s) % 63).to(torch.float32) - 31.5) / 16.0).to(torch.float32)


def expert_output(x, unit, src_rank):
    """BF16 rows bf16(float32(x) * expert_factor(unit) + expert_offset(unit, src_rank)), on the CPU.

    x: [..., H] BF16 (or float32) CPU rows; unit, src_rank: ints or int tensors of shape x.shape[:-1] (or
    broadcastable to it)."""
    f = expert_factor(unit).unsqueeze(-1)
    o = expert_offset(unit, src_rank).unsqueeze(-1)
    return (x.float() * f + o).to(torch.bfloat16)


def ll_expert_outputs(recv_x, layout_range, rank):
    """Expert outputs of an LL dispatch's received rows, on the CPU.

    recv_x: BF16 [E_l, M, H] (FP8 dispatches dequantized to BF16 first); layout_range: int64 [E_l, R] with
    (begin << 32) | count of each source's rows. Row i of local expert e from source j becomes
    expert_output(row, rank * E_l + e, j); rows past the sources' blocks (never combined) are left as they came.
    Returns BF16 [E_l, M, H]."""
    e_l = recv_x.size(0)
    out = recv_x.clone()
    for e in range(e_l):
        for j in range(layout_range.size(1)):
            b, c = int(layout_range[e, j]) >> 32, int(layout_range[e, j]) & 0xFFFFFFFF
            if c:
                out[e, b : b + c] = expert_output(recv_x[e, b : b + c], rank * e_l + e, j)
    return out


def ll_combine_expert_ref(x, topk_idx, topk_weights, rank):
    """float64 LL combine at `rank` of what ll_expert_outputs returns for its rows, and the sum of the absolute
    terms (a bound for the FP32 accumulation's error).

    x: BF16 [N, H], the rows as the experts received them (an FP8 dispatch's dequantized rows); topk_idx [N, K]
    (-1: no expert); topk_weights float32 [N, K]. Returns (ref [N, H], abs_ref [N, H]) in float64."""
    n, h = x.shape
    ref = torch.zeros(n, h, dtype=torch.float64)
    absref = torch.zeros(n, h, dtype=torch.float64)
    idx = topk_idx.long()
    for k in range(idx.size(1)):
        valid = idx[:, k] >= 0
        if not valid.any():
            continue
        y = expert_output(x[valid], idx[valid, k], rank).double()
        term = topk_weights[valid, k].double().unsqueeze(1) * y
        ref[valid] += term
        absref[valid] += term.abs()
    return ref, absref


def ht_recv_src_ranks(handle, rank, num_recv):
    """Source rank of each row of a normal dispatch's recv_x, in receive order (source ranks ascending), from the
    handle: rank_prefix_matrix[:, rank] (intranode 6-tuple, handle[0]) or recv_gbl_rank_prefix_sum (internode
    10-tuple, handle[-4]), both inclusive prefix sums of the rows per source."""
    ends = handle[0][:, rank] if len(handle) == 6 else handle[-4]
    ends = ends.long().cpu()
    return torch.searchsorted(ends, torch.arange(num_recv), right=True)


def ht_expert_outputs(recv_x, rank, src_ranks):
    """Outputs of a normal-mode rank's experts for its received rows: expert_output(row, rank, source rank).
    recv_x: BF16 [M, H] (FP8 dequantized first); src_ranks: int64 [M]. Returns BF16 [M, H] on the CPU."""
    return expert_output(recv_x, rank, src_ranks)


def ht_combine_expert_ref(x, is_token_in_rank, rank, bias=None):
    """float64 normal-mode combine at `rank` when each receiving rank r returns ht_expert_outputs: for token t,
    sum over the ranks r that got t of expert_output(x[t], r, rank), plus the biases; and the sum of the absolute
    terms. x: BF16 [N, H] (as the receivers saw it); is_token_in_rank: bool [N, R]; bias: None, a tensor or a
    2-tuple of BF16 [N, H]."""
    n, h = x.shape
    ref = torch.zeros(n, h, dtype=torch.float64)
    absref = torch.zeros(n, h, dtype=torch.float64)
    for r in range(is_token_in_rank.size(1)):
        got = is_token_in_rank[:, r]
        if got.any():
            y = expert_output(x[got], r, rank).double()
            ref[got] += y
            absref[got] += y.abs()
    if bias is not None:
        for b in bias if isinstance(bias, tuple) else (bias,):
            ref += b.double()
            absref += b.double().abs()
    return ref, absref


def combine_mismatch(got, ref64, absref64, num_terms):
    """Mask of elements of a BF16 combine result that are not ref64 rounded to BF16: within half a BF16 step at ref64
    (2^(floor(log2 |ref64|) - 8)), plus what an FP32 accumulation of num_terms terms may add (each rounding at most
    2^-24 of the sum of the terms' magnitudes, absref64). NaN or infinite elements always mismatch."""
    _, e = torch.frexp(ref64)  # |ref64| = m * 2^e, m in [0.5, 1): floor(log2 |ref64|) = e - 1
    half_step = torch.ldexp(torch.ones_like(ref64), e - 9) * (1 + 2.0**-20)
    tol = half_step + absref64 * (num_terms + 1) * 2.0**-23 + 1e-30
    return ~((got.double() - ref64).abs() <= tol)


# ---------------------------------------------------------------------------------------------------------------
# Hashes (reproducibility)


def digest(*tensors):
    """Order-sensitive sha256 over dtype, shape and bytes of every tensor (None allowed)."""
    h = hashlib.sha256()
    for t in tensors:
        if t is None:
            h.update(b"None")
            continue
        if isinstance(t, (list, tuple)):
            h.update(repr(list(t)).encode() if not any(torch.is_tensor(v) for v in t) else digest(*t).encode())
            continue
        t = dense(t.detach())
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def row_multiset_digest(rows, keys=None):
    """Order-invariant digest of a set of rows (rows [n, ...], optional per-row integer keys [n, ...])."""
    items = []
    for i in range(rows.size(0)):
        key = b"" if keys is None else repr(keys[i].tolist()).encode()
        items.append(hashlib.sha1(key + dense(rows[i]).reshape(-1).view(torch.uint8).numpy().tobytes()).digest())
    h = hashlib.sha256()
    for it in sorted(items):
        h.update(it)
    return h.hexdigest()
