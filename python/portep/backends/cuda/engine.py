"""The CUDA backend: LL dispatch/combine kernels and get_dispatch_layout on GPU tensors.

Memory: one Channel whose data region is GPU memory (shm transport with CUDA IPC). Its first `num_bytes` are the
DeepEP-sized LL buffer (two halves, laid out as gpu_kernels/cuda/ll_api.h says) and the normal mode's rings (both
over all of it, or LL in the first `ll_bytes` and normal mode in the rest); after them come the direct-path
flags, [half][phase][num_ranks * max_local_experts] int32. Peers reached directly (same node, NVLink) get
stores through IPC pointers; the others get WRITE/SIGNAL commands (per chunk of 32 local experts) through device
FIFOs to the proxy threads, which deliver the signals into host signal slots that one warp per chunk polls and
relays into device flags. The bytes of a proxy peer whose memory is mapped here (shm on one host) are stored by the
kernels themselves (placed WRITEs: the proxies make no CUDA call); otherwise, or with PORTEP_GPU_PROXY_COPIES=1,
they are staged in this rank's memory and moved by the transport (a NIC, or the copy engines; config.py says what
that costs on one host).

Combine between direct peers sends partial sums (gpu_kernels/cuda/ll_api.h): each rank first writes its combine
expert indices and weights into its direct peers' meta blocks (after the flags), and an owner returns the FP32 sum
of a token's two or more selections it holds instead of their BF16 rows. So unlike DeepEP's, the send phase of a
hooked combine waits for the direct peers to start their combine (their send phase, not their hook).

Kernels run on the current stream. A kernel failure (a wait that timed out) is recorded in mapped host memory; the
next call raises it, and so does every later one. A notice (part of a call's input left out: kernel_errors.py) is raised
once, as a DroppedInput, after the call that finds it launched.
"""

import torch

from ..._native import require_native
from ...channel import Channel
from ...errors import DroppedInput
from ...handles import LLHandle
from ...config import (
    PROXY_COPIES_VAR,
    check_gpu_copy_connections,
    group_proxy_plan,
    ll_graph_launch,
    proxy_copies,
)
from ...lockstep import AgreedRefusal, Lockstep, OutOfStep, wire_seq
from ...topology import Topology, host_masks
from .. import common as hb
from .ht import ctrl_bytes
from .kernel_errors import KernelErrors

NUM_DEVICE_FIFOS = 32
DEVICE_FIFO_CAPACITY = 4096


class CudaEvent:
    """A CUDA event recorded on the current stream (EventOverlap's payload on the CUDA backend)."""

    def __init__(self):
        self.event = torch.cuda.Event()
        self.event.record()

    def current_stream_wait(self):
        torch.cuda.current_stream().wait_event(self.event)

    def query(self):
        return self.event.query()

    def synchronize(self):
        self.event.synchronize()


def _current_raw_stream(device_index):
    """The current stream's cudaStream_t (torch's raw accessor skips building a Stream object, which costs
    microseconds per call; the public route is the fallback)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device_index) if raw is not None else torch.cuda.current_stream(device_index).cuda_stream


# Shrink mode: a destroyed Buffer's GPU memory stays allocated until the process exits, since peers that have not
# masked this rank yet may still store into it (peers of one host reach it through CUDA IPC).
_PARKED = []


class CudaEngine(Topology):
    """One per Buffer. Construction is collective over `group`."""

    def __init__(
        self,
        group,
        num_bytes,
        ranks_per_node,
        max_local_experts=1024,
        transport=None,
        timeout_s=None,
        allow_direct_ll=True,
        num_proxy_threads=None,
        normal_bytes=0,
        shrink=False,
    ):
        self.native = require_native()
        graph_launch = ll_graph_launch()  # a bad value raises before any collective
        info = self.native.build_info()
        if not info["gpu_built"]:
            raise RuntimeError(f"backend='cuda': portep was built without the GPU kernels ({info['gpu_reason']})")
        torch_runtime = "hip" if getattr(torch.version, "hip", None) else "cuda" if torch.version.cuda else None
        if torch_runtime and torch_runtime != info["gpu_runtime"]:
            raise RuntimeError(
                f"backend='cuda': portep's GPU kernels were built for {info['gpu_runtime'].upper()} "
                f"but torch is a {'ROCm' if torch_runtime == 'hip' else 'CUDA'} build; rebuild portep "
                f"with -Ccmake.define.PORTEP_GPU={torch_runtime}"
            )
        if not torch.cuda.is_available():
            raise RuntimeError("backend='cuda' needs a CUDA GPU (torch.cuda.is_available() is False)")
        super().__init__(group, ranks_per_node, max_local_experts)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.native.cuda_load_kernels()  # before any of them runs (see the binding)
        self.num_bytes = hb.align(max(num_bytes, hb.ALIGN), 128)
        # normal_bytes (a multiple of 128): the normal mode keeps to the last normal_bytes and the LL mode to the
        # rest, so neither overwrites the other's data (DeepEP's NVL and RDMA buffers); 0: both use every byte
        if normal_bytes % 128 or not 0 <= normal_bytes < self.num_bytes:
            raise ValueError(f"normal_bytes={normal_bytes} must be a multiple of 128 below num_bytes={self.num_bytes}")
        self.ll_bytes = self.num_bytes - normal_bytes if normal_bytes else self.num_bytes
        self.normal_off = self.ll_bytes if normal_bytes else 0
        self.normal_bytes = self.num_bytes - self.normal_off
        # after the data: the LL flags and meta blocks, then the normal mode's control area (ll_api.h, LLRegion)
        self.ll_region = self.native.LLRegion(self.num_bytes, self.num_ranks, max_local_experts)
        self.ht_ctrl_off = self.ll_region.end  # (backends/cuda/ht.py)
        self.ht_stream_base = hb.ll_streams_end(max_local_experts)  # and its signal streams
        self.fifos = self.native.DeviceFifoSet(NUM_DEVICE_FIFOS, DEVICE_FIFO_CAPACITY)
        self.status_stream = self.ht_stream_base + self.native.HT_NUM_STREAMS  # peer_watch.h
        threads, idle_spin_us = group_proxy_plan(host_masks(group), self.rank)  # the same thread count on every rank
        self.channel = Channel(
            group,
            self.ht_ctrl_off + ctrl_bytes(self.native, self.num_ranks, ranks_per_node)[0],
            transport=transport,
            num_streams=self.status_stream + self.native.NUM_STATUS_EVENTS,
            num_proxy_threads=threads if num_proxy_threads is None else num_proxy_threads,
            idle_spin_us=idle_spin_us,
            timeout_s=timeout_s,
            device=self.device.index,
            device_fifos=self.fifos,
            status_stream=self.status_stream,
        )
        # The normal-mode kernels' stream, made right after the proxies' copy streams so that, where CUDA assigns
        # hardware queues in turn, no proxy copy queues behind its kernels (torch's pool streams are made 32 at
        # once). It is never destroyed: tensors record_stream'd on it may be freed after the Buffer, and the caching
        # allocator then records an event on it.
        self.comm_stream = torch.cuda.ExternalStream(self.native.cuda_stream_create(), device=self.device)
        self.timeout_s = self.channel.timeout_s
        self.lockstep = Lockstep(self.channel, self.native, self.rank, self.num_ranks, self.timeout_s)
        # the peer watch's word per peer, in mapped host memory the kernels poll (peer_status.h)
        self.peer_status = self.native.MappedHost(4 * self.num_ranks)
        self.native.cuda_mirror_peer_status(self.channel.native_channel, self.peer_status)
        # shrink mode: the mask (receive sides set it) and its copy as each call begins (send sides read it)
        self.mask = self._send_mask = None
        if shrink:
            self.mask = torch.zeros(self.num_ranks, dtype=torch.int32, device=self.device)
            self._send_mask = torch.zeros_like(self.mask)
            self.lockstep.mask = self.mask
        ch = self.channel.native_channel
        # the Channel's whole data region (a view that keeps it mapped): the Buffer's bytes, then the LL flags
        self._whole_region = torch.as_tensor(ch.device_data_lease(), device=self.device)
        self.region = self._whole_region[: self.num_bytes]
        self.direct_ranks = [
            d for d in range(self.num_ranks) if d == self.rank or (allow_direct_ll and self.node_of(d) == self.node)
        ]
        # Proxy peers whose memory is mapped here get their bytes stored by the kernels and placed WRITEs (config.py:
        # PROXY_COPIES_VAR): kernels read this only for peers that are not direct.
        self.placed = self.channel.placed_writes and not proxy_copies()
        place = [d for d in range(self.num_ranks) if self.placed and d != self.rank and ch.peer_mapped(d)]
        self.placed_ranks = [d for d in place if d not in self.direct_ranks]
        copied = len(self.direct_ranks) + len(self.placed_ranks) < self.num_ranks
        if copied and self.channel.transport.startswith("shm"):
            check_gpu_copy_connections(
                f"the proxy path over transport={self.channel.transport!r} on GPU memory with {PROXY_COPIES_VAR}=1"
            )
        # the regions the kernels store into, written whole by a synchronous copy (no fill kernel left to race it,
        # nothing queued on this stream that may still write the memory): direct ranks, placed-WRITE ranks; 0 else
        self._peers = torch.empty(self.num_ranks, dtype=torch.int64, device=self.device)
        self.place_table = torch.empty_like(self._peers)
        torch.cuda.current_stream(self.device).synchronize()
        self.native.cuda_peer_table(ch, self.direct_ranks, self._peers)
        self.native.cuda_peer_table(ch, place, self.place_table)
        # the kernels' int32 scratch, laid out natively (gpu_kernels/cuda/ll_api.h, LLScratch)
        self._scratch = torch.zeros(
            self.native.ll_scratch_words(self.num_ranks, max_local_experts), dtype=torch.int32, device=self.device
        )
        # the proxy signal slots' values the kernels consumed last (only the host writes the slots themselves)
        self.signal_seen = torch.zeros(self.num_ranks * self.channel.num_streams, dtype=torch.int64, device=self.device)
        self.errors = KernelErrors(self.native, self.device)
        self.failed_flag = self.errors.words
        self._ht = None
        self.launch_stream = None  # comm_stream while the Buffer runs a normal-mode call (backends/cuda/comm_stream.py)
        num_sms = self.device_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.kernels = self.native.LLKernels(
            rank=self.rank,
            num_ranks=self.num_ranks,
            max_local_experts=max_local_experts,
            num_direct=len(self.direct_ranks),
            num_bytes=self.num_bytes,
            stream_base=hb.STREAM_LL_BASE,
            device=self.device.index,
            channel=ch,
            peers=self._peers,
            place=self.place_table,
            signal_seen=self.signal_seen,
            num_streams=self.channel.num_streams,
            fifos=self.fifos,
            scratch=self._scratch,
            errors=self.errors.records,
            failed=self.failed_flag,
            peer_status=self.peer_status,
            mask=self.mask,
            send_mask=self._send_mask,
            timeout_s=self.timeout_s,
            num_sms=num_sms,
        )
        self.kernels.graph_launch = self.kernels.graph_launch and graph_launch
        self._layouts = {}
        torch.cuda.current_stream(self.device).synchronize()
        self.channel.barrier()  # every peer's memory is zeroed before anyone stores into it

    # ---- errors ----
    def check_error(self):
        """Raise what a proxy thread latched (often the cause of a kernel's timeout), else a kernel failure: the
        Buffer stays failed, every call raises until the ranks resynchronise (clean_low_latency_buffer). Called
        before a call launches anything."""
        try:
            self.channel.check_error()
        except RuntimeError as e:
            self.lockstep.fail("an earlier call", e)
            raise
        failure = self.errors.record(0)
        if failure[0]:
            error = RuntimeError(self.errors.message(*failure, self._failure_context(failure[0], failure[2])))
            self.lockstep.fail("an earlier call", error)
            raise error

    def raise_notice(self, results=None):
        """Raise a notice the kernels of this or an earlier call reported (that call dropped part of its input) as
        a DroppedInput carrying `results`, once. Called after a call launched its kernels (a hooked call: after its
        receive phase), so that its peers, which made the same call, are not left waiting and the Buffer stays in
        step and usable. Only this rank raises: its input held the entry."""
        notice = self.errors.take_notice()
        if notice is not None:
            raise DroppedInput(
                f"{notice[1]}; reported by the kernels of this or an earlier call on this Buffer. This call was "
                f"made on every rank: its results are in the exception's `results`; go on with them and make the "
                f"calls that pair with it (docs/design.md §7)",
                results,
            )

    def _failure_context(self, code, src):
        """Where this rank's proxies stand, and (a wait that timed out) what src's proxies delivered."""
        stats = self.channel.stats()
        moved = {
            k: sum(s[k] for s in stats)
            for k in ("commands", "writes", "signals", "notices", "held_signals", "signals_delayed", "in_flight")
        }
        hint = ""
        if moved["in_flight"] or moved["held_signals"]:  # per proxy thread: where the operations wait
            moved["per_thread"] = [
                {k: s[k] for k in ("in_flight", "queued", "copying", "notify_full", "held_signals")} for s in stats
            ]
            if any(s["copying"] for s in stats):
                hint = (
                    "; copies issued by this rank's proxies have not completed: if their stream shares a hardware "
                    f"queue with the kernels' stream they wait behind those kernels ({PROXY_COPIES_VAR}=1 is set; "
                    "see CUDA_DEVICE_MAX_CONNECTIONS in portep/config.py)"
                )
        slots = ""
        # what that peer's proxies delivered into the LL slots
        if self.errors.name(code) == "wait_timeout" and 0 <= src < self.num_ranks:
            # a snapshot: the proxies may still write the live slots, which torch's nonzero must not see change
            row = self.channel.signals[src, hb.STREAM_LL_BASE : hb.ll_streams_end(self.max_local_experts)].clone()
            live = [(int(i), int(row[i]) >> 32, int(row[i]) & 0xFFFFFFFF) for i in row.nonzero().flatten()[:8]]
            slots = (
                f"; LL signal slots from rank {src} (stream offset, final signals, units delivered since the "
                f"Buffer was created or cleaned): {live}"
            )
        return (
            f" with timeout_s={self.timeout_s}; the Buffer's results are invalid (this rank's proxies so far: "
            f"{moved}{slots}{hint})"
        )

    # ---- layout ----
    def _layout(self, T, H, E):
        lay = self._layouts.get((T, H, E))
        if lay is None:
            lay = self._layouts[(T, H, E)] = hb.LLLayout(self, T, H, E)
            self.kernels.prepare(T, H, E)
        return lay

    def require_bytes(self, needed, what):
        if needed > self.ll_bytes:
            where = (
                "the communication buffer"
                if self.ll_bytes == self.num_bytes
                else "its low-latency part (num_rdma_bytes)"
            )
            raise AgreedRefusal(f"{where} has {self.ll_bytes} bytes but {what} needs {needed} bytes")

    def _launch_stream(self):
        """The stream an LL launch goes on (torch's current one); in shrink mode the mask as it begins, which its
        send sides read (stream-ordered)."""
        if self.mask is not None:
            self._send_mask.copy_(self.mask)
        return _current_raw_stream(self.device.index)

    def mark_checked(self, T, H, E, dispatch_flags=None):
        """A call of this signature passed the Buffer's checks and launched (dispatch_flags: (use_fp8, round_scale,
        use_ue8m0), None for a combine): the fast path (ll_fast.py) may take the next ones."""
        self.kernels.mark_checked(T, H, E, dispatch_flags)

    # ---- the API the Buffer calls ----
    def get_dispatch_layout(self, topk_idx, num_experts):
        N, K = topk_idx.shape
        R = self.num_ranks
        per_rank = torch.empty(R, dtype=torch.int32, device=self.device)
        per_node = torch.empty(self.num_nodes, dtype=torch.int32, device=self.device) if self.num_nodes > 1 else None
        per_expert = torch.empty(num_experts, dtype=torch.int32, device=self.device)
        in_rank = torch.empty(N, R, dtype=torch.bool, device=self.device)
        self.native.cuda_dispatch_layout(
            topk_idx.contiguous(),
            N,
            K,
            num_experts,
            R,
            self.ranks_per_node,
            per_rank,
            per_node,
            per_expert,
            in_rank,
            self.raw_stream(),
            self.rank,
            self.failed_flag,
            self.errors.records,
        )
        return per_rank, per_node, per_expert, in_rank

    def raw_stream(self):
        """Where normal-mode kernels launch: the Buffer's communication stream during its calls, else the current
        stream."""
        if self.launch_stream is not None:
            return self.launch_stream.cuda_stream
        return _current_raw_stream(self.device.index)

    def _normal_mode(self):
        if self._ht is None:
            from .ht import CudaHT

            self._ht = CudaHT(self, self.ht_ctrl_off, self.ht_stream_base)
        return self._ht

    def dispatch(
        self,
        x,
        x_scales,
        topk_idx,
        topk_weights,
        num_tokens_per_rank,
        num_tokens_per_rdma_rank,
        is_token_in_rank,
        num_tokens_per_expert,
        expert_alignment,
        num_worst_tokens,
        num_channels,
        handle,
    ):
        self.check_error()
        return self._normal_mode().dispatch(
            x,
            x_scales,
            topk_idx,
            topk_weights,
            is_token_in_rank,
            num_tokens_per_expert,
            expert_alignment,
            num_worst_tokens,
            num_channels,
            handle,
        )

    def combine(self, x, handle, topk_weights, bias):
        self.check_error()
        return self._normal_mode().combine(x, handle, topk_weights, bias)

    def low_latency_dispatch(
        self, x, topk_idx, T, E, use_fp8, round_scale, use_ue8m0, cumulative_stats, wait_stats, return_recv_hook
    ):
        self.check_error()
        lay = self._layout(T, x.size(1), E)
        half = self.kernels.take_half()
        seq = wire_seq(self.lockstep.seq)  # the call's own: a receive hook launches after later calls may have begun
        R, H, E_l, M = self.num_ranks, lay.H, lay.E_l, lay.M
        x = x.contiguous()
        topk_idx = topk_idx.contiguous()
        dev = self.device
        if use_fp8:
            recv_x = torch.empty(E_l, M, H, dtype=torch.float8_e4m3fn, device=dev)
            S, sdt = (H // 512, torch.int32) if use_ue8m0 else (H // 128, torch.float32)
            scales = torch.empty(E_l, S, M, dtype=sdt, device=dev)
            out_x = (recv_x, scales.transpose(1, 2))
        else:
            recv_x = out_x = torch.empty(E_l, M, H, dtype=torch.bfloat16, device=dev)
            scales = None
        recv_count = torch.empty(E_l, dtype=torch.int32, device=dev)
        src_info = torch.empty(E_l, M, dtype=torch.int32, device=dev)
        layout_range = torch.empty(E_l, R, dtype=torch.int64, device=dev)

        def launch(phases):
            self.lockstep.sending()
            stream = self._launch_stream()
            self.kernels.dispatch(
                T,
                H,
                E,
                half,
                phases,
                stream,
                seq,
                x=x,
                topk_idx=topk_idx,
                num_tokens=x.size(0),
                num_topk=topk_idx.size(1),
                use_fp8=use_fp8,
                round_scale=round_scale,
                use_ue8m0=use_ue8m0,
                recv_x=recv_x,
                recv_scales=scales,
                recv_count=recv_count,
                src_info=src_info,
                layout_range=layout_range,
                cumulative_stats=cumulative_stats,
                wait_stats=wait_stats,
            )

        handle = LLHandle(src_info, layout_range, T, H, E)
        if return_recv_hook:
            launch(self.native.LL_PHASE_SEND)
            return out_x, recv_count, handle, lambda: launch(self.native.LL_PHASE_RECV)
        launch(self.native.LL_PHASE_SEND | self.native.LL_PHASE_RECV)  # one kernel: sends, then receives
        return out_x, recv_count, handle, None

    def get_next_low_latency_combine_buffer(self, handle):
        lay = self._layout(handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts)
        return self._combine_send_view(lay, self.kernels.half)

    def _combine_send_view(self, lay, half):
        off = lay.send_off(half)
        rows = self.region[off : off + lay.E_l * lay.M * lay.comb].view(lay.E_l, lay.M, lay.comb)
        return rows.view(torch.bfloat16)[:, :, : lay.H]

    def low_latency_combine(
        self, x, topk_idx, topk_weights, handle, zero_copy, out, return_recv_hook, wait_stats, use_logfmt=False
    ):
        self.check_error()
        src_info, layout_range, T, H, E = handle  # an LLHandle (buffer.py types it)
        self._layout(T, H, E)
        half = self.kernels.take_half()
        seq = wire_seq(self.lockstep.seq)  # the call's own (see low_latency_dispatch)
        rows = x.contiguous()  # unread with zero_copy: the rows are in the send area (the kernels know where)
        topk_idx = topk_idx.contiguous()
        weights = topk_weights.to(torch.float32).contiguous()
        N = topk_idx.size(0)
        result = (
            out
            if out is not None and out.is_contiguous()
            else torch.empty(N, H, dtype=torch.bfloat16, device=self.device)
        )

        def launch(phases):
            self.lockstep.sending()
            stream = self._launch_stream()
            self.kernels.combine(
                T,
                H,
                E,
                half,
                phases,
                stream,
                seq,
                x=rows,
                zero_copy=zero_copy,
                use_logfmt=bool(use_logfmt),
                src_info=src_info,
                layout_range=layout_range,
                topk_idx=topk_idx,
                topk_weights=weights,
                num_tokens=N,
                num_topk=topk_idx.size(1),
                out=result,
                wait_stats=wait_stats,
            )
            if phases & self.native.LL_PHASE_RECV and out is not None and result is not out:
                out.copy_(result)

        if return_recv_hook:
            launch(self.native.LL_PHASE_SEND)
            return (out if out is not None else result), lambda: launch(self.native.LL_PHASE_RECV)
        launch(self.native.LL_PHASE_SEND | self.native.LL_PHASE_RECV)
        return (out if out is not None else result), None

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        """DeepEP's clean, which also resynchronises the ranks' LL state (lockstep.py): once every kernel of this
        Buffer finished, between two synchronisations, every LL flag, meta block, scratch counter and signal slot
        of this rank goes back to zero (the normal mode's and the LEFT status slots stay), the kernels' failure and
        notice words too, and so do the call counters."""
        if self.lockstep.broken and self.lockstep.broken.startswith(("dispatch", "combine")):
            raise OutOfStep(
                f"rank {self.rank}: clean_low_latency_buffer resynchronises the low-latency mode only, "
                f"but a normal-mode call failed ({self.lockstep.broken}): destroy this Buffer and create "
                f"a new one on every rank"
            )
        self.synchronize()
        self.sync()
        flags = self.num_bytes
        self._whole_region[flags : self.ll_region.end].zero_()  # flags, meta blocks
        self._scratch.zero_()
        self.signal_seen.view(self.num_ranks, -1)[:, : self.ht_stream_base].zero_()  # normal mode's stay
        signals = self.channel.signals
        keep = {hb.STREAM_SYNC, self.status_stream + self.native.EVENT_LEFT}
        for begin, end in hb.ranges_without(keep, self.ht_stream_base):
            signals[:, begin:end].zero_()
        ev = self.status_stream
        signals[:, ev + self.native.EVENT_REFUSED : ev + self.native.EVENT_FAILED + 1].zero_()
        self.errors.clear()
        self.kernels.reset_half()
        self.lockstep.resynced()
        torch.cuda.current_stream(self.device).synchronize()
        self.sync()

    def sync(self):
        """Every rank that is not masked gets here (shrink mode: one that left, is gone or times out is masked),
        after everything it posted before was delivered."""
        self.channel.quiet()
        host_mask = None if self.mask is None else self.mask.to(torch.uint8).cpu()  # (the kernels are done)
        live = [r for r in range(self.num_ranks) if host_mask is None or not host_mask[r]]
        ch = self.channel.native_channel
        for dst in live:
            if ch.peer_mapped(dst) and dst in self.direct_ranks:
                ch.direct_signal(dst, hb.STREAM_SYNC, 0, True)
            else:
                ch.signal(dst, hb.STREAM_SYNC, True)
        srcs = torch.tensor(live, dtype=torch.int64, device="cpu")  # (the caller's default device may be CUDA)
        streams = torch.full((len(live),), hb.STREAM_SYNC, dtype=torch.int64, device="cpu")
        units, waited = torch.empty_like(srcs), torch.empty_like(srcs)
        ch.consume_many(srcs, streams, units, waited, self.timeout_s, host_mask)
        if host_mask is not None:  # a rank that did not get here is masked now
            self.mask.copy_(host_mask.to(torch.int32))

    # ---- shrink mode ----
    def update_mask(self, rank, masked):
        self.mask[rank] = int(masked)

    def query_mask(self, out):
        out.copy_(self.mask)

    def clean_mask(self):
        self.mask.zero_()

    def get_local_buffer_tensor(self, dtype, size=None, offset=0, use_rdma_buffer=False):
        begin, end = (0, self.ll_bytes) if use_rdma_buffer else (self.normal_off, self.num_bytes)
        return hb.byte_view(self.region[begin:end], dtype, size, offset)

    def synchronize(self):
        """Waits for this Buffer's kernels: the LL ones on the current stream, the normal-mode ones on comm_stream."""
        torch.cuda.current_stream(self.device).synchronize()
        self.comm_stream.synchronize()

    def barrier(self):
        self.synchronize()
        self.channel.barrier()

    def destroy(self):
        if self.channel is None:
            return
        try:
            self.synchronize()
            self.channel.quiet()  # what this rank sent goes out first; then peers waiting for it give up (or mask it)
            self.channel.announce(self.native.EVENT_LEFT)
        except Exception:  # noqa: BLE001 - a failed channel or device: destroy what is left all the same
            pass
        finally:
            self.region = self._whole_region = None
            if self._ht is not None:
                self._ht.destroy()
                self._ht = None
            self.native.cuda_mirror_peer_status(self.channel.native_channel, None)  # the watch stops writing them
            self.kernels.close()  # before the memory its plan table points at goes
            if self.mask is not None:  # shrink mode: see _PARKED
                _PARKED.append(self.channel.native_channel.device_data_lease())
            self.channel.destroy()
            self.channel = None
            self.fifos = None
            self.kernels = None
            self.errors.free()
            self.peer_status.close()
