"""DeepEP V2's `EPHandle`: what a dispatch returns for its combine and for cached dispatches. A plain object whose
public attributes are V2's (DeepEP's tests reassign some of them); portep's own state sits in `route` (internal)."""

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from .layout import ReceiveLayout

Tensor = torch.Tensor


@dataclass
class Route:
    """What portep needs to repeat a dispatch (cached mode) or to combine (internal; N tokens sent, R received,
    K slots)."""

    v1_handle: tuple  # the V1 Buffer's handle of the dispatch that moved the tokens
    layout: ReceiveLayout
    slot_rank: Tensor  # [N, K] int64: the rank holding each slot's expert, -1 where none
    num_topk: int
    num_max_tokens_per_rank: int
    num_sf: int
    without_cpu_sync: bool  # outputs of V2's worst-case sizes, nothing read back (layout.num_rows: R or R_alloc)
    reverse: Dict[str, tuple] = field(default_factory=dict)  # combine's return trips by kind: (V1 handle, [C] bool
    # rows that hold a contribution)


class EPHandle:
    """The routing of one dispatch (DeepEP V2's EPHandle; see docs/api.md).

    Attributes (R received tokens, E_l local experts, K slots, N tokens sent, S scale-up ranks):
        do_expand, num_experts, expert_alignment, num_max_tokens_per_rank, num_sms: the dispatch's settings.
        topk_idx: [N, K] topk_idx_t, a copy of the dispatch's (the caller's own tensor when do_handle_copy=False).
        num_recv_tokens, num_expanded_tokens: R and X (the worst cases without a CPU sync).
        num_recv_tokens_per_expert_list: list of E_l ints, counts rounded up to expert_alignment (empty without a
            CPU sync).
        psum_num_recv_tokens_per_scaleup_rank: [S] int32, inclusive prefix sum of tokens per source scale-up rank.
        psum_num_recv_tokens_per_expert: [E_l] int32 (see docs/api.md for the expanded meaning).
        num_unaligned_recv_tokens_per_expert: [E_l] int32, real counts.
        recv_src_metadata: [R, K + 2] int32: column 0 the token's global index (source rank x
            num_max_tokens_per_rank + token), column 1 its source scale-up rank x K + its last local slot, columns
            2.. the expanded row of each slot (-1 where not local; -1 everywhere without expand).
        dst_buffer_slot_idx: [N, K] int32, the rank each slot went to (-1 where none).
        token_metadata_at_forward, channel_linked_list: None (V2's hybrid kernels' internals).
        route: portep's own record of the routing (a Route; internal).
    """

    def __init__(
        self,
        *,
        do_expand: bool,
        num_experts: int,
        expert_alignment: int,
        num_max_tokens_per_rank: int,
        num_sms: int,
        topk_idx: Tensor,
        num_recv_tokens: int,
        num_expanded_tokens: int,
        num_recv_tokens_per_expert_list: List[int],
        psum_num_recv_tokens_per_scaleup_rank: Tensor,
        psum_num_recv_tokens_per_expert: Tensor,
        num_unaligned_recv_tokens_per_expert: Tensor,
        recv_src_metadata: Tensor,
        dst_buffer_slot_idx: Tensor,
        route: Optional[Route] = None,
    ) -> None:
        self.do_expand = do_expand
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self.num_recv_tokens = num_recv_tokens
        self.num_expanded_tokens = num_expanded_tokens
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = num_unaligned_recv_tokens_per_expert
        self.recv_src_metadata = recv_src_metadata
        self.dst_buffer_slot_idx = dst_buffer_slot_idx
        self.token_metadata_at_forward = None
        self.channel_linked_list = None
        self.route = route

    def __repr__(self) -> str:
        return (
            f"EPHandle(do_expand={self.do_expand}, num_experts={self.num_experts}, "
            f"expert_alignment={self.expert_alignment}, num_recv_tokens={self.num_recv_tokens}, "
            f"num_expanded_tokens={self.num_expanded_tokens})"
        )
