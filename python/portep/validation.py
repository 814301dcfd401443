"""Argument checks of the DeepEP-compatible API. Every error names the argument, the value and the limit, and is
raised before the engine is called, so a bad call leaves the Buffer usable (docs/design.md §7, Errors and
failures).

Wrong Python or torch types raise TypeError; wrong shapes, values, layouts, devices and argument
combinations raise ValueError.
"""

import functools
import inspect
from typing import Any, Callable, Optional, Sequence, Tuple, Union

import torch

from .deepep_config import Config, check_int
from .event import EventOverlap
from .handles import handle_length, normal_handle

MAX_TOPK = 32
DEEPEP_LL_MAX_TOPK = 11
MAX_LOCAL_EXPERTS = 1024
ROW_ALIGN_BYTES = 16
LL_HANDLE_LEN = 5
CPU = "cpu"
Tensor = torch.Tensor
# A tensor's expected shape: per dimension None (any size), an int, or (label, int or None) for the message.
Shape = Sequence[Union[None, int, Tuple[str, Optional[int]]]]


# ---- generic tensors ----
def _format_dim(dim):
    if dim is None:
        return "*"
    if isinstance(dim, tuple):
        label, value = dim
        return label if value is None else f"{label}={value}"
    return str(dim)


def _check_shape(name, tensor, shape):
    """shape: entries None (any), an int, or (label, int or None). The message is built only on failure (this
    runs on every call)."""
    actual_shape = tensor.shape
    ok = len(actual_shape) == len(shape)
    if ok:
        for actual, dim in zip(actual_shape, shape):
            want = dim[1] if isinstance(dim, tuple) else dim
            if want is not None and actual != want:
                ok = False
                break
    if not ok:
        expected = "[" + ", ".join(_format_dim(d) for d in shape) + "]"
        rank_note = f"{len(shape)}-D " if len(actual_shape) != len(shape) else ""
        raise ValueError(f"{name} has shape {list(actual_shape)}; it must be {rank_note}{expected}")


def check_tensor(
    name: str,
    tensor: Any,
    *,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    shape: Optional[Shape] = None,
    contiguous: bool = True,
    device: Optional[str] = CPU,
) -> Tensor:
    """tensor, checked: a torch.Tensor of one of dtypes, of shape, contiguous if asked, on device's type (None:
    any device); raises TypeError or ValueError naming `name`."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if dtypes is not None and tensor.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {tensor.dtype}; it must be {' or '.join(str(d) for d in dtypes)}")
    if shape is not None:
        _check_shape(name, tensor, shape)
    if contiguous and not tensor.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous; it has shape {list(tensor.shape)} and strides {list(tensor.stride())}"
        )
    if device is not None and tensor.device.type != device:
        raise ValueError(f"{name} is on {tensor.device}; this backend needs {device} tensors")
    return tensor


def check_optional_tensor(name: str, tensor: Optional[Tensor], **kwargs: Any) -> Optional[Tensor]:
    """None, or tensor checked as check_tensor does."""
    return None if tensor is None else check_tensor(name, tensor, **kwargs)


# ---- argument combinations ----
def check_event_args(previous_event: Optional[EventOverlap], async_finish: bool, allocate_on_comm_stream: bool) -> None:
    """DeepEP's stream arguments: allocate_on_comm_stream needs previous_event and async_finish."""
    if previous_event is not None and not isinstance(previous_event, EventOverlap):
        raise TypeError(f"previous_event must be an EventOverlap or None, got {type(previous_event).__name__}")
    if allocate_on_comm_stream and (previous_event is None or not async_finish):
        raise ValueError(
            f"allocate_on_comm_stream=True requires previous_event (got "
            f"{'None' if previous_event is None else 'an EventOverlap'}) and async_finish=True "
            f"(got {async_finish!r})"
        )


def check_ll_flags(async_finish: bool, return_recv_hook: bool) -> None:
    """A low-latency call takes async_finish or return_recv_hook, not both."""
    if async_finish and return_recv_hook:
        raise ValueError("async_finish=True and return_recv_hook=True are mutually exclusive in low-latency operations")


def check_ll_logfmt(use_logfmt: bool, zero_copy: bool, hidden: int) -> None:
    """LogFMT combine casts rows as it sends them, so not with zero_copy (as DeepEP refuses it), and its rows carry the
    call's sequence number in two sign bits per 128 channels, so hidden >= 2048, and at most 32 chunks of 1024 (or
    512) channels (gpu_kernels/logfmt.h)."""
    if not use_logfmt:
        return
    if zero_copy:
        raise ValueError(
            "use_logfmt=True cannot be combined with zero_copy=True: LogFMT casts the rows as it sends them"
        )
    from ._native import require_native

    layout = require_native().logfmt_layout(int(hidden))
    if not layout["ok"]:
        raise ValueError(
            f"use_logfmt=True needs hidden to be a multiple of 512, at least {layout['min_hidden']} and at most "
            f"{layout['max_hidden']} ({layout['max_chunks']} chunks of {layout['chunk']} channels); got hidden={hidden}"
        )


def check_fp8_flags(use_fp8: bool, round_scale: bool, use_ue8m0: bool) -> None:
    """use_ue8m0 needs round_scale, which needs use_fp8."""
    if use_ue8m0 and not round_scale:
        raise ValueError("use_ue8m0=True requires round_scale=True (got round_scale=False)")
    if round_scale and not use_fp8:
        raise ValueError("round_scale=True requires use_fp8=True (got use_fp8=False)")


def check_config(config: Any) -> Config:
    """config, checked: a Config with an even num_sms >= 2."""
    if not isinstance(config, Config):
        raise TypeError(f"config must be a portep Config (deep_ep.Config), got {type(config).__name__}")
    if config.num_sms < 2 or config.num_sms % 2:
        raise ValueError(f"config.num_sms={config.num_sms} must be even and >= 2 (one channel is 2 SMs)")
    return config


def check_num_experts(num_experts: int, num_ranks: int, max_local_experts: int = MAX_LOCAL_EXPERTS) -> int:
    """num_experts, checked: a multiple of num_ranks with at most max_local_experts per rank."""
    check_int("num_experts", num_experts, 1)
    if num_experts % num_ranks:
        raise ValueError(f"num_experts={num_experts} must be a multiple of the number of ranks {num_ranks}")
    if num_experts // num_ranks > max_local_experts:
        raise ValueError(
            f"num_experts={num_experts} gives {num_experts // num_ranks} experts per rank; "
            f"the limit is {max_local_experts}"
        )
    return num_experts


# ---- routing ----
def check_topk_idx(
    name: str,
    topk_idx: Any,
    num_experts: int,
    *,
    num_tokens: Optional[int] = None,
    max_topk: int = MAX_TOPK,
    limit_note: str = "",
    device: Optional[str] = CPU,
) -> Tensor:
    """topk_idx_t (int64) [num_tokens, num_topk], entries in [-1, num_experts)."""
    check_tensor(
        name, topk_idx, dtypes=(torch.int64,), shape=(("num_tokens", num_tokens), ("num_topk", None)), device=device
    )
    num_topk = topk_idx.size(1)
    if not 1 <= num_topk <= max_topk:
        raise ValueError(f"{name} has num_topk={num_topk} columns; it must be in 1..{max_topk}{limit_note}")
    # Values are checked on the CPU only: reading a GPU tensor would synchronize the stream (and break CUDA-graph
    # capture); the CUDA kernels treat entries outside [0, num_experts) as -1 and report them (see cuda_backend).
    if topk_idx.numel() and topk_idx.device.type == "cpu":
        low, high = int(topk_idx.min()), int(topk_idx.max())
        if low < -1 or high >= num_experts:
            bad = low if low < -1 else high
            raise ValueError(
                f"{name} holds expert index {bad}; entries must be in [-1, {num_experts}) "
                f"(num_experts={num_experts}, -1 = no expert)"
            )
    return topk_idx


def check_topk_weights(
    name: str, topk_weights: Any, topk_shape: Tuple[int, int], device: Optional[str] = CPU
) -> Tensor:
    """float32 [num_tokens, num_topk], the shape of topk_idx."""
    rows, cols = topk_shape
    return check_tensor(
        name, topk_weights, dtypes=(torch.float32,), shape=(("num_tokens", rows), ("num_topk", cols)), device=device
    )


def check_topk_pair(topk_idx: Optional[Tensor], topk_weights: Optional[Tensor]) -> None:
    """topk_idx and topk_weights are given together or not at all."""
    if (topk_idx is None) != (topk_weights is None):
        given, missing = ("topk_idx", "topk_weights") if topk_weights is None else ("topk_weights", "topk_idx")
        raise ValueError(f"{given} and topk_weights/topk_idx go together: {given} was given, {missing} is None")


# ---- normal (high-throughput) mode ----
def check_dispatch_x(
    x: Union[Tensor, Tuple[Tensor, Tensor]], device: Optional[str] = CPU
) -> Tuple[Tensor, Optional[Tensor]]:
    """x: a tensor [num_tokens, hidden] of 1- or 2-byte elements, or (fp8 x, scales [num_tokens, S])."""
    scales = None
    if isinstance(x, tuple):
        if len(x) != 2:
            raise ValueError(f"x as a tuple must be (x, x_scales), got {len(x)} elements")
        x, scales = x
    elif not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor or an (x, x_scales) tuple, got {type(x).__name__}")
    check_tensor("x", x, shape=(("num_tokens", None), ("hidden", None)), device=device)
    if x.element_size() not in (1, 2):
        raise TypeError(
            f"x has dtype {x.dtype} ({x.element_size()} bytes per element); dispatch moves 1-byte "
            f"(float8_e4m3fn) or 2-byte (bfloat16) elements"
        )
    row_bytes = x.size(1) * x.element_size()
    if row_bytes % ROW_ALIGN_BYTES:
        raise ValueError(
            f"x rows are {row_bytes} bytes (hidden={x.size(1)} x {x.element_size()}); they must be "
            f"a multiple of {ROW_ALIGN_BYTES} bytes"
        )
    if scales is not None:
        _check_scales(x, scales, device)
    return x, scales


def _check_scales(x, scales, device):
    if x.element_size() != 1:
        raise TypeError(f"x with scales must have 1-byte elements (float8_e4m3fn), got {x.dtype}")
    check_tensor(
        "x_scales",
        scales,
        dtypes=(torch.float32, torch.int32),
        shape=(("num_tokens", x.size(0)), ("num_scales", None)),
        contiguous=False,
        device=device,
    )


def check_layout_tensors(
    num_tokens_per_rank: Optional[Tensor],
    num_tokens_per_rdma_rank: Optional[Tensor],
    is_token_in_rank: Optional[Tensor],
    num_tokens_per_expert: Optional[Tensor],
    num_tokens: int,
    num_ranks: int,
    num_nodes: int,
    device: Optional[str] = CPU,
) -> int:
    """The non-cached dispatch inputs from get_dispatch_layout; returns num_experts."""
    required = {
        "num_tokens_per_rank": num_tokens_per_rank,
        "is_token_in_rank": is_token_in_rank,
        "num_tokens_per_expert": num_tokens_per_expert,
    }
    if num_nodes > 1:
        required["num_tokens_per_rdma_rank"] = num_tokens_per_rdma_rank
    missing = [name for name, value in required.items() if value is None]
    if missing:
        raise ValueError(f"dispatch without a handle needs {', '.join(missing)} (from get_dispatch_layout)")
    int32 = (torch.int32,)
    check_tensor(
        "num_tokens_per_rank", num_tokens_per_rank, dtypes=int32, shape=(("num_ranks", num_ranks),), device=device
    )
    if num_nodes > 1:
        check_tensor(
            "num_tokens_per_rdma_rank",
            num_tokens_per_rdma_rank,
            dtypes=int32,
            shape=(("num_nodes", num_nodes),),
            device=device,
        )
    check_tensor(
        "is_token_in_rank",
        is_token_in_rank,
        dtypes=(torch.bool,),
        shape=(("num_tokens", num_tokens), ("num_ranks", num_ranks)),
        device=device,
    )
    check_tensor(
        "num_tokens_per_expert", num_tokens_per_expert, dtypes=int32, shape=(("num_experts", None),), device=device
    )
    return check_num_experts(num_tokens_per_expert.size(0), num_ranks)


def check_normal_handle(handle: Any, num_ranks: int, num_nodes: int) -> Tuple[Any, int, int, int]:
    """A dispatch handle of this Buffer; returns (the typed handle, num_tokens, num_recv_tokens, num_channels)."""
    expected = handle_length(num_nodes > 1)
    if not isinstance(handle, (tuple, list)):
        raise TypeError(f"handle must be the tuple returned by dispatch, got {type(handle).__name__}")
    if len(handle) != expected:
        raise ValueError(
            f"handle has {len(handle)} elements; a dispatch handle of this Buffer has {expected} "
            f"({'one node' if num_nodes == 1 else f'{num_nodes} nodes'})"
        )
    for i, item in enumerate(handle):
        if not isinstance(item, torch.Tensor):
            raise TypeError(f"handle[{i}] must be a torch.Tensor, got {type(item).__name__}")
    handle = normal_handle(handle, num_nodes > 1)
    is_token_in_rank, channel_matrix = handle.is_token_in_rank, handle.send_channel_prefix
    check_tensor(
        "handle's is_token_in_rank",
        is_token_in_rank,
        dtypes=(torch.bool,),
        shape=(("num_tokens", None), ("num_ranks", num_ranks)),
        contiguous=False,
        device=None,
    )
    check_tensor(
        "handle's channel prefix matrix",
        channel_matrix,
        shape=(("num_ranks", num_ranks), ("num_channels", None)),
        contiguous=False,
        device=None,
    )
    return handle, is_token_in_rank.size(0), handle.num_recv_tokens, channel_matrix.size(1)


def check_handle_channels(handle_channels: int, config: Config, what: str) -> None:
    """The config's channels (num_sms / 2) are the ones the handle was made with."""
    if handle_channels != config.num_sms // 2:
        raise ValueError(
            f"{what}: config.num_sms={config.num_sms} gives {config.num_sms // 2} channels but the "
            f"handle was made with {handle_channels} (num_sms={2 * handle_channels})"
        )


def check_bias(
    bias: Any, num_tokens: int, hidden: int, dtype: torch.dtype, device: Optional[str] = CPU
) -> Tuple[Tensor, ...]:
    """None, a tensor, or a 2-tuple of tensors/None, each [num_tokens, hidden] of x's dtype; returns a tuple."""
    if bias is None:
        return ()
    if isinstance(bias, torch.Tensor):
        items = (bias,)
    elif isinstance(bias, tuple):
        if len(bias) != 2:
            raise ValueError(f"bias as a tuple must have 2 elements (bias_0, bias_1), got {len(bias)}")
        items = bias
    else:
        raise TypeError(f"bias must be a tensor, a 2-tuple of tensors, or None, got {type(bias).__name__}")
    shape = (("num_tokens", num_tokens), ("hidden", hidden))
    names = ("bias",) if len(items) == 1 else ("bias[0]", "bias[1]")
    return tuple(
        check_tensor(name, item, dtypes=(dtype,), shape=shape, device=device)
        for name, item in zip(names, items)
        if item is not None
    )


# ---- low-latency mode ----
def check_ll_hidden(hidden: int, use_ue8m0: bool = False) -> None:
    """hidden is a multiple of 512 in low-latency mode."""
    if hidden % 512:
        raise ValueError(
            f"hidden={hidden} must be a multiple of 512 in low-latency mode (DeepEP supports 2048..8192 "
            f"in steps of 512; the per-row layout of the combine buffer needs 16-byte rows)"
        )


def check_ll_x(x: Any, num_max_dispatch_tokens_per_rank: int, use_ue8m0: bool, device: Optional[str] = CPU) -> Tensor:
    """x of a low-latency dispatch: bfloat16 [num_tokens, hidden], at most num_max_dispatch_tokens_per_rank tokens."""
    check_tensor("x", x, dtypes=(torch.bfloat16,), shape=(("num_tokens", None), ("hidden", None)), device=device)
    check_ll_num_tokens("x", x.size(0), num_max_dispatch_tokens_per_rank)
    check_ll_hidden(x.size(1), use_ue8m0)
    return x


def check_ll_num_tokens(name: str, num_tokens: int, num_max_dispatch_tokens_per_rank: int) -> None:
    """num_tokens <= num_max_dispatch_tokens_per_rank."""
    if num_tokens > num_max_dispatch_tokens_per_rank:
        raise ValueError(
            f"{name} has {num_tokens} tokens; the limit is num_max_dispatch_tokens_per_rank="
            f"{num_max_dispatch_tokens_per_rank}"
        )


def check_stats(
    name: str, stats: Optional[Tensor], length: int, dtype: torch.dtype, label: str, device: Optional[str] = CPU
) -> Optional[Tensor]:
    """None, or a statistics tensor [length] of dtype."""
    return check_optional_tensor(name, stats, dtypes=(dtype,), shape=((label, length),), device=device)


def check_ll_handle(handle: Any, num_ranks: int) -> Tuple[int, int, int]:
    """(src_info [E_l, R*T] int32, layout_range [E_l, R] int64, T, hidden, num_experts); returns T, hidden, E."""
    if not isinstance(handle, (tuple, list)):
        raise TypeError(f"handle must be the tuple returned by low_latency_dispatch, got {type(handle).__name__}")
    if len(handle) != LL_HANDLE_LEN:
        raise ValueError(f"handle has {len(handle)} elements; a low-latency handle has {LL_HANDLE_LEN}")
    src_info, layout_range, tokens, hidden, num_experts = handle
    check_int("handle's num_max_dispatch_tokens_per_rank", tokens, 1)
    check_int("handle's hidden", hidden, 1)
    check_num_experts(num_experts, num_ranks)
    num_local = num_experts // num_ranks
    check_tensor(
        "handle's src_info",
        src_info,
        dtypes=(torch.int32,),
        shape=(("num_local_experts", num_local), ("num_ranks*T", num_ranks * tokens)),
        device=None,
    )
    check_tensor(
        "handle's layout_range",
        layout_range,
        dtypes=(torch.int64,),
        shape=(("num_local_experts", num_local), ("num_ranks", num_ranks)),
        device=None,
    )
    return tokens, hidden, num_experts


def check_ll_combine_x(
    x: Any, num_ranks: int, tokens: int, hidden: int, num_experts: int, device: Optional[str] = CPU
) -> Tensor:
    """x of a low-latency combine: bfloat16 [num_local_experts, num_ranks * T, hidden]."""
    shape = (("num_local_experts", num_experts // num_ranks), ("num_ranks*T", num_ranks * tokens), ("hidden", hidden))
    return check_tensor("x", x, dtypes=(torch.bfloat16,), shape=shape, device=device)


def check_ll_out(out: Optional[Tensor], num_tokens: int, hidden: int, device: Optional[str] = CPU) -> Optional[Tensor]:
    """None, or the combine's output: bfloat16 [num_tokens, hidden]."""
    return check_optional_tensor(
        "out",
        out,
        dtypes=(torch.bfloat16,),
        shape=(("num_combined_tokens", num_tokens), ("hidden", hidden)),
        device=device,
    )


# ---- keyword arguments of DeepEP branches portep does not serve ----
# name -> what it is there, and what portep offers instead (../shared/reference/deepep-api.md §7.1, deepep-clients.md)
BRANCH_ONLY_KEYWORDS = {
    "use_nvfp4": "NVFP4 low-latency dispatch (DeepEP's hybrid-ep branch and Blackwell builds); portep dispatches BF16 "
    "or FP8 (use_fp8, round_scale, use_ue8m0)",
    "x_global_scale": "NVFP4's global scale (DeepEP's Blackwell builds); portep dispatches BF16 or FP8 (use_fp8, "
    "round_scale, use_ue8m0)",
    "use_ue8m0_for_sf": "NVFP4 scale factors as UE8M0 (DeepEP's hybrid-ep branch); portep's FP8 dispatch takes "
    "use_ue8m0",
    "allow_nvlink_for_normal_mode": "the hybrid-ep branch's normal-mode kernels over PCIe; portep reaches every peer "
    "without NVLink through its proxies, with no argument",
}


def refuse_branch_keywords(method: Callable) -> Callable:
    """method, refusing the keyword arguments of BRANCH_ONLY_KEYWORDS that it does not take with a TypeError (what
    Python raises for any unknown keyword, and what clients catch to retry without it) that names each one and says
    what portep serves instead; any other call goes to method unchanged. inspect.signature still reports method's."""
    params = inspect.signature(method).parameters

    @functools.wraps(method)
    def checked(*args: Any, **kwargs: Any) -> Any:
        branch = [k for k in kwargs if k in BRANCH_ONLY_KEYWORDS and k not in params]
        if branch:
            said = "; ".join(f"{k}: {BRANCH_ONLY_KEYWORDS[k]}" for k in branch)
            raise TypeError(f"{method.__name__}() got keyword arguments that portep does not serve: {said}")
        return method(*args, **kwargs)

    return checked
