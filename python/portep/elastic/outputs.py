"""A dispatch's outputs in DeepEP V2's shapes, from the rows that arrived (arrival order) and their layout."""

from typing import Optional, Tuple

import torch

from .layout import ReceiveLayout
from .wire import DispatchColumns

Tensor = torch.Tensor


def sf_tensor(rows: int, num_sf: int, dtype: torch.dtype, device: torch.device, col_major: bool) -> Tensor:
    """An uninitialized [rows, num_sf] scale-factor output: row-major, or column-major with strides
    (1, rows rounded up to 4) (V2's use_tma_aligned_col_major_sf)."""
    if not col_major:
        return torch.empty(rows, num_sf, dtype=dtype, device=device)
    return torch.empty(num_sf, (rows + 3) // 4 * 4, dtype=dtype, device=device).t()[:rows]


class Arrived:
    """What a dispatch received, in V2's row order: row bytes [M, B] uint8 and metadata [M, W] int32 (M: the
    layout's rows, padding included)."""

    def __init__(self, row_bytes: Tensor, meta: Tensor, layout: ReceiveLayout) -> None:
        if layout.order is not None:
            row_bytes, meta = row_bytes[layout.order], meta[layout.order]
        self.row_bytes, self.meta = row_bytes, meta


def plain_outputs(
    arrived: Arrived,
    layout: ReceiveLayout,
    cols: DispatchColumns,
    x_dtype: torch.dtype,
    sf_dtype: Optional[torch.dtype],
    col_major_sf: bool,
    with_weights: bool,
) -> Tuple[object, Tensor, Optional[Tensor]]:
    """(recv_x or (recv_x, recv_sf) [M, ...], recv_topk_idx [M, K], recv_topk_weights [M, K] or None without
    weights), M the layout's rows; padding rows (past the tokens): recv_topk_idx -1, weights 0, data as it came."""
    recv_x = arrived.row_bytes.view(x_dtype)
    idx = layout.local_topk_idx.clone()  # (the layout's own stays with the handle)
    weights = None
    if with_weights:
        weights = torch.where(layout.row_valid[:, None], cols.weights_of(arrived.meta), 0.0)
    if sf_dtype is None:
        return recv_x, idx, weights
    sf = sf_tensor(layout.num_rows, cols.sf.stop - cols.sf.start, sf_dtype, recv_x.device, col_major_sf)
    sf.copy_(cols.sf_of(arrived.meta, sf_dtype))
    return (recv_x, sf), idx, weights


def expanded_outputs(
    arrived: Arrived,
    layout: ReceiveLayout,
    cols: DispatchColumns,
    x_dtype: torch.dtype,
    sf_dtype: Optional[torch.dtype],
    col_major_sf: bool,
    zero_padding: bool,
    with_weights: bool,
) -> Tuple[object, Optional[Tensor]]:
    """(recv_x or (recv_x, recv_sf) [X, ...], recv_topk_weights [X] float32 or None without weights): expanded
    row layout.expanded_row[i, k] holds token i for slot k; the rest is padding (zeros with zero_padding, else
    whatever the gather left; weights are zero there either way). Each row is gathered once, no CPU sync."""
    K = layout.local_topk_idx.size(1)
    slot = layout.expanded_slot
    padding = slot < 0
    token = torch.where(padding, 0, slot // K)  # (no rows arrived only with a CPU sync, and then X is 0 too)
    out = arrived.row_bytes.index_select(0, token)
    if zero_padding:
        out.masked_fill_(padding[:, None], 0)
    weights = None
    if with_weights:
        slot_weight = cols.weights_of(arrived.meta).flatten()
        weights = torch.where(padding, 0.0, slot_weight[slot.clamp(min=0)])
    recv_x = out.view(x_dtype)
    if sf_dtype is None:
        return recv_x, weights
    sf = sf_tensor(slot.size(0), cols.sf.stop - cols.sf.start, sf_dtype, out.device, col_major_sf)
    sf.copy_(cols.sf_of(arrived.meta, sf_dtype).index_select(0, token))
    if zero_padding:
        sf.masked_fill_(padding[:, None], 0)
    return (recv_x, sf), weights


def src_metadata(layout: ReceiveLayout, num_scaleup_ranks: int, num_max_tokens_per_rank: int) -> Tensor:
    """[M, K + 2] int32 (EPHandle.recv_src_metadata); padding rows are -1."""
    M, K = layout.local_topk_idx.shape
    meta = torch.full((M, K + 2), -1, dtype=torch.int32, device=layout.global_index.device)
    meta[:, 0] = layout.global_index
    scaleup = layout.global_index.long() // num_max_tokens_per_rank % num_scaleup_ranks
    meta[:, 1] = torch.where(layout.row_valid, scaleup * K + layout.highest_local_slot, -1).to(torch.int32)
    if layout.expanded_row is not None:
        meta[:, 2:] = layout.expanded_row.to(torch.int32)
    return meta
