"""Where a dispatch's received tokens go in DeepEP V2's layouts, computed by the receiving rank from what arrived
(each token's global index and its local top-k ids). All torch, on the tensors' device, and without a CPU sync:
every shape follows from the arrival rows M (the exact count, or V2's worst case R_alloc with padding rows whose
local top-k ids are all -1), so a dispatch without CPU sync can be captured in a CUDA graph.

Row order: tokens grouped by source scale-up rank (the group of rank r is r % num_scaleup_ranks), then by global
index (source rank x num_max_tokens_per_rank + token); with V2's deterministic mode by global index alone; padding
rows last. Either way every dispatch here is deterministic. Expanded layout: one row per (token, local expert),
experts in order, each expert's rows in the token order above, each expert's block starting at a multiple of the
alignment."""

from dataclasses import dataclass
from typing import Optional

import torch

Tensor = torch.Tensor
_PADDING_KEY = 1 << 62  # sorts after every real token's key (scale-up group << 40 | global index)


def align_up(value: Tensor, alignment: int) -> Tensor:
    """value (an int tensor) rounded up to a multiple of alignment."""
    return (value + alignment - 1) // alignment * alignment


def worst_case_rows(num_ranks: int, num_max_tokens_per_rank: int) -> int:
    """Rows of a non-expanded output without a CPU sync (V2's R_alloc)."""
    return num_ranks * num_max_tokens_per_rank


def worst_case_expanded_rows(
    num_ranks: int, num_max_tokens_per_rank: int, num_topk: int, num_local_experts: int, alignment: int
) -> int:
    """Rows of an expanded output without a CPU sync (V2's X_alloc)."""
    rows = num_ranks * num_max_tokens_per_rank * min(num_topk, num_local_experts) + (alignment - 1) * num_local_experts
    return (rows + alignment - 1) // alignment * alignment


def count_into(index: Tensor, valid: Tensor, bins: int) -> Tensor:
    """[bins] int32: how often each value of index (any shape, ints) occurs where valid; no CPU sync (unlike
    torch.bincount on a GPU)."""
    flat = torch.where(valid, index, torch.full_like(index, bins)).flatten()
    counts = torch.zeros(bins + 1, dtype=torch.int32, device=index.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    return counts[:bins]


@dataclass
class ReceiveLayout:
    """One dispatch's received tokens in V2's order (M rows: R tokens then padding; K slots, E_l local experts)."""

    order: Optional[Tensor]  # [M] int64: arrival row of each output row; None when arrival order is already it
    global_index: Tensor  # [M] int32, output order; -1 on padding rows
    local_topk_idx: Tensor  # [M, K] int64: local expert of each slot, -1 where the slot is not on this rank
    num_unaligned_per_expert: Tensor  # [E_l] int32: received (token, expert) pairs per local expert
    psum_per_scaleup_rank: Tensor  # [S] int32: inclusive prefix sum of tokens per source scale-up rank
    highest_local_slot: Tensor  # [M] int64: each token's last slot on this rank; -1 on padding rows
    expanded_row: Optional[Tensor]  # [M, K] int64: the expanded row of each slot, -1 where none (expand only)
    expanded_slot: Optional[Tensor]  # [X] int64: the slot (row x K + k) each expanded row holds, -1 for padding
    alignment: int

    @property
    def num_rows(self) -> int:
        """M: the rows of the non-expanded outputs."""
        return self.global_index.size(0)

    @property
    def num_expanded_rows(self) -> int:
        """X: the expanded layout's rows, padding included (0 unless expand)."""
        return 0 if self.expanded_slot is None else self.expanded_slot.size(0)

    @property
    def row_valid(self) -> Tensor:
        """[M] bool: the rows that hold a token (not padding)."""
        return self.global_index >= 0

    def aligned_per_expert(self) -> Tensor:
        """[E_l] int32: each local expert's count rounded up to the alignment."""
        return align_up(self.num_unaligned_per_expert, self.alignment)

    def psum_per_expert(self, expand: bool) -> Tensor:
        """[E_l] int32 as V2's handle holds it: inclusive prefix sum of aligned counts; expanded: each expert's
        aligned start plus its real count."""
        aligned = self.aligned_per_expert()
        inclusive = torch.cumsum(aligned, 0, dtype=torch.int32)
        if not expand:
            return inclusive
        return (inclusive - aligned + self.num_unaligned_per_expert).to(torch.int32)


def receive_layout(
    global_index: Tensor,
    local_topk_idx: Tensor,
    num_max_tokens_per_rank: int,
    num_scaleup_ranks: int,
    num_local_experts: int,
    alignment: int,
    expand: bool,
    group_by_scaleup: bool = True,
    expanded_rows: int = 0,
) -> ReceiveLayout:
    """The layout of the M arrival rows: global_index [M] int32 (anything on padding rows), local_topk_idx [M, K]
    int64 (all -1 on padding rows). Rows are ordered by global index alone without group_by_scaleup (V2's
    deterministic mode). expanded_rows: X of an expanded layout (the exact aligned total, or V2's worst case), at
    least the aligned counts' sum. Nothing is read back from a GPU."""
    M, K = local_topk_idx.shape
    valid = local_topk_idx >= 0
    row_valid = valid.any(1) if K else torch.zeros(M, dtype=torch.bool, device=local_topk_idx.device)
    global_index = torch.where(row_valid, global_index.long(), torch.full_like(global_index, -1, dtype=torch.int64))
    group = global_index // num_max_tokens_per_rank % num_scaleup_ranks
    key = torch.where(row_valid, group * (1 << 40) * int(group_by_scaleup) + global_index, _PADDING_KEY)
    order = None
    if not _is_sorted(key):
        order = torch.argsort(key)  # (keys of real rows are distinct; padding rows keep no particular order)
        global_index, local_topk_idx, valid, group = (
            global_index[order],
            local_topk_idx[order],
            valid[order],
            group[order],
        )
        row_valid = row_valid[order]
    slots = torch.arange(1, K + 1, device=local_topk_idx.device)
    layout = ReceiveLayout(
        order=order,
        global_index=global_index.to(torch.int32),
        local_topk_idx=local_topk_idx,
        num_unaligned_per_expert=count_into(local_topk_idx, valid, num_local_experts),
        psum_per_scaleup_rank=torch.cumsum(count_into(group, row_valid, num_scaleup_ranks), 0, dtype=torch.int32),
        highest_local_slot=(valid * slots).amax(1) - 1 if K else torch.full((M,), -1, device=local_topk_idx.device),
        expanded_row=None,
        expanded_slot=None,
        alignment=alignment,
    )
    if expand:
        layout.expanded_row, layout.expanded_slot = _expanded_rows(local_topk_idx, valid, layout, expanded_rows)
    return layout


def may_read_back(t: Tensor) -> bool:
    """Whether reading t's values costs nothing (a CPU tensor); a GPU's would wait for the stream."""
    return t.device.type == "cpu"


def _is_sorted(key: Tensor) -> bool:
    """Whether key ascends already; checked only where it can be read back (elsewhere the rows are always
    sorted)."""
    if key.numel() <= 1:
        return True
    if not may_read_back(key):
        return False
    return bool((key[1:] > key[:-1]).all())


def _expanded_rows(local_topk_idx, valid, layout, num_expanded_rows):
    """([M, K] int64 expanded row per slot or -1, [X] int64 slot of each expanded row or -1)."""
    M, K = local_topk_idx.shape
    device = local_topk_idx.device
    E_l = layout.num_unaligned_per_expert.numel()
    counts = layout.num_unaligned_per_expert.long()
    aligned = layout.aligned_per_expert().long()
    start = torch.cumsum(aligned, 0) - aligned
    first_of_expert = torch.cumsum(counts, 0) - counts
    flat_slot = torch.arange(M * K, device=device)
    expert = torch.where(valid, local_topk_idx, E_l).flatten()
    by_expert = torch.argsort(expert * max(M * K, 1) + flat_slot)  # experts in order, each in row order
    expert_sorted = expert[by_expert]
    real = expert_sorted < E_l
    at = expert_sorted.clamp(max=max(E_l - 1, 0))
    rank_in_expert = flat_slot - first_of_expert[at] if E_l else flat_slot
    rows_sorted = torch.where(real, start[at] + rank_in_expert, -1) if E_l else torch.full_like(flat_slot, -1)
    rows = torch.empty(M * K, dtype=torch.int64, device=device)
    rows[by_expert] = rows_sorted
    slot_of_row = torch.full((num_expanded_rows + 1,), -1, dtype=torch.int64, device=device)
    slot_of_row[torch.where(rows >= 0, rows, num_expanded_rows)] = flat_slot  # row X is a sink for the non-slots
    return rows.view(M, K), slot_of_row[:num_expanded_rows]
