"""`portep.Buffer`: DeepEP V1's `deep_ep.Buffer` API (same signatures, defaults, returns and argument rules)
over portep's engines. This layer checks every argument (see validation.py) and calls the engine.

Host backend: tensors live on the CPU and every operation has finished when it returns, so there are no
streams; `async_finish=True` returns an EventOverlap whose event is already complete, and
`get_comm_stream()` returns None.
"""

import contextlib
import functools
import os
import warnings
from typing import Callable, Optional, Sequence, Tuple, Union

import torch

from . import validation as v
from .bootstrap import group_rank_and_size, is_mpi_comm
from .config import timeout_from_env, transport_from_env
from .deepep_config import (
    COMBINE_CONFIGS,
    DISPATCH_CONFIGS,
    Config,
    check_int,
    check_internode_config,
    combine_config,
    default_config,
    dispatch_config,
    low_latency_rdma_size_hint,
)
from .errors import DroppedInput
from .event import EventOverlap, HostEvent
from .handles import ll_handle
from .lockstep import AgreedRefusal, OutOfStep

__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t"]

topk_idx_t = torch.int64

BACKENDS = ("host", "cuda")
PLANNED_BACKENDS = ("hip",)
DEFAULT_RANKS_PER_NODE = 8
LL_TOPK_NOTE = f" (portep's limit; DeepEP's low-latency kernels allow at most {v.DEEPEP_LL_MAX_TOPK})"

Tensor = torch.Tensor
# x of a dispatch: BF16 [num_tokens, hidden], or FP8 (float8_e4m3fn [num_tokens, hidden], float32 scales
# [num_tokens, hidden // 128])
DispatchX = Union[Tensor, Tuple[Tensor, Tensor]]
# a normal-mode handle as DeepEP's: 6 tensors on one node, 10 across nodes (docs/api.md)
NormalHandle = tuple


def _host_factories(device):
    """The host backend makes its tensors on the CPU whatever torch's default device is (DeepEP's tests set it to
    CUDA, and tensor factories without device= follow it)."""
    if device == "cpu" and torch.get_default_device().type != "cpu":
        return torch.device("cpu")
    return contextlib.nullcontext()


def _collective(what):
    """A Buffer method that every rank calls together (lockstep.py): its body calls self._call.start() once its
    inputs passed validation, right before the call's first traffic."""

    def wrap(method):
        @functools.wraps(method)
        def run(self, *args, **kwargs):
            call = _Collective(self, self._engine(), what, self._device)
            with call, _host_factories(self._device):
                self._call = call
                try:
                    return method(self, *args, **kwargs)
                finally:
                    self._call = None

        return run

    return wrap


class Buffer:
    """The expert-parallel communication buffers of one rank: normal (high-throughput) dispatch/combine and
    low-latency dispatch/combine, with DeepEP V1's API. Construction is collective over `group`.

    DeepEP arguments: as `deep_ep.Buffer`. `num_nvl_bytes + num_rdma_bytes` is the engine's communication
    memory (multiples of 128 each). `allow_nvlink_for_low_latency_mode` lets LL traffic to same-node peers
    bypass the proxies. `num_qps_per_rank`, `allow_mnnvl` and `use_fabric` have no effect on the host backend.
    `comm`: an mpi4py communicator (`mpi4py.MPI.Comm`), used where `group` is None (construction then needs no
    torch.distributed). `enable_shrink=True` masks ranks that stop answering in low-latency calls, as DeepEP's
    shrink mode (the three mask functions below).

    portep keyword-only arguments:
        num_ranks_per_node: ranks that form one "node" (default: $PORTEP_RANKS_PER_NODE, else min(8, group size)).
        transport: "shm", "shm-unordered", "verbs", "verbs-striped" or "nccl-emulated" (portep.Channel describes
            them; default: $PORTEP_TRANSPORT or "shm").
        timeout_s: every wait raises after this long (default: $PORTEP_TIMEOUT_S or 100 s).
        backend: "cuda" (GPU tensors; normal and low-latency modes) or "host" (CPU tensors). Default:
            $PORTEP_BACKEND, else "cuda" when the CUDA kernels are built and a GPU is visible, else "host".
    """

    num_sms = 20

    @v.refuse_branch_keywords
    def __init__(
        self,
        group: Optional["torch.distributed.ProcessGroup"],
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        use_fabric: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm: Optional[object] = None,
        *,
        num_ranks_per_node: Optional[int] = None,
        transport: Optional[str] = None,
        timeout_s: Optional[float] = None,
        backend: Optional[str] = None,
    ) -> None:
        self.runtime = None
        self.explicitly_destroy = bool(explicitly_destroy)
        if group is None:
            if comm is None:
                raise ValueError("Either 'group' or 'comm' must be provided.")
            if not is_mpi_comm(comm):
                raise TypeError(
                    f"comm must be an mpi4py communicator (with Get_rank, Get_size and allgather), got "
                    f"{type(comm).__name__}"
                )
            group = comm  # as DeepEP: the group when both are given, else the communicator
        _check_buffer_bytes("num_nvl_bytes", num_nvl_bytes)
        _check_buffer_bytes("num_rdma_bytes", num_rdma_bytes)
        check_int("num_qps_per_rank", num_qps_per_rank, 1 if low_latency_mode else 0)
        self.backend = select_backend(backend)
        transport_from_env(transport)
        timeout_from_env(timeout_s)
        self.rank, self.group_size = group_rank_and_size(group, "a Buffer")
        per_node = ranks_per_node(num_ranks_per_node, self.group_size)

        self.group = group
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = bool(low_latency_mode)
        self.enable_shrink = bool(enable_shrink)
        self._device = "cuda" if self.backend == "cuda" else "cpu"

        fast_module, self.ll_fast_path_off = None, "not a low-latency Buffer on the CUDA backend"
        if self.backend == "cuda":
            from .backends.cuda.engine import CudaEngine as Engine

            if self.low_latency_mode and torch.cuda.is_available():
                # before the collective construction: where the module is compiled at first use (ll_jit.py), this
                # rank is late here, where its peers wait in the bootstrap's collectives, not in a timed LL kernel
                from ._native import require_native
                from .backends.cuda.ll_fast import fast_path_module

                fast_module, self.ll_fast_path_off = fast_path_module(require_native())
        else:
            from .backends.host.engine import HostEngine as Engine
        # CUDA, both modes, both sizes: the normal mode keeps to num_nvl_bytes and LL to num_rdma_bytes, as
        # DeepEP's NVL and RDMA buffers, so switching modes needs no clean_low_latency_buffer in between
        split = self.backend == "cuda" and self.low_latency_mode and num_nvl_bytes > 0 and num_rdma_bytes > 0
        with _host_factories(self._device):
            self.runtime = Engine(
                group,
                num_nvl_bytes + num_rdma_bytes,
                per_node,
                transport=transport,
                timeout_s=timeout_s,
                allow_direct_ll=bool(allow_nvlink_for_low_latency_mode),
                shrink=self.enable_shrink,
                **({"normal_bytes": num_nvl_bytes} if split else {}),
            )
        self._comm = self._ll_fast = None
        if self.backend == "cuda":
            from .backends.cuda.comm_stream import CommStream

            self._comm = CommStream(self.runtime)
            if fast_module is not None and self.enable_shrink:
                self.ll_fast_path_off = "enable_shrink=True: shrink-mode calls take the full path"
            elif fast_module is not None:
                self._install_ll_fast_path(fast_module)

    def _install_ll_fast_path(self, module):
        """This Buffer's low_latency_dispatch / low_latency_combine become portep._ll_torch's native entries
        (instance attributes over the methods below, so a call reaches native code without a Python frame); they
        hand every call they do not take to those methods (backends/cuda/ll_fast.py). Not where a subclass overrides
        them: its methods would be skipped."""
        from .backends.cuda.ll_fast import fast_calls

        cls = type(self)
        if (
            cls.low_latency_dispatch is not Buffer.low_latency_dispatch
            or cls.low_latency_combine is not Buffer.low_latency_combine
        ):
            self.ll_fast_path_off = f"{cls.__name__} overrides Buffer's low-latency methods"
            return
        self._ll_fast = fast_calls(module, self.runtime, self, Buffer.low_latency_dispatch, Buffer.low_latency_combine)
        self.low_latency_dispatch, self.low_latency_combine = self._ll_fast.dispatch, self._ll_fast.combine

    # ---- lifetime ----
    def destroy(self) -> None:
        """Release the engine (requires explicitly_destroy=True, as in DeepEP). Calling it again does nothing."""
        if not self.explicitly_destroy:
            raise RuntimeError(
                "`explicitly_destroy` flag must be set: create the Buffer with "
                "explicitly_destroy=True to call destroy(); otherwise it is released on deletion"
            )
        runtime, self.runtime, self._ll_fast = self.runtime, None, None
        for entry in ("low_latency_dispatch", "low_latency_combine"):  # the fast path's, where installed
            vars(self).pop(entry, None)
        if runtime is not None:
            with _host_factories(self._device):
                runtime.destroy()

    def __del__(self):
        runtime = getattr(self, "runtime", None)
        if runtime is None:
            return
        if getattr(self, "explicitly_destroy", False):
            # RuntimeWarning, not ResourceWarning: Python hides the latter by default, and DeepEP prints this
            warnings.warn(
                "destroy() was not called before a portep Buffer created with explicitly_destroy=True was "
                "deleted: its communication memory and proxy threads stay until the interpreter exits",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        try:
            runtime.destroy()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass

    def _engine(self):
        if self.runtime is None:
            raise RuntimeError("this Buffer was destroyed")
        return self.runtime

    def _ll_engine(self):
        engine = self._engine()
        if not self.low_latency_mode:
            raise RuntimeError("low-latency operations need a Buffer created with low_latency_mode=True")
        return engine

    def _normal_op(self, fn, previous_event, async_finish, allocate_on_comm_stream, inputs):
        """fn()'s result and its EventOverlap; on the CUDA backend with DeepEP's stream rules
        (backends/cuda/comm_stream.py)."""
        if self._device != "cuda":
            return fn(), self._event(async_finish)
        return self._comm.run(fn, previous_event, async_finish, allocate_on_comm_stream, inputs)

    def _event(self, async_finish, extra_tensors=None):
        if not async_finish:
            return EventOverlap(None)
        if self._device == "cuda":
            from .backends.cuda.engine import CudaEvent

            return EventOverlap(CudaEvent(), extra_tensors)
        return EventOverlap(HostEvent(), extra_tensors)

    # ---- class and static methods ----
    @staticmethod
    def is_sm90_compiled() -> bool:
        """True when portep's CUDA kernels were built."""
        from ._native import native

        return bool(native is not None and native.build_info().get("cuda_built", False))

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the SM count that get_dispatch_config / get_combine_config put in their configs (even, > 0)."""
        check_int("new_num_sms", new_num_sms)
        if new_num_sms <= 0 or new_num_sms % 2:
            raise ValueError(f"new_num_sms={new_num_sms} must be even and > 0 (one channel is 2 SMs)")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream (without a GPU: an already complete one)."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            from .backends.cuda.engine import CudaEvent

            return EventOverlap(CudaEvent())
        return EventOverlap(HostEvent())

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """DeepEP's minimum RDMA buffer size in bytes for low-latency mode (BF16 sizing)."""
        return low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP's tuned dispatch config for 2..160 ranks; whole nodes of 8 above 160 take its 160-rank entry
        (ValueError for other sizes)."""
        return dispatch_config(num_ranks, Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP's tuned combine config for 2..160 ranks; whole nodes of 8 above 160 take its 160-rank entry
        (ValueError for other sizes)."""
        return combine_config(num_ranks, Buffer.num_sms)

    def get_comm_stream(self) -> Optional[torch.cuda.Stream]:
        """The communication stream of the normal-mode operations on the CUDA backend (the low-latency ones run
        on the current stream); None on the host backend, which has no streams."""
        self._engine()
        return self._comm.stream if self._comm is not None else None

    def get_local_buffer_tensor(
        self, dtype: torch.dtype, size: Optional[Sequence[int]] = None, offset: int = 0, use_rdma_buffer: bool = False
    ) -> Tensor:
        """A view of this rank's NVL (or RDMA) buffer as `dtype`, of shape `size` (default: the whole buffer, 1-D);
        `offset` is in bytes (as DeepEP's C++)."""
        engine = self._engine()
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        check_int("offset", offset, 0)
        num_bytes = self.num_rdma_bytes if use_rdma_buffer else self.num_nvl_bytes
        which = "num_rdma_bytes" if use_rdma_buffer else "num_nvl_bytes"
        need = offset
        if size is not None:
            size = torch.Size(size)
            need += size.numel() * dtype.itemsize
        if need > num_bytes:
            raise ValueError(
                f"offset={offset} and size={None if size is None else list(size)} of {dtype} need "
                f"{need} bytes; the buffer has {which}={num_bytes}"
            )
        if size is None:  # DeepEP's length: the chosen buffer's bytes (from the offset on) as dtype, 1-D
            size = torch.Size([(num_bytes - offset) // dtype.itemsize])
        return engine.get_local_buffer_tensor(dtype, size, offset, bool(use_rdma_buffer))

    # ---- normal (high-throughput) mode ----
    def get_dispatch_layout(
        self,
        topk_idx: Tensor,
        num_experts: int,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor], Tensor, Tensor, EventOverlap]:
        """Where each token goes, from its top-k experts.

        Arguments:
            topk_idx: [num_tokens, num_topk], topk_idx_t (int64): the experts of each token, -1 for none.
            num_experts: experts in all (a multiple of the group size).
            previous_event, async_finish, allocate_on_comm_stream: DeepEP's stream rules (docs/api.md).

        Returns:
            num_tokens_per_rank: [num_ranks] int32, tokens sent to each rank.
            num_tokens_per_rdma_rank: [num_nodes] int32, tokens sent to each node; None on one node.
            num_tokens_per_expert: [num_experts] int32, selections of each expert.
            is_token_in_rank: [num_tokens, num_ranks] bool.
            event: an EventOverlap (complete unless async_finish).
        """
        engine = self._engine()
        v.check_event_args(previous_event, async_finish, allocate_on_comm_stream)
        v.check_num_experts(num_experts, self.group_size)
        v.check_topk_idx("topk_idx", topk_idx, num_experts, device=self._device)
        with _host_factories(self._device):
            out, event = self._normal_op(
                lambda: engine.get_dispatch_layout(topk_idx, num_experts),
                previous_event,
                async_finish,
                allocate_on_comm_stream,
                (topk_idx,),
            )
        return _returned(engine, tuple(out) + (event,))

    @_collective("dispatch")
    def dispatch(
        self,
        x: DispatchX,
        handle: Optional[NormalHandle] = None,
        num_tokens_per_rank: Optional[Tensor] = None,
        num_tokens_per_rdma_rank: Optional[Tensor] = None,
        is_token_in_rank: Optional[Tensor] = None,
        num_tokens_per_expert: Optional[Tensor] = None,
        topk_idx: Optional[Tensor] = None,
        topk_weights: Optional[Tensor] = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Optional[Config] = None,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> Tuple[DispatchX, Optional[Tensor], Optional[Tensor], Optional[list], Optional[NormalHandle], EventOverlap]:
        """Send each token once to every rank that holds one of its experts (normal mode).

        Arguments:
            x: BF16 [num_tokens, hidden], or FP8 (float8_e4m3fn [num_tokens, hidden], float32 scales
                [num_tokens, hidden // 128]); rows a multiple of 16 bytes.
            handle: a handle from an earlier dispatch of the same routing (cached mode: no count exchange, no
                top-k).
            num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank: from
                get_dispatch_layout (num_tokens_per_rdma_rank only across nodes).
            topk_idx: [num_tokens, num_topk] topk_idx_t, -1 for none; topk_weights: [num_tokens, num_topk] float32.
            expert_alignment: each count of num_recv_tokens_per_expert_list is rounded up to a multiple of it.
            num_worst_tokens: > 0: outputs of exactly that many rows, no CPU wait (CUDA-graph capturable); the
                per-expert list is then empty.
            config: chunk sizes and SMs (default: get_dispatch_config for the group size).
            previous_event, async_finish, allocate_on_comm_stream: DeepEP's stream rules (docs/api.md).

        Returns:
            recv_x: like x, [num_recv_tokens, hidden] (rows ordered by source rank, then channel, then token).
            recv_topk_idx: [num_recv_tokens, num_topk] topk_idx_t, local expert ids or -1; None without top-k.
            recv_topk_weights: [num_recv_tokens, num_topk] float32 (0 where recv_topk_idx is -1); None without.
            num_recv_tokens_per_expert_list: list of int, one per local expert.
            handle: DeepEP's tuple (6 tensors on one node, 10 across nodes), for combine and cached dispatch.
            event: an EventOverlap.
            In cached mode: (recv_x, None, None, None, None, event).
        """
        engine = self._engine()
        v.check_event_args(previous_event, async_finish, allocate_on_comm_stream)
        if config is None:
            config = default_config(DISPATCH_CONFIGS, self.group_size, Buffer.num_sms)
        check_internode_config(v.check_config(config), engine.num_nodes, engine.ranks_per_node, "dispatch")
        x_data, x_scales = v.check_dispatch_x(x, self._device)
        check_int("expert_alignment", expert_alignment, 1)
        check_int("num_worst_tokens", num_worst_tokens, 0)
        v.check_topk_pair(topk_idx, topk_weights)
        if handle is not None:
            if topk_idx is not None:
                raise ValueError(
                    "dispatch with a handle (cached mode) reuses the handle's routing: topk_idx and "
                    "topk_weights must be None"
                )
            return self._cached_dispatch(
                engine,
                x_data,
                x_scales,
                handle,
                expert_alignment,
                num_worst_tokens,
                config,
                (previous_event, async_finish, allocate_on_comm_stream),
            )
        num_experts = v.check_layout_tensors(
            num_tokens_per_rank,
            num_tokens_per_rdma_rank,
            is_token_in_rank,
            num_tokens_per_expert,
            x_data.size(0),
            self.group_size,
            engine.num_nodes,
            self._device,
        )
        self._check_dispatch_topk(topk_idx, topk_weights, num_experts, x_data.size(0), num_worst_tokens)
        per_rdma_rank = num_tokens_per_rdma_rank if engine.num_nodes > 1 else None
        inputs = (
            x_data,
            x_scales,
            topk_idx,
            topk_weights,
            num_tokens_per_rank,
            per_rdma_rank,
            is_token_in_rank,
            num_tokens_per_expert,
        )
        self._call.start()
        out, event = self._normal_op(
            lambda: engine.dispatch(*inputs, expert_alignment, num_worst_tokens, config.num_sms // 2, None),
            previous_event,
            async_finish,
            allocate_on_comm_stream,
            inputs,
        )
        recv_x, recv_scales, recv_topk_idx, recv_topk_weights, counts, handle = out
        recv = (recv_x, recv_scales) if x_scales is not None else recv_x
        return _returned(engine, (recv, recv_topk_idx, recv_topk_weights, counts, handle, event))

    def _check_dispatch_topk(self, topk_idx, topk_weights, num_experts, num_tokens, num_worst_tokens):
        if topk_idx is None:
            if num_worst_tokens > 0:
                raise ValueError(f"num_worst_tokens={num_worst_tokens} > 0 requires topk_idx and topk_weights")
            return
        v.check_topk_idx("topk_idx", topk_idx, num_experts, num_tokens=num_tokens, device=self._device)
        v.check_topk_weights("topk_weights", topk_weights, tuple(topk_idx.shape), self._device)

    def _cached_dispatch(self, engine, x, x_scales, handle, expert_alignment, num_worst_tokens, config, stream_args):
        handle, num_tokens, _, channels = v.check_normal_handle(handle, self.group_size, engine.num_nodes)
        if x.size(0) != num_tokens:
            raise ValueError(f"x has {x.size(0)} tokens; the handle was made by a dispatch of {num_tokens}")
        v.check_handle_channels(channels, config, "cached dispatch")
        self._call.start()
        out, event = self._normal_op(
            lambda: engine.dispatch(
                x, x_scales, None, None, None, None, None, None, expert_alignment, num_worst_tokens, channels, handle
            )[:2],
            *stream_args,
            (x, x_scales) + tuple(handle),
        )
        recv_x, recv_scales = out
        recv = (recv_x, recv_scales) if x_scales is not None else recv_x
        return _returned(engine, (recv, None, None, None, None, event))

    @_collective("combine")
    def combine(
        self,
        x: Tensor,
        handle: NormalHandle,
        topk_weights: Optional[Tensor] = None,
        bias: Union[Tensor, Tuple[Tensor, ...], None] = None,
        config: Optional[Config] = None,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor], EventOverlap]:
        """Sum (without weights) each token's rows back on its source rank, plus bias (normal mode).

        Arguments:
            x: BF16 [num_recv_tokens, hidden], rows in the order dispatch returned them.
            handle: the handle of the dispatch.
            topk_weights: [num_recv_tokens, num_topk] float32, summed like the rows; optional.
            bias: None, one or two BF16 [num_tokens, hidden] tensors added to each token's sum.
            config: chunk sizes and SMs (default: get_combine_config for the group size).
            previous_event, async_finish, allocate_on_comm_stream: DeepEP's stream rules (docs/api.md).

        Returns:
            combined_x: BF16 [num_tokens, hidden]; combined_topk_weights: [num_tokens, num_topk] float32 or None;
            event: an EventOverlap.
        """
        engine = self._engine()
        v.check_event_args(previous_event, async_finish, allocate_on_comm_stream)
        if config is None:
            config = default_config(COMBINE_CONFIGS, self.group_size, Buffer.num_sms)
        check_internode_config(v.check_config(config), engine.num_nodes, engine.ranks_per_node, "combine")
        handle, num_tokens, num_recv, channels = v.check_normal_handle(handle, self.group_size, engine.num_nodes)
        v.check_handle_channels(channels, config, "combine")
        v.check_tensor(
            "x",
            x,
            dtypes=(torch.bfloat16,),
            shape=(("num_recv_tokens", num_recv), ("hidden", None)),
            device=self._device,
        )
        if x.size(1) * x.element_size() % v.ROW_ALIGN_BYTES:
            raise ValueError(
                f"x rows are {x.size(1) * x.element_size()} bytes (hidden={x.size(1)}); they must be "
                f"a multiple of {v.ROW_ALIGN_BYTES} bytes"
            )
        v.check_optional_tensor(
            "topk_weights",
            topk_weights,
            dtypes=(torch.float32,),
            shape=(("num_recv_tokens", num_recv), ("num_topk", None)),
            device=self._device,
        )
        biases = v.check_bias(bias, num_tokens, x.size(1), x.dtype, self._device)
        self._call.start()
        out, event = self._normal_op(
            lambda: engine.combine(x, handle, topk_weights, biases),
            previous_event,
            async_finish,
            allocate_on_comm_stream,
            (x, topk_weights) + biases + tuple(handle),
        )
        return _returned(engine, (out[0], out[1], event))

    @_collective("a call")
    def refuse(self, error: BaseException) -> None:
        """Refuse, on this rank, the collective call (dispatch or combine) its peers are making: a layer above this
        Buffer (portep.elastic) found its own arguments invalid. The peers' waits in that call give up at once with
        AgreedRefusal (lockstep.py), the ranks stay in step, and this rank raises `error`."""
        raise error

    def internode_dispatch(self, *args: object, **kwargs: object) -> None:
        """DeepEP-internal; raises NotImplementedError (dispatch handles multi-node groups)."""
        raise NotImplementedError(
            "Buffer.internode_dispatch is DeepEP-internal; call Buffer.dispatch, which handles multi-node groups"
        )

    def internode_combine(self, *args: object, **kwargs: object) -> None:
        """DeepEP-internal; raises NotImplementedError (combine handles multi-node groups)."""
        raise NotImplementedError(
            "Buffer.internode_combine is DeepEP-internal; call Buffer.combine, which handles multi-node groups"
        )

    # ---- low-latency mode ----
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Reset the low-latency signal areas (needed after normal operations on a low-latency Buffer whose modes
        share their memory) and resynchronise the ranks; collective."""
        engine = self._ll_engine()
        check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1)
        check_int("hidden", hidden, 1)
        v.check_ll_hidden(hidden)
        v.check_num_experts(num_experts, self.group_size)
        with _host_factories(self._device):
            engine.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    @v.refuse_branch_keywords
    def low_latency_dispatch(
        self,
        x: Tensor,
        topk_idx: Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: Optional[Tensor] = None,
        dispatch_wait_recv_cost_stats: Optional[Tensor] = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ) -> Tuple[DispatchX, Tensor, tuple, EventOverlap, Optional[Callable[[], None]]]:
        """Send one message per (token, selected expert), packed expert-major on the receiver (low-latency mode).

        Arguments:
            x: BF16 [num_tokens, hidden], num_tokens <= num_max_dispatch_tokens_per_rank.
            topk_idx: [num_tokens, num_topk] topk_idx_t, -1 for none.
            num_max_dispatch_tokens_per_rank: T, the same on every rank and call of this shape.
            num_experts: experts in all.
            cumulative_local_expert_recv_stats: [num_local_experts] int32, tokens received added per expert.
            dispatch_wait_recv_cost_stats: [num_ranks] int64, wait time per source added.
            use_fp8, round_scale, use_ue8m0: FP8 E4M3 with per-128 scales (power-of-two, packed UE8M0).
            async_finish, return_recv_hook: DeepEP's (a hook: the call only sends; calling the hook receives).

        Returns:
            recv_x: BF16 [num_local_experts, num_ranks * T, hidden], or FP8 (float8_e4m3fn of that shape, scales
                float32 [num_local_experts, num_ranks * T, hidden // 128], or int32 [..., hidden // 512] packed
                UE8M0).
            recv_count: [num_local_experts] int32, valid rows per expert.
            handle: for low_latency_combine. event: an EventOverlap. hook: or None.
        (On a CUDA Buffer with the LL fast path, the instance's attribute of this name is the native entry, which
        hands this method every call it does not take: _install_ll_fast_path.)
        """
        return self._low_latency_dispatch(
            x,
            topk_idx,
            num_max_dispatch_tokens_per_rank,
            num_experts,
            cumulative_local_expert_recv_stats,
            dispatch_wait_recv_cost_stats,
            use_fp8,
            round_scale,
            use_ue8m0,
            async_finish,
            return_recv_hook,
        )

    @_collective("low_latency_dispatch")
    def _low_latency_dispatch(
        self,
        x,
        topk_idx,
        num_max_dispatch_tokens_per_rank,
        num_experts,
        cumulative_local_expert_recv_stats,
        dispatch_wait_recv_cost_stats,
        use_fp8,
        round_scale,
        use_ue8m0,
        async_finish,
        return_recv_hook,
    ):
        engine = self._ll_engine()
        v.check_ll_flags(async_finish, return_recv_hook)
        v.check_fp8_flags(use_fp8, round_scale, use_ue8m0)
        tokens = check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1)
        v.check_num_experts(num_experts, self.group_size)
        v.check_ll_x(x, tokens, use_ue8m0, self._device)
        v.check_topk_idx(
            "topk_idx", topk_idx, num_experts, num_tokens=x.size(0), limit_note=LL_TOPK_NOTE, device=self._device
        )
        v.check_stats(
            "cumulative_local_expert_recv_stats",
            cumulative_local_expert_recv_stats,
            num_experts // self.group_size,
            torch.int32,
            "num_local_experts",
            self._device,
        )
        v.check_stats(
            "dispatch_wait_recv_cost_stats",
            dispatch_wait_recv_cost_stats,
            self.group_size,
            torch.int64,
            "num_ranks",
            self._device,
        )
        recv_stats, wait_stats = cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats
        self._call.start()
        recv_x, recv_count, handle, hook = engine.low_latency_dispatch(
            x,
            topk_idx,
            tokens,
            num_experts,
            bool(use_fp8),
            bool(round_scale),
            bool(use_ue8m0),
            recv_stats,
            wait_stats,
            bool(return_recv_hook),
        )
        # checked and launched: the fast path may take this signature from now on (it checks each call's tensors)
        engine.mark_checked(tokens, x.size(1), num_experts, (bool(use_fp8), bool(round_scale), bool(use_ue8m0)))
        extra = None
        if async_finish:
            data, scales = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
            extra = (x, topk_idx, data, scales, recv_count, handle.src_info, handle.layout_range, recv_stats)
        return _returned(engine, (recv_x, recv_count, handle, self._event(async_finish, extra)), self._call.hook(hook))

    def low_latency_combine(
        self,
        x: Tensor,
        topk_idx: Tensor,
        topk_weights: Tensor,
        handle: tuple,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: Optional[Tensor] = None,
        combine_wait_recv_cost_stats: Optional[Tensor] = None,
    ) -> Tuple[Tensor, EventOverlap, Optional[Callable[[], None]]]:
        """Weighted sum of each token's expert outputs back on its source rank (low-latency mode).

        Arguments:
            x: BF16 [num_local_experts, num_ranks * T, hidden], the experts' outputs in the dispatch's layout.
            topk_idx: [num_tokens, num_topk] topk_idx_t and topk_weights: [num_tokens, num_topk] float32, as
                dispatched.
            handle: the dispatch's. use_logfmt: the rows travel in LogFMT-10 (DeepEP's format, about 10 bits a
                value; 2048 <= hidden, at most 32 chunks of 1024 channels, not with zero_copy; docs/logfmt.md).
                zero_copy: x was written into get_next_low_latency_combine_buffer.
            out: BF16 [num_tokens, hidden] to write into; combine_wait_recv_cost_stats: [num_ranks] int64.

        Returns:
            combined_x: BF16 [num_tokens, hidden]; event: an EventOverlap; hook: or None.
        (The fast path's native entry, where installed, as for low_latency_dispatch.)
        """
        return self._low_latency_combine(
            x,
            topk_idx,
            topk_weights,
            handle,
            use_logfmt,
            zero_copy,
            async_finish,
            return_recv_hook,
            out,
            combine_wait_recv_cost_stats,
        )

    @_collective("low_latency_combine")
    def _low_latency_combine(
        self,
        x,
        topk_idx,
        topk_weights,
        handle,
        use_logfmt,
        zero_copy,
        async_finish,
        return_recv_hook,
        out,
        combine_wait_recv_cost_stats,
    ):
        engine = self._ll_engine()
        v.check_ll_flags(async_finish, return_recv_hook)
        tokens, hidden, num_experts = v.check_ll_handle(handle, self.group_size)
        v.check_ll_logfmt(use_logfmt, zero_copy, hidden)
        v.check_ll_combine_x(x, self.group_size, tokens, hidden, num_experts, self._device)
        v.check_topk_idx("topk_idx", topk_idx, num_experts, limit_note=LL_TOPK_NOTE, device=self._device)
        v.check_ll_num_tokens("topk_idx", topk_idx.size(0), tokens)
        v.check_topk_weights("topk_weights", topk_weights, tuple(topk_idx.shape), self._device)
        v.check_ll_out(out, topk_idx.size(0), hidden, self._device)
        v.check_stats(
            "combine_wait_recv_cost_stats",
            combine_wait_recv_cost_stats,
            self.group_size,
            torch.int64,
            "num_ranks",
            self._device,
        )
        wait_stats = combine_wait_recv_cost_stats
        handle = ll_handle(handle)
        self._call.start()
        combined_x, hook = engine.low_latency_combine(
            x,
            topk_idx,
            topk_weights,
            handle,
            bool(zero_copy),
            out,
            bool(return_recv_hook),
            wait_stats,
            bool(use_logfmt),
        )
        engine.mark_checked(tokens, hidden, num_experts)
        extra = (x, topk_idx, topk_weights, handle.src_info, handle.layout_range, combined_x) if async_finish else None
        return _returned(engine, (combined_x, self._event(async_finish, extra)), self._call.hook(hook))

    def get_next_low_latency_combine_buffer(self, handle: tuple) -> Tensor:
        """The BF16 view [num_local_experts, num_ranks * T, hidden] that the next zero-copy combine sends from."""
        engine = self._ll_engine()
        v.check_ll_handle(handle, self.group_size)
        return engine.get_next_low_latency_combine_buffer(ll_handle(handle))

    # ---- shrink mode: masked ranks (DeepEP's enable_shrink) ----
    def _shrink_engine(self):
        engine = self._ll_engine()
        if not self.enable_shrink:
            raise RuntimeError("shrink mode must be enabled: create the Buffer with enable_shrink=True")
        return engine

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (mask=True: low-latency calls neither send to nor wait for it, its tokens count as absent) or
        unmask a rank. A rank that stops answering in a low-latency call (it left, its process is gone, or it
        timed out) is masked by that call."""
        engine = self._shrink_engine()
        check_int("rank_to_mask", rank_to_mask, 0, self.group_size - 1)
        engine.update_mask(rank_to_mask, bool(mask))

    def low_latency_query_mask_buffer(self, mask_status: Tensor) -> None:
        """Writes every rank's mask status into mask_status ([num_ranks] int32; 1 = masked)."""
        engine = self._shrink_engine()
        v.check_tensor(
            "mask_status",
            mask_status,
            dtypes=(torch.int32,),
            shape=(("num_ranks", self.group_size),),
            device=self._device,
        )
        engine.query_mask(mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmasks every rank."""
        self._shrink_engine().clean_mask()


class _Collective:
    """One collective call's bookkeeping (lockstep.py): validation failures before start() are refusals, which the
    peers learn of at once; failures after it leave the Buffer out of step; a DroppedInput is neither."""

    def __init__(self, buffer, engine, what, device):
        self.buffer, self.lockstep, self.what, self.started, self.device = buffer, engine.lockstep, what, False, device

    def __enter__(self):
        self.lockstep.begin()
        return self

    def start(self):
        """Validation passed: the call's traffic begins. Returns its sequence number."""
        seq = self.lockstep.enter(self.what)
        self.started = True
        return seq

    def hook(self, hook):
        """A receive hook whose failure counts as the call's, and which runs once: a second call would launch a
        receive phase that waits for data no peer sends."""
        if hook is None:
            return None
        called = []

        def guarded():
            if called:
                raise RuntimeError(f"{self.what}'s receive hook: already called (it launches the receive phase once)")
            if self.buffer.runtime is None:
                raise RuntimeError(f"{self.what}'s receive hook: its Buffer was destroyed")
            called.append(True)
            try:
                with _host_factories(self.device):
                    hook()
            except DroppedInput:
                raise
            except BaseException as e:
                self.lockstep.fail(self.what, e)
                raise

        return guarded

    def __exit__(self, kind, error, tb):
        ls = self.lockstep
        if error is None or isinstance(error, DroppedInput) or (isinstance(error, AgreedRefusal) and ls.sent):
            pass
        elif self.started and ls.sent:
            ls.fail(self.what, error)
        elif not (isinstance(error, OutOfStep) and not self.started):  # (enter() raising has told the peers)
            ls.refuse()
        return False


def _returned(engine, results, hook=False):
    """results (+ the hook, for the LL calls), once this call's kernels are launched. A notice reported by its
    kernels or an earlier call's is raised now (a DroppedInput carrying the results: every rank made the call, so
    the Buffer is in step), or with a receive hook after the hook launched the receive phase, which must run."""
    if hook is False:
        engine.raise_notice(results)
        return results
    if hook is None:
        engine.raise_notice(results + (None,))
        return results + (None,)

    def hook_then_notice():
        hook()
        engine.raise_notice()

    return results + (hook_then_notice,)


def _check_buffer_bytes(name, value):
    check_int(name, value, 0)
    if value % 128:
        raise ValueError(f"{name}={value} must be a multiple of 128 bytes")


def _default_backend():
    from ._native import native

    built = native is not None and native.build_info().get("gpu_built", False)
    return "cuda" if built and torch.cuda.is_available() else "host"


def select_backend(explicit: Optional[str]) -> str:
    """The backend a Buffer takes: explicit, else $PORTEP_BACKEND, else cuda where built and a GPU is visible."""
    source = "backend" if explicit is not None else "PORTEP_BACKEND"
    name = explicit if explicit is not None else (os.environ.get("PORTEP_BACKEND") or _default_backend())
    if name in PLANNED_BACKENDS:
        raise NotImplementedError(
            f"{source}={name!r}: the {name} backend is not available yet; use "
            f"backend='cuda' (NVIDIA GPUs) or backend='host' (CPU tensors)"
        )
    if name not in BACKENDS:
        raise ValueError(f"{source}={name!r} is not a backend; choose one of {', '.join(BACKENDS)}")
    return name


def ranks_per_node(explicit: Optional[int], group_size: int) -> int:
    """Ranks per node: `explicit`, else $PORTEP_RANKS_PER_NODE, else min(8, group_size); it must divide the group."""
    raw = os.environ.get("PORTEP_RANKS_PER_NODE")
    if explicit is not None:
        value, source = explicit, "num_ranks_per_node"
    elif raw:
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"PORTEP_RANKS_PER_NODE={raw!r} is not an integer") from None
        source = "PORTEP_RANKS_PER_NODE"
    else:
        value = min(DEFAULT_RANKS_PER_NODE, group_size)
        source = f"num_ranks_per_node (default min({DEFAULT_RANKS_PER_NODE}, group size))"
    check_int(source, value, 1, group_size)
    if group_size % value:
        raise ValueError(
            f"{source}={value} must divide the group size {group_size}; pass num_ranks_per_node= "
            f"or set PORTEP_RANKS_PER_NODE"
        )
    return value
