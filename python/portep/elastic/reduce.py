"""Combine's arithmetic, DeepEP V2's reduction order (docs/api.md, ElasticBuffer combine): each contribution to a
token takes the place of one top-k slot (a rank's partial that of its last slot on that rank; an expanded row
without multiple reduction its own slot); sums run over slots in ascending order in FP32, adding +0.0 where a slot
has no contribution (as V2 does: it changes a result only where it would be -0.0), and are rounded to BF16 once per
level. The receiving ranks build the contributions (contributions()); the source, which receives them unreduced,
sums them (reduce_at_source()), so that every level of V2's recipe is reproduced bit for bit whatever route the
rows took. Every shape follows from the tensors' sizes: no value is read back to the CPU (CUDA-graph capturable)."""

from typing import Optional, Sequence, Tuple

import torch

from .._native import require_native
from .handle import Route
from .wire import CombineColumns

Tensor = torch.Tensor


def sum_slots(rows: Tensor, row_of_slot: Tensor, biases: Sequence[Tensor] = ()) -> Tensor:
    """[T, H] bf16: fp32(bias0) + fp32(bias1) (+0.0 without a bias), plus rows[row_of_slot[t, k]] for k = 0..K-1
    in order where that is >= 0, plus +0.0 where a slot had no row, rounded once to BF16. rows [C, H] bf16 (C may
    be 0), row_of_slot [T, K] int64 (-1: none), biases: zero to two [T, H] bf16.

    Adding the +0.0 of the empty slots once at the end gives V2's result (a +0.0 only turns a -0.0 sum into +0.0,
    and a sum never returns to -0.0 once it is not). One native pass (gpu_kernels/slot_sums.h) on the tensors'
    device, reading nothing back (CUDA-graph capturable); a row index outside [-1, C) raises on the CPU and turns
    the token's row into NaN on a GPU. Bitwise the torch sequence's result, except a NaN's bits (torch's differ by
    backend)."""
    T, K = row_of_slot.shape
    out = torch.empty(T, rows.size(1), dtype=torch.bfloat16, device=rows.device)
    bias0 = biases[0].contiguous() if len(biases) > 0 else None
    bias1 = biases[1].contiguous() if len(biases) > 1 else None
    args = (rows.contiguous(), row_of_slot.long().contiguous(), bias0, bias1, out)
    if not out.is_cuda:
        require_native().slot_sums(*args, 0)
        return out
    with torch.cuda.device(out.device):  # the kernel launches on the current device
        require_native().slot_sums(*args, torch.cuda.current_stream(out.device).cuda_stream)
    return out


def contributions(
    x: Tensor, topk_weights: Optional[Tensor], route: Route, expand: bool, per_slot: bool
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Optional[Tensor]]:
    """(rows [C, H] bf16, destination rank [C] (-1: none, a padding row), token there [C], slot [C], weights
    [C, K] float32 or None) of the combine input x: one per received row (non-expanded rows as given; expanded rows
    summed per token in slot order first), or with per_slot one per expanded row."""
    layout = route.layout
    T = route.num_max_tokens_per_rank
    M, K = layout.local_topk_idx.shape
    gidx, slot = layout.global_index.long(), layout.highest_local_slot
    weights = None
    if not expand:
        rows = x[:M]
        weights = None if topk_weights is None else topk_weights[:M]
    elif per_slot:
        rows = x[: layout.num_expanded_rows]
        held = layout.expanded_slot
        gidx = torch.where(held >= 0, gidx[(held // K).clamp(min=0)], -1)
        slot = held % K
    else:
        rows = sum_slots(x, layout.expanded_row)
        if topk_weights is not None:
            at = layout.expanded_row
            weights = torch.where(at >= 0, topk_weights[at.clamp(min=0)], 0.0)
    dest = torch.where(gidx >= 0, gidx // T, -1)
    return rows, dest, gidx.clamp(min=0) % T, slot, weights


def reduce_at_source(
    rows: Tensor,
    meta: Tensor,
    arrived: Tensor,
    cols: CombineColumns,
    route: Route,
    biases: Sequence[Tensor],
    nodes: Optional[Tuple[int, int]],
    with_weights: bool,
) -> Tuple[Tensor, Optional[Tensor]]:
    """(combined_x [N, H] bf16, combined_topk_weights [N, K] float32 or None) from the contributions that came back
    (rows [C, H] bf16, their columns, arrived [C] bool: False on padding rows). nodes: (nodes, ranks per node) to
    sum the ranks of each node first (V2's hybrid recipe with multiple reduction), else None."""
    N, K = route.slot_rank.shape
    token, slot = cols.token(meta), cols.slot(meta)
    carrier = torch.full((N * K + 1,), -1, dtype=torch.int64, device=rows.device)
    carrier[torch.where(arrived, token * K + slot, N * K)] = torch.arange(rows.size(0), device=rows.device)
    carrier = carrier[: N * K].view(N, K)  # the row that takes each slot's place, -1 where none (N * K: a sink)
    weights = _combined_weights(cols.weights_of(meta), carrier, route.slot_rank) if with_weights else None
    if nodes is not None:
        rows, carrier = _node_partials(rows, carrier, route.slot_rank, *nodes)
    return sum_slots(rows, carrier, biases), weights


def _node_partials(rows, carrier, slot_rank, num_nodes, node_ranks):
    """Each (token, node)'s contributions summed in slot order from +0.0 and rounded to BF16, keyed by the node's
    last slot with a contribution: (partials [N x G, H] bf16, their row per slot [N, K], -1 elsewhere), G the most
    nodes a token can reach. (A partial never sums to -0.0 from +0.0, so sum_slots' +0.0 for its empty slots
    changes nothing.)"""
    N, K = carrier.shape
    device = rows.device
    present = carrier >= 0
    node = torch.where(present, slot_rank // node_ranks, -1)
    same = (node[:, :, None] == node[:, None, :]) & present[:, None, :]
    last = (same * torch.arange(1, K + 1, device=device)).amax(2) - 1  # [N, K]: the last slot of k's node
    is_last = present & (last == torch.arange(K, device=device))
    G = max(1, min(K, num_nodes))
    ordinal = torch.cumsum(is_last, 1) - is_last.long()  # [N, K]: last slots before k
    group = ordinal.gather(1, last.clamp(min=0)) + torch.arange(N, device=device)[:, None] * G  # partial of k's node
    # partial p's row per slot: (group[t, k], k) is distinct for every present slot; absent ones go to a sink row
    rows_of_partial = torch.full((N * G + 1, K), -1, dtype=torch.int64, device=device)
    slots = torch.arange(K, device=device).expand(N, K)
    rows_of_partial[torch.where(present, group, N * G), slots] = torch.where(present, carrier, -1)
    partials = sum_slots(rows, rows_of_partial[: N * G])
    row_of_slot = torch.where(is_last, group, -1)
    return partials, row_of_slot


def _combined_weights(weights, carrier, slot_rank):
    """[N, K] float32: slot k's weight as the rank holding it sent it back (in the contribution of that rank's last
    slot), 0 where the slot had no expert. weights [C, K]: each contribution's row of weights."""
    N, K = slot_rank.shape
    if weights.size(0) == 0:
        return torch.zeros(N, K, dtype=torch.float32, device=slot_rank.device)
    valid = slot_rank >= 0
    same = (slot_rank[:, :, None] == slot_rank[:, None, :]) & valid[:, None, :]
    last_of_rank = (same * torch.arange(1, K + 1, device=slot_rank.device)).amax(2) - 1  # [N, K]
    row = carrier.gather(1, last_of_rank.clamp(min=0))
    out = weights[row.clamp(min=0), torch.arange(K, device=slot_rank.device)[None, :].expand(N, K)]
    return torch.where(valid & (row >= 0), out, torch.zeros_like(out))
