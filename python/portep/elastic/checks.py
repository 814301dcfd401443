"""ElasticBuffer's argument checks: every error names the argument, its value and the limit, and is raised before
any traffic (the caller turns it into a refusal its peers learn of, buffer.Buffer.refuse). Wrong types raise
TypeError; wrong shapes, values and combinations ValueError (DeepEP V2 asserts in several of these places)."""

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch

from .. import validation as v
from ..deepep_config import check_int
from .events import EventHandle
from .handle import EPHandle

MAX_TOPK = 32
Tensor = torch.Tensor


@dataclass
class DispatchArgs:
    """A dispatch's checked arguments (topk_idx is None with a handle)."""

    x: Tensor
    sf: Optional[Tensor]
    topk_idx: Optional[Tensor]
    topk_weights: Optional[Tensor]
    stats: Optional[Tensor]
    num_experts: int
    num_max_tokens: int
    alignment: int
    num_sms: int
    cpu_sync: bool
    expand: bool
    zero_padding: bool

    @property
    def num_sf(self) -> int:
        """P: scale packs per row (0 for BF16)."""
        return 0 if self.sf is None else self.sf.size(1)

    @property
    def sf_dtype(self) -> Optional[torch.dtype]:
        """The scale factors' dtype, None for BF16."""
        return None if self.sf is None else self.sf.dtype


def _device(buf: Any) -> str:
    return buf.device.type


def check_events(previous_event: Any, allocate_on_comm_stream: bool) -> None:
    """previous_event is an EventHandle (from capture()) and comes with allocate_on_comm_stream=True, as in V2."""
    if previous_event is None:
        return
    if not isinstance(previous_event, EventHandle):
        raise TypeError(f"previous_event must be an EventHandle (from capture()), got {type(previous_event).__name__}")
    if not allocate_on_comm_stream:
        raise ValueError("previous_event requires allocate_on_comm_stream=True (as in DeepEP V2)")


def _check_x(x: Any, device: str) -> Tuple[Tensor, Optional[Tensor]]:
    sf = None
    if isinstance(x, tuple):
        if len(x) != 2:
            raise ValueError(f"x as a tuple must be (x, sf), got {len(x)} elements")
        x, sf = x
        v.check_tensor(
            "x", x, dtypes=(torch.float8_e4m3fn,), shape=(("num_tokens", None), ("hidden", None)), device=device
        )
        v.check_tensor(
            "sf",
            sf,
            dtypes=(torch.float32, torch.int32),
            shape=(("num_tokens", x.size(0)), ("num_sf", None)),
            contiguous=False,
            device=device,
        )
    else:
        v.check_tensor("x", x, dtypes=(torch.bfloat16,), shape=(("num_tokens", None), ("hidden", None)), device=device)
    row_bytes = x.size(1) * x.element_size()
    if row_bytes % v.ROW_ALIGN_BYTES:
        raise ValueError(
            f"x rows are {row_bytes} bytes (hidden={x.size(1)}); they must be a multiple of {v.ROW_ALIGN_BYTES}"
        )
    return x, sf


def _check_topk(topk_idx, topk_weights, num_experts, num_tokens, device, cpu_sync):
    v.check_topk_idx("topk_idx", topk_idx, num_experts, num_tokens=num_tokens, max_topk=MAX_TOPK, device=device)
    if topk_weights is not None:
        v.check_topk_weights("topk_weights", topk_weights, tuple(topk_idx.shape), device)
    # Reading a GPU tensor's values waits for the stream: checked there only where the dispatch syncs anyway (V1's
    # value checks skip GPU tensors likewise; a dispatch without CPU sync can be captured in a CUDA graph).
    if topk_idx.size(1) > 1 and topk_idx.numel() and (cpu_sync or topk_idx.device.type == "cpu"):
        ordered = topk_idx.sort(1).values
        repeated = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
        if bool(repeated.any()):
            row = int(repeated.any(1).nonzero()[0])
            raise ValueError(
                f"topk_idx row {row} selects an expert twice ({topk_idx[row].tolist()}); each token's experts must "
                f"differ"
            )


def _check_handle(buf, handle, num_experts, num_max_tokens, alignment, do_cpu_sync, do_expand, stats, x):
    if not isinstance(handle, EPHandle) or handle.route is None:
        raise TypeError(f"handle must be an EPHandle from this ElasticBuffer's dispatch, got {type(handle).__name__}")
    for name, given, own in (
        ("num_experts", num_experts, handle.num_experts),
        ("num_max_tokens_per_rank", num_max_tokens, handle.num_max_tokens_per_rank),
        ("expert_alignment", alignment, handle.expert_alignment),
        ("do_expand", do_expand, handle.do_expand),
    ):
        if given is not None and given != own:
            raise ValueError(f"{name}={given} differs from the handle's {name}={own} (cached dispatch)")
    if do_cpu_sync:
        raise ValueError("do_cpu_sync=True with a handle: a cached dispatch never waits for counts (pass None)")
    if stats is not None:
        raise ValueError("cumulative_local_expert_recv_stats is not allowed with a handle (cached dispatch)")
    num_tokens = handle.route.slot_rank.size(0)
    if x.size(0) != num_tokens:
        raise ValueError(f"x has {x.size(0)} tokens; the handle was made by a dispatch of {num_tokens}")


def dispatch_args(
    buf: Any,
    x: Any,
    topk_idx: Optional[Tensor],
    topk_weights: Optional[Tensor],
    stats: Optional[Tensor],
    num_experts: Optional[int],
    num_max_tokens: Optional[int],
    alignment: Optional[int],
    num_sms: int,
    num_qps: int,
    handle: Optional[EPHandle],
    do_cpu_sync: Optional[bool],
    do_expand: bool,
    do_zero_padding: bool,
    previous_event: Any,
    allocate_on_comm_stream: bool,
) -> DispatchArgs:
    """A dispatch's arguments, checked, with the handle's values where it is given."""
    device = _device(buf)
    check_events(previous_event, allocate_on_comm_stream)
    x, sf = _check_x(x, device)
    check_int("num_sms", num_sms, 0)
    check_int("num_qps", num_qps, 0, buf.num_allocated_qps)
    if do_zero_padding and not do_expand:
        raise ValueError("do_zero_padding=True needs do_expand=True (it zeroes the expanded layout's padding)")
    if handle is not None:
        if topk_idx is not None:
            raise ValueError("dispatch with a handle (cached mode) reuses its routing: topk_idx must be None")
        _check_handle(buf, handle, num_experts, num_max_tokens, alignment, do_cpu_sync, do_expand, stats, x)
        num_experts, num_max_tokens, alignment = (
            handle.num_experts,
            handle.num_max_tokens_per_rank,
            handle.expert_alignment,
        )
        if topk_weights is not None:
            v.check_topk_weights("topk_weights", topk_weights, tuple(handle.topk_idx.shape), device)
        cpu_sync = False
    else:
        if num_experts is None:
            raise ValueError("num_experts is required without a handle")
        v.check_num_experts(num_experts, buf.num_ranks)
        num_max_tokens = buf.num_max_tokens_per_rank if num_max_tokens is None else num_max_tokens
        check_int("num_max_tokens_per_rank", num_max_tokens, 1)
        if x.size(0) > num_max_tokens:
            raise ValueError(f"x has {x.size(0)} tokens; num_max_tokens_per_rank={num_max_tokens} is the limit")
        alignment = 1 if alignment is None else alignment
        check_int("expert_alignment", alignment, 1)
        if topk_idx is None:
            raise ValueError("topk_idx is required without a handle")
        cpu_sync = True if do_cpu_sync is None else bool(do_cpu_sync)
        _check_topk(topk_idx, topk_weights, num_experts, x.size(0), device, cpu_sync)
        if stats is not None:
            v.check_tensor(
                "cumulative_local_expert_recv_stats",
                stats,
                dtypes=(torch.int32,),
                shape=(("num_local_experts", num_experts // buf.num_ranks),),
                device=device,
            )
    return DispatchArgs(
        x,
        sf,
        topk_idx,
        topk_weights,
        stats,
        num_experts,
        num_max_tokens,
        alignment,
        num_sms or buf.get_theoretical_num_sms(num_experts, MAX_TOPK),
        cpu_sync,
        bool(do_expand),
        bool(do_zero_padding),
    )


def combine_args(
    buf: Any,
    x: Any,
    handle: Any,
    topk_weights: Optional[Tensor],
    bias: Any,
    num_sms: int,
    num_qps: int,
    previous_event: Any,
    allocate_on_comm_stream: bool,
) -> Tuple[Tensor, ...]:
    """A combine's arguments, checked; returns the biases (0 to 2 tensors)."""
    device = _device(buf)
    check_events(previous_event, allocate_on_comm_stream)
    check_int("num_sms", num_sms, 0)
    check_int("num_qps", num_qps, 0, buf.num_allocated_qps)
    if not isinstance(handle, EPHandle) or handle.route is None:
        raise TypeError(f"handle must be an EPHandle from this ElasticBuffer's dispatch, got {type(handle).__name__}")
    route = handle.route
    rows = route.layout.num_expanded_rows if handle.do_expand else route.layout.num_rows
    label = "num_expanded_tokens" if handle.do_expand else "num_recv_tokens"
    v.check_tensor("x", x, dtypes=(torch.bfloat16,), shape=((label, rows), ("hidden", None)), device=device)
    if x.size(1) * 2 % v.ROW_ALIGN_BYTES:
        raise ValueError(f"x rows are {x.size(1) * 2} bytes (hidden={x.size(1)}); they must be a multiple of 16")
    if topk_weights is not None:
        if handle.do_expand and not buf.allow_multiple_reduction:
            raise ValueError(
                "topk_weights must be None for an expanded combine with allow_multiple_reduction=False (each "
                "expanded row travels alone; DeepEP V2 has no weights there either)"
            )
        shape = ((label, rows),) if handle.do_expand else ((label, rows), ("num_topk", route.num_topk))
        v.check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), shape=shape, device=device)
    return v.check_bias(bias, route.slot_rank.size(0), x.size(1), torch.bfloat16, device)
