"""Combine's arithmetic, DeepEP V2's reduction order (docs/api.md, ElasticBuffer combine): each contribution to a
token takes the place of one top-k slot (a rank's partial that of its last slot on that rank; an expanded row
without multiple reduction its own slot); sums run over slots in ascending order in FP32 and are rounded to BF16
once per level. The receiving ranks build the contributions (contributions()); the source, which receives them
unreduced, sums them (reduce_at_source()), so that every level of V2's recipe is reproduced bit for bit whatever
route the rows took. Every sum touches only the rows that exist: V2 adds +0.0 for the slots in between, which
changes a result only where it would be -0.0 (fixed at the end, _as_if_zeros_were_added)."""

from typing import Optional, Sequence, Tuple

import torch

from .handle import Route
from .wire import CombineColumns

Tensor = torch.Tensor


def ordered_sums(rows: Tensor, group: Tensor, key: Tensor, init: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Per group g in 0..G-1 (G = init's rows, else group.max() + 1): init[g] (FP32, updated in place; +0.0 without
    init) plus the rows of that group in ascending key order, in FP32. rows [C, H] BF16, group and key [C] int64
    (keys distinct within a group, below 2**20). Returns (sums [G, H] float32, rows per group [G] int64)."""
    G = init.size(0) if init is not None else (int(group.max()) + 1 if group.numel() else 0)
    acc = init if init is not None else torch.zeros(G, rows.size(1), dtype=torch.float32, device=rows.device)
    counts = torch.bincount(group, minlength=G)
    if group.numel() == 0:
        return acc, counts
    order = torch.argsort(group * (1 << 20) + key)
    group_sorted = group[order]
    position = torch.arange(order.numel(), device=rows.device) - (torch.cumsum(counts, 0) - counts)[group_sorted]
    for j in range(int(counts.max())):
        at_j = position == j  # the j-th row of each group that has one: one row per group, so one add each
        groups_j, rows_j = group_sorted[at_j], rows.index_select(0, order[at_j])
        if groups_j.numel() == G:  # every group (in order: the sort is by group)
            acc.add_(rows_j)
        else:
            acc.index_add_(0, groups_j, rows_j.float())
    return acc, counts


def contributions(
    x: Tensor, topk_weights: Optional[Tensor], route: Route, expand: bool, per_slot: bool
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Optional[Tensor]]:
    """(rows [C, H] bf16, destination rank [C], token there [C], slot [C], weights [C, K] float32 or None) of the
    combine input x: one per received token (non-expanded rows as given; expanded rows summed per token in slot
    order first), or with per_slot one per expanded (token, slot)."""
    layout = route.layout
    R = layout.num_rows
    device = x.device
    gidx = layout.global_index.long()
    if not expand:
        rows, token_of, slot = x[:R], torch.arange(R, device=device), layout.highest_local_slot
        weights = None if topk_weights is None else topk_weights[:R]
    else:
        valid = layout.expanded_row >= 0
        token_of, slot = valid.nonzero().unbind(1)
        rows = x[layout.expanded_row[valid]]
        weights = None
        if not per_slot:
            init = torch.zeros(R, x.size(1), dtype=torch.float32, device=device)
            rows = ordered_sums(rows, token_of, slot, init)[0].to(torch.bfloat16)
            token_of, slot = torch.arange(R, device=device), layout.highest_local_slot
            if topk_weights is not None:
                weights = torch.zeros(R, valid.size(1), dtype=torch.float32, device=device)
                weights[valid] = topk_weights[layout.expanded_row[valid]]
    src = gidx[token_of]
    return rows, src // route.num_max_tokens_per_rank, src % route.num_max_tokens_per_rank, slot, weights


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
    token, slot = cols.token(meta), cols.slot(meta)
    if not biases:
        init = torch.zeros(N, H, dtype=torch.float32, device=rows.device)
    else:
        init = biases[0].float() if len(biases) == 1 else biases[0].float() + biases[1].float()  # (new tensors)
    weights = _combined_weights(cols.weights_of(meta), token, slot, route.slot_rank) if with_weights else None
    if node_ranks is not None:
        rows, token, slot = _node_partials(rows, token, slot, route.slot_rank, node_ranks)
    acc, counts = ordered_sums(rows, token, slot, init)
    return _as_if_zeros_were_added(acc, counts, K).to(torch.bfloat16), weights


def _node_partials(rows, token, slot, slot_rank, node_ranks):
    """Each (token, node)'s contributions summed in slot order and rounded to BF16, keyed by their last slot."""
    node = slot_rank[token, slot] // node_ranks
    pair = token * (int(slot_rank.max()) // node_ranks + 1 if slot_rank.numel() else 1) + node
    pairs, group = torch.unique(pair, return_inverse=True)
    init = torch.zeros(pairs.numel(), rows.size(1), dtype=torch.float32, device=rows.device)
    sums, _ = ordered_sums(rows, group, slot, init)
    last = torch.full((pairs.numel(),), -1, dtype=torch.int64, device=rows.device).scatter_reduce(
        0, group, slot, "amax"
    )
    first_of = torch.full((pairs.numel(),), 0, dtype=torch.int64, device=rows.device).scatter_(0, group, token)
    return sums.to(torch.bfloat16), first_of, last


def _as_if_zeros_were_added(acc, counts, num_slots):
    """V2 adds +0.0 at every slot without a contribution; x + 0.0 is x, except that -0.0 becomes +0.0."""
    short = counts < num_slots
    if bool(short.all()):
        return acc.add_(0.0)
    rows = short.nonzero().flatten()
    return acc.index_add_(0, rows, torch.zeros(rows.numel(), acc.size(1), dtype=acc.dtype, device=acc.device))


def _combined_weights(weights, token, slot, slot_rank):
    """[N, K] float32: slot k's weight as the rank holding it sent it back (in the contribution of that rank's last
    slot), 0 where the slot had no expert. weights [C, K]: each contribution's row of weights."""
    N, K = slot_rank.shape
    if token.numel() == 0:
        return torch.zeros(N, K, dtype=torch.float32, device=slot_rank.device)
    carrier = torch.full((N, K), -1, dtype=torch.int64, device=slot_rank.device)
    carrier[token, slot] = torch.arange(token.numel(), device=slot_rank.device)
    valid = slot_rank >= 0
    same = (slot_rank[:, :, None] == slot_rank[:, None, :]) & valid[:, None, :]
    last_of_rank = (same * torch.arange(1, K + 1, device=slot_rank.device)).amax(2) - 1  # [N, K]
    row = carrier.gather(1, last_of_rank.clamp(min=0))
    out = weights[row.clamp(min=0), torch.arange(K, device=slot_rank.device)[None, :].expand(N, K)]
    return torch.where(valid & (row >= 0), out, torch.zeros_like(out))
