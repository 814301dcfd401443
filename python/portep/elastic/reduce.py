"""Combine's arithmetic, DeepEP V2's reduction order (docs/api.md, ElasticBuffer combine): each contribution to a
token takes the place of one top-k slot (a rank's partial that of its last slot on that rank; an expanded row
without multiple reduction its own slot); sums run over slots in ascending order in FP32 and are rounded to BF16
once per level. The receiving ranks build the contributions (contributions()); the source, which receives them
unreduced, sums them (reduce_at_source()), so that every level of V2's recipe is reproduced bit for bit whatever
route the rows took."""

from typing import Optional, Sequence, Tuple

import torch

from .handle import Route
from .wire import CombineColumns

Tensor = torch.Tensor
CHUNK_BYTES = 64 << 20  # bound on the [tokens, K, hidden] scratch of a two-level sum


def _with_zero_row(t: Tensor) -> Tensor:
    """t with one zero row appended: index t.size(0) reads zeros."""
    return torch.cat([t, t.new_zeros((1,) + tuple(t.shape[1:]))])


def contributions(
    x: Tensor, topk_weights: Optional[Tensor], route: Route, expand: bool, per_slot: bool
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Optional[Tensor]]:
    """(rows [C, H] bf16, destination rank [C], token there [C], slot [C], weights [C, K] float32 or None) of the
    combine input x: one per received token (non-expanded rows as given; expanded rows summed per token in slot
    order first), or with per_slot one per expanded (token, slot)."""
    layout = route.layout
    R = layout.num_rows
    max_tokens = route.num_max_tokens_per_rank
    gidx = layout.global_index.long()
    if not expand:
        rows, token_of = x[:R], torch.arange(R, device=x.device)
        slot = layout.highest_local_slot
        weights = None if topk_weights is None else topk_weights[:R]
    elif per_slot:
        valid = layout.expanded_row >= 0
        token_of, slot = valid.nonzero().unbind(1)
        rows = x[layout.expanded_row[valid]]
        weights = None
    else:
        exp_row = layout.expanded_row.clone()
        exp_row[exp_row < 0] = x.size(0)
        xz = _with_zero_row(x)
        acc = torch.zeros(R, x.size(1), dtype=torch.float32, device=x.device)
        for k in range(exp_row.size(1)):
            acc += xz[exp_row[:, k]].float()
        rows, token_of, slot = acc.to(torch.bfloat16), torch.arange(R, device=x.device), layout.highest_local_slot
        weights = None if topk_weights is None else _with_zero_row(topk_weights)[exp_row]
    src = gidx[token_of]
    return rows, src // max_tokens, src % max_tokens, slot, weights


def reduce_at_source(
    rows: Tensor,
    meta: Tensor,
    cols: CombineColumns,
    route: Route,
    num_tokens: int,
    biases: Sequence[Tensor],
    node_ranks: Optional[int],
    with_weights: bool,
) -> Tuple[Tensor, Optional[Tensor]]:
    """(combined_x [N, H] bf16, combined_topk_weights [N, K] float32 or None) from the contributions that came back
    (rows [C, H] bf16 and their columns). node_ranks: sum the ranks of each node of that many ranks first (V2's
    hybrid recipe with multiple reduction), else None."""
    N, K, H = num_tokens, route.num_topk, rows.size(1)
    device = rows.device
    at = torch.full((N, K), rows.size(0), dtype=torch.int64, device=device)  # contribution per slot, else zeros
    at[cols.token(meta), cols.slot(meta)] = torch.arange(rows.size(0), device=device)
    rows_z = _with_zero_row(rows)
    init = None
    for b in biases:
        init = b.float() if init is None else init + b.float()
    out = torch.empty(N, H, dtype=torch.bfloat16, device=device)
    step = max(1, CHUNK_BYTES // max(1, K * H * 2)) if node_ranks else max(N, 1)
    for t0 in range(0, N, step):
        t = slice(t0, min(N, t0 + step))
        base = None if init is None else init[t]
        if node_ranks:
            out[t] = _two_level(rows_z, at[t], route.slot_rank[t], node_ranks, base)
        else:
            out[t] = _ordered_sum(lambda k: rows_z[at[t][:, k]], K, base, at[t].size(0), H, device)
    weights = _combined_weights(meta, cols, at, route.slot_rank) if with_weights else None
    return out, weights


def _ordered_sum(value_at, num_slots, base, n, hidden, device):
    """bf16 of base (FP32, or zeros) plus value_at(k) for k = 0..num_slots-1, in that order, in FP32."""
    acc = base.clone() if base is not None else torch.zeros(n, hidden, dtype=torch.float32, device=device)
    for k in range(num_slots):
        acc += value_at(k).float()
    return acc.to(torch.bfloat16)


def _two_level(rows_z, at, slot_rank, node_ranks, base):
    """Per token: the contributions of each node's ranks summed in slot order and rounded (each node's partial in
    its last slot), then the final ordered sum over slots."""
    n, K = at.shape
    H = rows_z.size(1)
    node = torch.where(slot_rank >= 0, slot_rank // node_ranks, torch.full_like(slot_rank, -1))
    node_sorted, perm = torch.sort(node, dim=1, stable=True)
    partial = torch.zeros(n, K, H, dtype=torch.bfloat16, device=rows_z.device)
    acc = torch.zeros(n, H, dtype=torch.float32, device=rows_z.device)
    tokens = torch.arange(n, device=rows_z.device)
    for j in range(K):
        slot = perm[:, j]
        acc += rows_z[at[tokens, slot]].float()
        last = (
            torch.ones(n, dtype=torch.bool, device=rows_z.device)
            if j == K - 1
            else node_sorted[:, j] != node_sorted[:, j + 1]
        )
        partial[tokens, slot] = torch.where(last[:, None], acc, torch.zeros_like(acc)).to(torch.bfloat16)
        acc[last] = 0.0
    return _ordered_sum(lambda k: partial[:, k], K, base, n, H, rows_z.device)


def _combined_weights(meta, cols, at, slot_rank):
    """[N, K] float32: slot k's weight as the rank holding it sent it back (in the contribution of that rank's last
    slot), 0 where the slot had no expert."""
    N, K = slot_rank.shape
    valid = slot_rank >= 0
    same = (slot_rank[:, :, None] == slot_rank[:, None, :]) & valid[:, None, :]
    last_of_rank = (same * torch.arange(1, K + 1, device=slot_rank.device)).amax(2) - 1  # [N, K]
    carrier = at.gather(1, last_of_rank.clamp(min=0))
    w = _with_zero_row(cols.weights_of(meta))
    out = w[carrier, torch.arange(K, device=slot_rank.device)[None, :].expand(N, K)]
    return torch.where(valid, out, torch.zeros_like(out))
