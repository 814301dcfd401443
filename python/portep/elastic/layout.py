"""Where a dispatch's received tokens go in DeepEP V2's layouts, computed by the receiving rank from what arrived
(each token's global index and its local top-k ids). All torch, on the tensors' device.

Row order: tokens grouped by source scale-up rank (the group of rank r is r % num_scaleup_ranks), then by global
index (source rank x num_max_tokens_per_rank + token); with V2's deterministic mode by global index alone. Either
way every dispatch here is deterministic. Expanded layout: one row per (token, local expert), experts in order, each
expert's rows in the token order above, each expert's block starting at a multiple of the alignment."""

from dataclasses import dataclass
from typing import Optional

import torch

Tensor = torch.Tensor


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


@dataclass
class ReceiveLayout:
    """One dispatch's received tokens in V2's order (R tokens, K slots, E_l local experts)."""

    order: Optional[Tensor]  # [R] int64: arrival row of each output row; None when arrival order is already it
    global_index: Tensor  # [R] int32, output order
    local_topk_idx: Tensor  # [R, K] int64: local expert of each slot, -1 where the slot is not on this rank
    num_unaligned_per_expert: Tensor  # [E_l] int32: received (token, expert) pairs per local expert
    psum_per_scaleup_rank: Tensor  # [S] int32: inclusive prefix sum of tokens per source scale-up rank
    highest_local_slot: Tensor  # [R] int64: each token's last slot on this rank
    expanded_row: Optional[Tensor]  # [R, K] int64: the expanded row of each slot, -1 where none (expand only)
    num_expanded_rows: int  # X: the expanded layout's rows, padding included (0 unless expand)
    alignment: int

    @property
    def num_rows(self) -> int:
        """R."""
        return self.global_index.size(0)

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
) -> ReceiveLayout:
    """The layout of the tokens that arrived, in arrival order: global_index [R] int32, local_topk_idx [R, K]
    int64. Rows are ordered by global index alone without group_by_scaleup (V2's deterministic mode)."""
    src_rank = global_index.long() // num_max_tokens_per_rank
    group = src_rank % num_scaleup_ranks
    key = group * (1 << 40) * int(group_by_scaleup) + global_index.long()
    order = None
    if key.numel() > 1 and not bool((key[1:] > key[:-1]).all()):
        order = torch.argsort(key, stable=True)
        global_index, local_topk_idx, group = global_index[order], local_topk_idx[order], group[order]
    R, K = local_topk_idx.shape
    valid = local_topk_idx >= 0
    counts = torch.bincount(local_topk_idx[valid], minlength=num_local_experts).to(torch.int32)
    per_group = torch.bincount(group, minlength=num_scaleup_ranks)
    slots = torch.arange(1, K + 1, device=local_topk_idx.device)
    highest = (valid * slots).amax(1) - 1 if K else torch.zeros(R, dtype=torch.int64)
    layout = ReceiveLayout(
        order=order,
        global_index=global_index.to(torch.int32),
        local_topk_idx=local_topk_idx,
        num_unaligned_per_expert=counts,
        psum_per_scaleup_rank=torch.cumsum(per_group, 0, dtype=torch.int32),
        highest_local_slot=highest,
        expanded_row=None,
        num_expanded_rows=0,
        alignment=alignment,
    )
    if expand:
        layout.expanded_row, layout.num_expanded_rows = _expanded_rows(local_topk_idx, valid, layout)
    return layout


def _expanded_rows(local_topk_idx, valid, layout):
    """([R, K] int64 expanded row per slot or -1, X)."""
    R, K = local_topk_idx.shape
    aligned = layout.aligned_per_expert().long()
    start = torch.cumsum(aligned, 0) - aligned
    first_of_expert = torch.cumsum(layout.num_unaligned_per_expert.long(), 0) - layout.num_unaligned_per_expert.long()
    flat = valid.flatten().nonzero().flatten()
    expert = local_topk_idx.flatten()[flat]
    token = flat // max(K, 1)
    by_expert = torch.argsort(expert * max(R, 1) + token)
    expert_sorted = expert[by_expert]
    rank_in_expert = torch.arange(flat.numel(), device=flat.device) - first_of_expert[expert_sorted]
    rows = torch.full((R * K,), -1, dtype=torch.int64, device=local_topk_idx.device)
    rows[flat[by_expert]] = start[expert_sorted] + rank_in_expert
    return rows.view(R, K), int(aligned.sum())
