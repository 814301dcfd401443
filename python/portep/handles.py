"""The dispatch handles, typed. DeepEP hands its users a 6-tuple (one node) or a 10-tuple (across nodes) from a
normal-mode dispatch and a 5-tuple from a low-latency one, and takes it back for a cached dispatch or a combine;
portep's handles are these NamedTuples, which are those tuples (DeepEP code indexes and unpacks them unchanged) and
which the library reads by name. A tuple a caller rebuilt comes back typed through normal_handle() / ll_handle().
Field meanings: ../shared/reference/deepep-api.md, docs/api.md."""

from typing import Any, NamedTuple, Sequence, Union

import torch

Tensor = torch.Tensor


class IntranodeHandle(NamedTuple):
    """DeepEP's intranode handle (C channels, R ranks, N tokens sent, M tokens received)."""

    rank_prefix_matrix: Tensor  # [R, R] int32: [i][j] = rows from ranks 0..i to rank j
    channel_prefix_matrix: Tensor  # [R, C] int32: inclusive over channels, rows this rank sends each destination
    recv_channel_prefix_matrix: Tensor  # [R, C] int32: exclusive over channels, rows from each source
    recv_src_idx: Tensor  # [M] int32: each received row's token index on its source
    is_token_in_rank: Tensor  # [N, R] bool
    send_head: Tensor  # [N, R] int32: each token's row position at each destination, -1 where not sent

    @property
    def send_channel_prefix(self) -> Tensor:
        """[R, C] int32: inclusive over channels, the rows this rank sends to each rank."""
        return self.channel_prefix_matrix

    @property
    def recv_channel_prefix(self) -> Tensor:
        """[R, C] int32: exclusive over channels, where each source's rows of each channel begin."""
        return self.recv_channel_prefix_matrix

    @property
    def num_recv_tokens(self) -> int:
        """Rows this rank received (M)."""
        return self.recv_src_idx.size(0)


class InternodeHandle(NamedTuple):
    """DeepEP's internode handle (Nn nodes, C channels, R ranks, N tokens sent, M tokens received; int32 unless
    noted)."""

    is_token_in_rank: Tensor  # [N, R] bool
    rdma_channel_prefix_matrix: Tensor  # [Nn, C]: inclusive over channels, this rank's tokens to each node
    gbl_channel_prefix_matrix: Tensor  # [R, C]: inclusive over channels, rows this rank sends each rank
    recv_rdma_channel_prefix_matrix: Tensor  # [Nn, C]: rows from each node's served source, by channel
    recv_rdma_rank_prefix_sum: Tensor  # [Nn]: inclusive over nodes, rows from each node's served source
    recv_gbl_channel_prefix_matrix: Tensor  # [R, C]: exclusive over channels, rows from each source
    recv_gbl_rank_prefix_sum: Tensor  # [R]: inclusive over sources; the last is M
    recv_src_meta: Tensor  # [M, 8] uint8: each row's source node (int32) and local-rank mask (int32)
    send_rdma_head: Tensor  # [N, Nn]
    send_nvl_head: Tensor  # [rows this rank forwards, 8]

    @property
    def send_channel_prefix(self) -> Tensor:
        """[R, C] int32: inclusive over channels, the rows this rank sends to each rank."""
        return self.gbl_channel_prefix_matrix

    @property
    def recv_channel_prefix(self) -> Tensor:
        """[R, C] int32: exclusive over channels, where each source's rows of each channel begin."""
        return self.recv_gbl_channel_prefix_matrix

    @property
    def num_recv_tokens(self) -> int:
        """Rows this rank received (M)."""
        return self.recv_src_meta.size(0)


NormalHandle = Union[IntranodeHandle, InternodeHandle]


def normal_handle(items: Sequence[Tensor], internode: bool) -> NormalHandle:
    """items (a handle, or a tuple or list with its fields in DeepEP's order) as the typed handle; the caller has
    checked the length."""
    cls = InternodeHandle if internode else IntranodeHandle
    return items if type(items) is cls else cls._make(items)


def handle_length(internode: bool) -> int:
    """How many tensors a handle holds: 6 on one node, 10 across nodes."""
    return len((InternodeHandle if internode else IntranodeHandle)._fields)


class LLHandle(NamedTuple):
    """DeepEP's low-latency handle (E_l local experts, R ranks, M = R * num_max_dispatch_tokens_per_rank). The LL
    fast path makes it natively (python/src/ll_torch_path.cpp, given this class) and takes it, or any 5-tuple in this
    order, back."""

    src_info: Tensor  # [E_l, M] int32: each received row's token index on its source
    layout_range: Tensor  # [E_l, R] int64: (begin << 32) | count of each source's rows
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int


def ll_handle(items: Sequence[Any]) -> LLHandle:
    """items (an LL handle, or a tuple or list of its 5 fields in DeepEP's order) as the typed handle; the caller has
    checked it (validation.check_ll_handle)."""
    return items if type(items) is LLHandle else LLHandle._make(items)
