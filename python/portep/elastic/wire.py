"""What ElasticBuffer sends through its V1 Buffer. A row is the token's bytes (BF16 or FP8 viewed as uint8); its
metadata rides in the V1 dispatch's scale-factor columns, which both engines carry byte for byte (int32, any
width). Dispatch and combine each have one column layout, defined here next to its encoder."""

from typing import Optional

import torch

Tensor = torch.Tensor


def as_bytes(x: Tensor) -> Tensor:
    """x [rows, cols] of 1- or 2-byte elements as uint8 [rows, cols * element size] (a view)."""
    return x.view(torch.uint8)


def as_int32(t: Tensor) -> Tensor:
    """A float32 or int32 tensor's bits as int32 (a view; any strides)."""
    return t if t.dtype == torch.int32 else t.view(torch.int32)


class DispatchColumns:
    """int32 columns of a dispatched token: [0] its global index (source rank x num_max_tokens_per_rank + token),
    [1, 1 + K) its top-k weights' float32 bits (zeros without weights), [1 + K, 1 + K + P) the P scale packs of an
    FP8 x (float32 or int32 bits)."""

    GLOBAL_INDEX = 0

    def __init__(self, num_topk: int, num_sf: int) -> None:
        self.weights = slice(1, 1 + num_topk)
        self.sf = slice(1 + num_topk, 1 + num_topk + num_sf)
        self.width = 1 + num_topk + num_sf

    def encode(self, global_index: Tensor, weights: Optional[Tensor], sf: Optional[Tensor]) -> Tensor:
        """[N, width] int32 from global_index [N] (int), weights [N, K] float32 or None, sf [N, P] or None."""
        meta = torch.zeros(global_index.size(0), self.width, dtype=torch.int32, device=global_index.device)
        meta[:, self.GLOBAL_INDEX] = global_index
        if weights is not None:
            meta[:, self.weights] = as_int32(weights)
        if sf is not None:
            meta[:, self.sf] = as_int32(sf)
        return meta

    def global_index(self, meta: Tensor) -> Tensor:
        """[rows] int32."""
        return meta[:, self.GLOBAL_INDEX]

    def weights_of(self, meta: Tensor) -> Tensor:
        """[rows, K] float32 (a copy)."""
        return meta[:, self.weights].contiguous().view(torch.float32)

    def sf_of(self, meta: Tensor, dtype: torch.dtype) -> Tensor:
        """[rows, P] of dtype (float32 or int32; a copy)."""
        return meta[:, self.sf].contiguous().view(dtype)


class CombineColumns:
    """int32 columns of a combine contribution sent back to the token's source: [0] the token's index there,
    [1] the top-k slot whose place the contribution takes in the source's ordered sum, [2, 2 + K) the float32 bits
    of the top-k weights it carries back (zeros where none)."""

    TOKEN, SLOT = 0, 1

    def __init__(self, num_topk: int) -> None:
        self.weights = slice(2, 2 + num_topk)
        self.width = 2 + num_topk

    def encode(self, token: Tensor, slot: Tensor, weights: Optional[Tensor]) -> Tensor:
        """[C, width] int32 from token [C], slot [C] (ints) and weights [C, K] float32 or None."""
        meta = torch.zeros(token.size(0), self.width, dtype=torch.int32, device=token.device)
        meta[:, self.TOKEN] = token
        meta[:, self.SLOT] = slot
        if weights is not None:
            meta[:, self.weights] = as_int32(weights)
        return meta

    def token(self, meta: Tensor) -> Tensor:
        """[C] int64."""
        return meta[:, self.TOKEN].long()

    def slot(self, meta: Tensor) -> Tensor:
        """[C] int64."""
        return meta[:, self.SLOT].long()

    def weights_of(self, meta: Tensor) -> Tensor:
        """[C, K] float32 (a copy)."""
        return meta[:, self.weights].contiguous().view(torch.float32)
