"""`portep.ElasticBuffer`: DeepEP V2's `deep_ep.ElasticBuffer` API (signatures, defaults, returns, layouts and
reduction order of DeepEP 2.1) over a V1 `portep.Buffer`, so it runs wherever that does: the host backend, the
CUDA/HIP backend, every transport, one node or many.

Each V2 dispatch is one V1 dispatch that carries each token's bytes and, in the scale-factor columns, its global
index, top-k weights and scale factors (wire.py); the receiving rank lays the tokens out as V2 does (layout.py,
outputs.py). Each V2 combine is one V1 dispatch the other way: every receiving rank sends its contributions back
unreduced and the source sums them in V2's order (reduce.py), which reproduces V2's results bit for bit on every
route. docs/api.md lists what differs from DeepEP V2."""

from typing import List, Optional, Tuple, Union

import torch

from ..buffer import Buffer
from ..deepep_config import check_int
from ..event import EventOverlap
from . import checks
from .domains import logical_domain, physical_domain
from .events import EventHandle
from .experimental import ExperimentalMethods
from .handle import EPHandle, Route
from .layout import receive_layout, worst_case_expanded_rows, worst_case_rows
from .outputs import Arrived, expanded_outputs, plain_outputs, src_metadata
from .reduce import contributions, reduce_at_source
from .sizing import buffer_size_hint, default_num_allocated_qps, theoretical_num_qps, theoretical_num_sms
from .wire import CombineColumns, DispatchColumns, as_bytes

Tensor = torch.Tensor
DispatchX = Union[Tensor, Tuple[Tensor, Tensor]]


class ElasticBuffer(ExperimentalMethods):
    """DeepEP V2's communication buffer of one rank: dispatch and combine with V2's layouts. Construction is
    collective over `group`.

    DeepEP arguments: as `deep_ep.ElasticBuffer`. The size is `num_bytes`, or computed from the MoE settings
    (`num_max_tokens_per_rank`, `hidden`, `num_topk`, `use_fp8_dispatch`) as get_buffer_size_hint does.
    `num_max_tokens_per_rank` is dispatch's default and must be the same on every rank. `sl_idx` and
    `num_allocated_qps` are recorded (portep's transports choose their own queues); `num_cpu_bytes` (Engram) must be
    0. Timeouts: every wait raises after `timeout_s` (default: min(num_cpu_timeout_secs, num_gpu_timeout_secs)),
    naming the rank.

    portep keyword-only arguments, as portep.Buffer's: num_ranks_per_node, transport, timeout_s, backend.
    """

    def __init__(
        self,
        group: "torch.distributed.ProcessGroup",
        num_bytes: Optional[int] = None,
        num_cpu_bytes: int = 0,
        num_max_tokens_per_rank: int = 0,
        hidden: int = 0,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        deterministic: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
        prefer_overlap_with_compute: bool = True,
        sl_idx: int = 3,
        num_allocated_qps: int = 0,
        num_cpu_timeout_secs: int = 300,
        num_gpu_timeout_secs: int = 100,
        explicitly_destroy: bool = False,
        *,
        num_ranks_per_node: Optional[int] = None,
        transport: Optional[str] = None,
        timeout_s: Optional[float] = None,
        backend: Optional[str] = None,
    ) -> None:
        self.runtime = None
        self.explicitly_destroy = bool(explicitly_destroy)
        if num_cpu_bytes:
            raise NotImplementedError(
                f"ElasticBuffer(num_cpu_bytes={num_cpu_bytes}): the host-memory segment serves Engram, which "
                f"portep does not implement (experimental in DeepEP); pass num_cpu_bytes=0"
            )
        check_int("num_max_tokens_per_rank", num_max_tokens_per_rank, 0)
        check_int("hidden", hidden, 0)
        check_int("num_topk", num_topk, 0, checks.MAX_TOPK)
        check_int("num_cpu_timeout_secs", num_cpu_timeout_secs, 1)
        check_int("num_gpu_timeout_secs", num_gpu_timeout_secs, 1)
        check_int("num_allocated_qps", num_allocated_qps, 0)
        if num_bytes is None:
            if num_max_tokens_per_rank <= 0 or hidden <= 0:
                raise ValueError(
                    "ElasticBuffer needs num_bytes, or num_max_tokens_per_rank > 0 and hidden > 0 to size itself "
                    f"(got num_max_tokens_per_rank={num_max_tokens_per_rank}, hidden={hidden})"
                )
            num_bytes = buffer_size_hint(
                group, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch, num_ranks_per_node, backend
            )
        check_int("num_bytes", num_bytes, 1)
        if num_bytes % 128:
            raise ValueError(f"num_bytes={num_bytes} must be a multiple of 128 bytes")
        self._v1 = Buffer(
            group,
            num_bytes,
            0,
            explicitly_destroy=True,
            num_ranks_per_node=num_ranks_per_node,
            transport=transport,
            timeout_s=timeout_s if timeout_s is not None else min(num_cpu_timeout_secs, num_gpu_timeout_secs),
            backend=backend,
        )
        self.runtime = self._v1.runtime
        self.group = group
        self.rank_idx, self.num_ranks = self._v1.rank, self._v1.group_size
        self.num_bytes = num_bytes
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.deterministic = bool(deterministic)
        self.allow_hybrid_mode = bool(allow_hybrid_mode)
        self.allow_multiple_reduction = bool(allow_multiple_reduction)
        self.prefer_overlap_with_compute = bool(prefer_overlap_with_compute)
        self.sl_idx = sl_idx
        self.num_cpu_timeout_secs, self.num_gpu_timeout_secs = num_cpu_timeout_secs, num_gpu_timeout_secs
        self.nccl_comm_handle = None
        self.num_rdma_ranks, self.num_nvlink_ranks = self.runtime.num_nodes, self.runtime.ranks_per_node
        self.num_scaleout_ranks, self.num_scaleup_ranks = logical_domain(
            (self.num_rdma_ranks, self.num_nvlink_ranks), self.allow_hybrid_mode
        )
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks
        self.num_allocated_qps = num_allocated_qps or default_num_allocated_qps(self.allow_hybrid_mode)
        # where this buffer's tensors live (portep's; V2 has no such attribute)
        self.device = torch.device("cuda" if self._v1.backend == "cuda" else "cpu")

    # ---- lifetime ----
    def destroy(self) -> None:
        """Release the buffer (requires explicitly_destroy=True, as in DeepEP). Calling it again does nothing."""
        if not self.explicitly_destroy:
            raise RuntimeError(
                "`explicitly_destroy` flag must be set: create the ElasticBuffer with explicitly_destroy=True to "
                "call destroy(); otherwise it is released on deletion"
            )
        self._release()

    def _release(self):
        v1, self.runtime = getattr(self, "_v1", None), None
        if v1 is not None and v1.runtime is not None:
            v1.destroy()

    def __del__(self) -> None:
        if getattr(self, "runtime", None) is None:
            return
        if self.explicitly_destroy:
            import warnings

            warnings.warn(
                "destroy() was not called before a portep ElasticBuffer created with explicitly_destroy=True was "
                "deleted: its communication memory and proxy threads stay until the interpreter exits",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        try:
            self._release()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass

    def _live(self) -> Buffer:
        if self.runtime is None:
            raise RuntimeError("this ElasticBuffer was destroyed")
        return self._v1

    # ---- sizes, domains, streams ----
    @staticmethod
    def get_buffer_size_hint(
        group: "torch.distributed.ProcessGroup",
        num_max_tokens_per_rank: int,
        hidden: int,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
        *,
        num_ranks_per_node: Optional[int] = None,
        backend: Optional[str] = None,
    ) -> int:
        """Bytes per rank (a multiple of 2 MiB) an ElasticBuffer needs for dispatches of up to
        num_max_tokens_per_rank tokens of `hidden` (num_topk=0: sized for top-32), on this machine's backend;
        docs/api.md gives the formula. The hybrid and reduction flags do not change it here."""
        return buffer_size_hint(
            group, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch, num_ranks_per_node, backend
        )

    def get_physical_domain_size(self) -> Tuple[int, int]:
        """(nodes, ranks per node) of this buffer's group."""
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> Tuple[int, int]:
        """(scale-out ranks, scale-up ranks): the physical pair with allow_hybrid_mode, else (1, num_ranks)."""
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def get_theoretical_num_sms(
        self,
        num_experts: int,
        num_topk: int,
        num_scaleout_topk: int = 0,
        rdma_gbs: float = 0,
        nvlink_gbs: float = 0,
        sm_read_gbs: float = 200,
        sm_write_gbs: float = 50,
    ) -> int:
        """SMs a dispatch or combine asks for by default: an even number >= 4 (>= 64 unless
        prefer_overlap_with_compute), at most the GPU's SMs. The bandwidth arguments are accepted and ignored."""
        check_int("num_scaleout_topk", num_scaleout_topk, 0, 0)
        return theoretical_num_sms(self.device, self.prefer_overlap_with_compute)

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """Queue pairs for num_sms SMs as V2 counts them (min(num_sms, 9), or num_sms x 16 + 1 with
        allow_hybrid_mode), at most num_allocated_qps."""
        check_int("num_sms", num_sms, 1)
        return theoretical_num_qps(num_sms, self.allow_hybrid_mode, self.num_allocated_qps)

    @staticmethod
    def capture() -> EventHandle:
        """An event recorded on the current stream, for `previous_event`."""
        return EventHandle()

    def get_comm_stream(self) -> Optional["torch.cuda.Stream"]:
        """The stream portep's V1 Buffer communicates on (None on the host backend)."""
        return self._live().get_comm_stream()

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """Wait until every rank reached this barrier (after this rank's queued GPU work)."""
        v1 = self._live()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        v1.runtime.barrier()

    # ---- dispatch ----
    def dispatch(
        self,
        x: DispatchX,
        topk_idx: Optional[Tensor] = None,
        topk_weights: Optional[Tensor] = None,
        cumulative_local_expert_recv_stats: Optional[Tensor] = None,
        num_experts: Optional[int] = None,
        num_max_tokens_per_rank: Optional[int] = None,
        expert_alignment: Optional[int] = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event: Optional[EventHandle] = None,
        previous_event_before_epilogue: Optional[EventHandle] = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
        handle: Optional[EPHandle] = None,
        do_handle_copy: bool = True,
        do_cpu_sync: Optional[bool] = None,
        do_expand: bool = False,
        do_zero_padding: bool = False,
        use_tma_aligned_col_major_sf: bool = False,
    ) -> Tuple[DispatchX, Optional[Tensor], Optional[Tensor], EPHandle, EventOverlap]:
        """Send each token once to every rank that holds one of its experts.

        Arguments:
            x: BF16 [N, hidden] contiguous, or (float8_e4m3fn [N, hidden] contiguous, sf [N, P] float32 or int32,
                any strides); N <= num_max_tokens_per_rank, rows a multiple of 16 bytes.
            topk_idx: [N, K] topk_idx_t (int64), global expert ids, -1 for none, no expert twice in a row, K <= 32;
                None with a handle.
            topk_weights: [N, K] float32 or None (carried, never applied).
            cumulative_local_expert_recv_stats: [num_experts // num_ranks] int32; each local expert's received
                count is added to it (not with a handle).
            num_experts: experts in all, a multiple of num_ranks (required without a handle).
            num_max_tokens_per_rank, expert_alignment: default to the buffer's and 1 (with a handle: the handle's;
                other values raise).
            num_sms, num_qps: 0 for the theoretical counts; checked, the V1 Buffer's config decides.
            previous_event: an EventHandle from capture() the work waits for (needs allocate_on_comm_stream=True).
            previous_event_before_epilogue: an EventHandle waited for likewise.
            async_with_compute_stream: return an event to wait on instead of ordering the current stream.
            allocate_on_comm_stream: as V2 (accepted; outputs are made on the current stream).
            handle: an EPHandle of an earlier dispatch of the same routing: cached mode (no count exchange).
            do_handle_copy: the handle keeps a copy of topk_idx (False: the caller's tensor itself).
            do_cpu_sync: True (default without a handle): outputs of exact sizes; False: of worst-case sizes
                (V2's R_alloc and X_alloc rows; the true counts are in the handle's psum tensors).
            do_expand: the expanded layout: one row per (token, local expert), experts in order, each expert's
                block starting at a multiple of expert_alignment.
            do_zero_padding: zero the expanded layout's padding rows (expand only).
            use_tma_aligned_col_major_sf: recv_sf column-major with strides (1, rows rounded up to 4).

        Returns:
            recv_x: like x, [R, hidden] (expanded: [X, hidden]), rows grouped by source scale-up rank, then by
                global index; FP8: (recv_x, recv_sf [rows, P] of sf's dtype).
            recv_topk_idx: [R, K] topk_idx_t, local expert ids, -1 where the slot is not on this rank; None when
                expanded.
            recv_topk_weights: [R, K] float32, the sender's weights for all K slots (expanded: [X], each row's
                slot weight); None without topk_weights.
            handle: an EPHandle (the same object in cached mode).
            event: an EventOverlap (its event is None unless async_with_compute_stream).
        """
        v1 = self._live()
        try:
            args = checks.dispatch_args(
                self,
                x,
                topk_idx,
                topk_weights,
                cumulative_local_expert_recv_stats,
                num_experts,
                num_max_tokens_per_rank,
                expert_alignment,
                num_sms,
                num_qps,
                handle,
                do_cpu_sync,
                do_expand,
                do_zero_padding,
                previous_event,
                allocate_on_comm_stream,
            )
        except Exception as error:  # noqa: BLE001 - refused on this rank: tell the peers, raise it
            v1.refuse(error)
        _wait_for(previous_event, previous_event_before_epilogue)
        if handle is None:
            handle, arrived = self._dispatch_new(v1, args, do_handle_copy)
        else:
            arrived = self._dispatch_cached(v1, args, handle)
        recv = self._dispatch_outputs(args, handle, arrived, use_tma_aligned_col_major_sf)
        return recv + (handle, _event(async_with_compute_stream))

    def _dispatch_new(self, v1, a, do_handle_copy):
        N, K = a.topk_idx.shape
        R = self.num_ranks
        local_experts = a.num_experts // R
        per_rank, per_node, per_expert, in_rank, _ = v1.get_dispatch_layout(a.topk_idx, a.num_experts)
        cols = DispatchColumns(K, a.num_sf)
        meta = self._dispatch_meta(cols, a, N, a.num_max_tokens)
        weights = (
            a.topk_weights if a.topk_weights is not None else torch.ones(N, K, dtype=torch.float32, device=self.device)
        )
        worst_rows = 0 if a.cpu_sync else worst_case_rows(R, a.num_max_tokens)  # V1 then reads nothing back
        (rows, recv_meta), recv_idx, _, aligned_counts, v1_handle, _ = v1.dispatch(
            (as_bytes(a.x), meta),
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_node,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=a.topk_idx,
            topk_weights=weights,
            expert_alignment=a.alignment,  # (V1's per-expert counts, from its count exchange: V2's aligned counts)
            num_worst_tokens=worst_rows,
        )
        if a.cpu_sync:
            expanded_rows = sum(aligned_counts)
        else:
            expanded_rows = worst_case_expanded_rows(R, a.num_max_tokens, K, local_experts, a.alignment)
        layout = receive_layout(
            cols.global_index(recv_meta),
            recv_idx,
            a.num_max_tokens,
            self.num_scaleup_ranks,
            local_experts,
            a.alignment,
            a.expand,
            group_by_scaleup=not self.deterministic,
            expanded_rows=expanded_rows,
        )
        num_rows, num_expanded = layout.num_rows, layout.num_expanded_rows
        slot_rank = torch.where(a.topk_idx >= 0, a.topk_idx // local_experts, torch.full_like(a.topk_idx, -1))
        route = Route(v1_handle, layout, slot_rank, K, a.num_max_tokens, a.num_sf, not a.cpu_sync)
        if a.stats is not None:
            a.stats += layout.num_unaligned_per_expert
        counts = list(aligned_counts) if a.cpu_sync else []
        return EPHandle(
            do_expand=a.expand,
            num_experts=a.num_experts,
            expert_alignment=a.alignment,
            num_max_tokens_per_rank=a.num_max_tokens,
            num_sms=a.num_sms,
            topk_idx=a.topk_idx.clone() if do_handle_copy else a.topk_idx,
            num_recv_tokens=num_rows,
            num_expanded_tokens=num_expanded,
            num_recv_tokens_per_expert_list=counts,
            psum_num_recv_tokens_per_scaleup_rank=layout.psum_per_scaleup_rank,
            psum_num_recv_tokens_per_expert=layout.psum_per_expert(a.expand),
            num_unaligned_recv_tokens_per_expert=layout.num_unaligned_per_expert,
            recv_src_metadata=src_metadata(layout, self.num_scaleup_ranks, a.num_max_tokens),
            dst_buffer_slot_idx=slot_rank.to(torch.int32),
            route=route,
        ), Arrived(rows, recv_meta, layout)

    def _dispatch_cached(self, v1, a, handle):
        route = handle.route
        N = route.slot_rank.size(0)
        meta = self._dispatch_meta(DispatchColumns(route.num_topk, a.num_sf), a, N, route.num_max_tokens_per_rank)
        worst_rows = route.layout.num_rows if route.without_cpu_sync else 0
        rows, recv_meta = v1.dispatch((as_bytes(a.x), meta), handle=route.v1_handle, num_worst_tokens=worst_rows)[0]
        return Arrived(rows, recv_meta, route.layout)

    def _dispatch_meta(self, cols, a, num_tokens, num_max_tokens):
        """[N, cols.width] int32: each token's global index, weights and scale factors (wire.DispatchColumns)."""
        global_index = self.rank_idx * num_max_tokens + torch.arange(num_tokens, device=self.device)
        return cols.encode(global_index, a.topk_weights, a.sf)

    def _dispatch_outputs(self, a, handle, arrived, col_major_sf):
        route = handle.route
        cols = DispatchColumns(route.num_topk, a.num_sf)
        with_weights = a.topk_weights is not None
        if handle.do_expand:
            recv_x, weights = expanded_outputs(
                arrived,
                route.layout,
                cols,
                a.x.dtype,
                a.sf_dtype,
                col_major_sf,
                a.zero_padding,
                with_weights,
            )
            return recv_x, None, weights
        return plain_outputs(arrived, route.layout, cols, a.x.dtype, a.sf_dtype, col_major_sf, with_weights)

    # ---- combine ----
    def combine(
        self,
        x: Tensor,
        handle: EPHandle,
        topk_weights: Optional[Tensor] = None,
        bias: Union[Tensor, Tuple[Tensor, Tensor], None] = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event: Optional[EventHandle] = None,
        previous_event_before_epilogue: Optional[EventHandle] = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor], EventOverlap]:
        """Sum each token's results back on its source rank (no weights applied), in V2's order.

        Arguments:
            x: BF16 contiguous: [R, hidden] in the dispatch's row order (the worst-case rows without a CPU sync);
                expanded handle: [X, hidden] in the expanded layout.
            handle: the dispatch's EPHandle.
            topk_weights: float32 [R, K] (expanded: [X]; None unless allow_multiple_reduction) or None; each slot's
                weight comes back from the rank that holds it.
            bias: None, a BF16 [N, hidden] tensor, or a 2-tuple of them, added first.
            num_sms, num_qps, previous_event, previous_event_before_epilogue, async_with_compute_stream,
                allocate_on_comm_stream: as in dispatch.

        Returns:
            combined_x: BF16 [N, hidden]: fp32(bias0) + fp32(bias1) plus each contribution in ascending order of
                its top-k slot, rounded once (expanded rows with allow_multiple_reduction are first summed per
                token on their rank; across nodes with allow_hybrid_mode and allow_multiple_reduction the ranks of
                each node are summed and rounded before the final sum).
            combined_topk_weights: [N, K] float32 (0 where topk_idx was -1), or None without topk_weights.
            event: an EventOverlap.
        """
        v1 = self._live()
        try:
            biases = checks.combine_args(
                self, x, handle, topk_weights, bias, num_sms, num_qps, previous_event, allocate_on_comm_stream
            )
        except Exception as error:  # noqa: BLE001 - refused on this rank: tell the peers, raise it
            v1.refuse(error)
        _wait_for(previous_event, previous_event_before_epilogue)
        out = self._combine(v1, x, handle, topk_weights, biases)
        return out + (_event(async_with_compute_stream),)

    def _combine(self, v1, x, handle, topk_weights, biases):
        route = handle.route
        per_slot = handle.do_expand and not self.allow_multiple_reduction
        rows, dest, token, slot, weights = contributions(x, topk_weights, route, handle.do_expand, per_slot)
        cols = CombineColumns(route.num_topk)
        meta = cols.encode(token, slot, weights)
        kind = "per-slot" if per_slot else "per-token"
        N, K = route.slot_rank.shape
        worst_rows = max(1, N * K) if route.without_cpu_sync else 0  # contributions a token can get back
        reverse = route.reverse.get(kind)
        if reverse is None:
            to_rank = dest.view(-1, 1)
            per_rank, per_node, per_expert, in_rank, _ = v1.get_dispatch_layout(to_rank, self.num_ranks)
            (back, back_meta), back_idx, _, _, v1_handle, _ = v1.dispatch(
                (as_bytes(rows), meta),
                num_tokens_per_rank=per_rank,
                num_tokens_per_rdma_rank=per_node,
                is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert,
                topk_idx=to_rank,
                topk_weights=torch.ones(to_rank.shape, dtype=torch.float32, device=to_rank.device),
                num_worst_tokens=worst_rows,
            )
            route.reverse[kind] = reverse = (v1_handle, back_idx[:, 0] >= 0)
        else:
            back, back_meta = v1.dispatch((as_bytes(rows), meta), handle=reverse[0], num_worst_tokens=worst_rows)[0]
        hybrid = self.allow_multiple_reduction and self.num_scaleout_ranks > 1
        return reduce_at_source(
            back.view(torch.bfloat16),
            back_meta,
            reverse[1],
            cols,
            route,
            biases,
            (self.num_scaleout_ranks, self.num_scaleup_ranks) if hybrid else None,
            topk_weights is not None,
        )


def _wait_for(*events: Optional[EventHandle]) -> None:
    for event in events:
        if event is not None:
            event.current_stream_wait()


def _event(async_with_compute_stream: bool) -> EventOverlap:
    return EventOverlap(EventHandle() if async_with_compute_stream else None)


def get_physical_domain_size(group: "torch.distributed.ProcessGroup") -> Tuple[int, int]:
    """(nodes, ranks per node) portep sees for `group`: nodes of $PORTEP_RANKS_PER_NODE ranks, else of
    min(8, group size)."""
    return physical_domain(group)


def get_logical_domain_size(group: "torch.distributed.ProcessGroup", allow_hybrid_mode: bool = True) -> Tuple[int, int]:
    """(scale-out ranks, scale-up ranks): the physical pair with allow_hybrid_mode, else (1, group size)."""
    return logical_domain(physical_domain(group), allow_hybrid_mode)


__all__: List[str] = ["ElasticBuffer", "get_logical_domain_size", "get_physical_domain_size"]
