"""The host backend of the EP kernels: the calling CPU thread runs the dispatch/combine protocols over the
registered communication memory of a Channel. Same-node peers are written directly (plain stores into their
mapped memory, published by a release atomic on their signal slots); other peers get WRITE and SIGNAL
commands through the FIFOs, the proxy threads and the transport, whose ordering protocol (on unordered
transports) keeps every signal behind the writes it covers. `portep.Buffer` validates arguments and calls
this engine; tensors are CPU tensors and results are DeepEP-shaped.

Topology (topology.py): rank r is on node r // ranks_per_node. HT traffic to another node goes to that node's
forwarder with the sender's local index, which places it for its node peers; LL traffic goes straight to every
rank.

Every signal slot is consumed exactly (see Channel.consume_signal), so nothing needs zeroing between calls: a
peer can run at most one call ahead, and the areas it writes in that call are ones this rank has finished
reading (each call exchanges counts first, and nobody writes data before it has every rank's counts).
"""

import os

import torch

from ..._native import require_native
from ...channel import Channel
from ...lockstep import AgreedRefusal, Lockstep
from ...topology import Topology
from ..common import (
    ALIGN,
    MAX_CHANNELS,
    MAX_COMMAND_BYTES,
    STREAM_LL_BASE,
    STREAM_NOTIFY,
    STREAM_SYNC,
    align,
    byte_view,
    dense,
    ll_streams_end,
    ranges_without,
)
from . import ht as host_ht, ll as host_ll


def max_count_row(num_ranks, num_nodes, max_local_experts):
    """int64 entries of one rank's row of the normal mode's count exchange, its sequence number included."""
    return num_ranks + num_nodes + num_ranks * MAX_CHANNELS + num_ranks * max_local_experts + 1


def count_area_bytes(num_ranks, num_nodes, max_local_experts=1024):
    """Bytes at the start of the buffer that the count exchange keeps (two parities of one slot per rank); the
    normal mode's data areas follow."""
    return 2 * num_ranks * align(8 * max_count_row(num_ranks, num_nodes, max_local_experts))


def _device_memory():
    """PORTEP_EMULATE_DEVICE_MEMORY=1 (a testing knob): the engine's memory takes the transport's GPU path (emulated
    device memory: shared host memory whose proxy copies run on worker threads, some delayed), so the DeepEP
    protocols run over the same deferred-notification code as on GPUs, without one."""
    return "emulated" if os.environ.get("PORTEP_EMULATE_DEVICE_MEMORY") == "1" else None


class HostEngine(Topology):
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
        shrink=False,
    ):
        require_native()
        super().__init__(group, ranks_per_node, max_local_experts)
        self.allow_direct_ll = bool(allow_direct_ll)
        if num_proxy_threads is None:
            # Every rank of the host backend runs on this host: share its cores (an idle proxy still wakes up).
            num_proxy_threads = max(1, min(4, (os.cpu_count() or 1) // self.num_ranks))
        status = self.status_stream = ll_streams_end(max_local_experts)  # the status streams follow the LL ones
        self.channel = Channel(
            group,
            max(ALIGN, align(num_bytes)),
            transport=transport,
            num_streams=status + require_native().NUM_STATUS_EVENTS,
            num_proxy_threads=num_proxy_threads,
            timeout_s=timeout_s,
            device=_device_memory(),
            status_stream=status,
        )
        self.num_bytes = self.channel.nbytes
        # The count exchange has a fixed home (two parities of one slot per rank) that no data area overlaps: a
        # peer one call ahead may write it while this rank still reads the previous call's data areas.
        self.max_count_row = max_count_row(self.num_ranks, self.num_nodes, max_local_experts)
        self.count_slot_bytes = align(8 * self.max_count_row)
        self.data_start = count_area_bytes(self.num_ranks, self.num_nodes, max_local_experts)
        self.timeout_s = self.channel.timeout_s
        self._native = self.channel.native_channel
        self.native = require_native()
        self.region = self.channel.buffer
        self._peer_views = {}
        self.ht_calls = 0  # parity of the notify area
        self.ll_half = 0
        self._writes_in_flight = False
        self.lockstep = Lockstep(self.channel, self.native, self.rank, self.num_ranks, self.timeout_s)
        self.mask = None  # shrink mode (DeepEP's enable_shrink): uint8 [R], 1 = masked
        if shrink:  # ranks that stop answering in LL calls are masked, not waited for
            self.mask = torch.zeros(self.num_ranks, dtype=torch.uint8)
            self.lockstep.mask = self.mask

    # ---- data movement ----

    def raise_notice(self, results=None):
        """Nothing to raise: the host backend checks its inputs before it moves anything (the CUDA engine's
        kernels report some of theirs afterwards)."""

    def peer_view(self, dst):
        """dst's whole registered memory as a uint8 tensor when it can be stored into directly, else None."""
        if dst not in self._peer_views:
            mv = self._native.peer_data_view(dst)
            self._peer_views[dst] = None if mv is None else torch.frombuffer(mv, dtype=torch.uint8)
        return self._peer_views[dst]

    def direct(self, dst, low_latency=False):
        if self.node_of(dst) != self.node or (low_latency and not self.allow_direct_ll and dst != self.rank):
            return False
        return self.peer_view(dst) is not None

    def store(self, dst, offset, rows):
        """Direct store of a [n, row_bytes] uint8 tensor at dst's offset (same node only)."""
        n = rows.numel()
        if n:
            self.peer_view(dst)[offset : offset + n].view(rows.shape).copy_(rows)

    def put_rows(self, dst, local_offsets, remote_offsets, row_bytes, stream, merge=True):
        """WRITE commands from this rank's memory to dst's, one per row (contiguous rows merged if `merge`)."""
        lo = local_offsets.to(torch.int64).contiguous()
        ro = remote_offsets.to(torch.int64).contiguous()
        if lo.numel():
            self._writes_in_flight = True
            self._native.write_rows(dst, lo, ro, row_bytes, stream, merge)

    def settle(self):
        """Wait until the proxies have read every byte earlier WRITEs take from this rank's memory, before a call
        stores into that memory again (a transport may still be copying from it after the call returned)."""
        if self._writes_in_flight:
            self._native.quiet()
            self._writes_in_flight = False

    def copy_rows(self, dst, dst_pitch, dst_idx, src, src_pitch, src_idx, row_bytes):
        """Native row copy: dst/src are uint8 tensors (views of the communication memory or staging), indices
        int64 tensors or None (row i)."""
        dst_idx, src_idx = (None if t is None else t.to(torch.int64).contiguous() for t in (dst_idx, src_idx))
        if (dst_idx if dst_idx is not None else src_idx).numel():
            self.native.copy_rows(dst, dst_pitch, dst_idx, src, src_pitch, src_idx, row_bytes)

    def reduce_rows(self, out, out_pitch, out_dtype, n, width, sources, init=None):
        """out rows (uint8 tensor at the first row) = init + sum over sources in order (see row_kernels.h).
        sources: (uint8 tensor at row 0, pitch, dtype, int64 index [n] with -1 for none, float32 weights or None)."""
        native_sources = [
            (base, pitch, dtype, index.to(torch.int64).contiguous(), None if w is None else w.float().contiguous())
            for base, pitch, dtype, index, w in sources
        ]
        init = None if init is None else init.to(torch.float32).contiguous()
        self.native.reduce_rows(out, out_pitch, out_dtype, n, width, native_sources, init)

    def logfmt_encode_rows(self, dst, dst_pitch, dst_idx, src, src_pitch, src_idx, hidden, seq):
        """Native LogFMT-10 encode (gpu_kernels/logfmt.h): BF16 rows of src (uint8 tensor, rows src_idx) into the
        row slots dst_idx of dst, with the call's sequence number `seq` in each row's metadata."""
        dst_idx, src_idx = (t.to(torch.int64).contiguous() for t in (dst_idx, src_idx))
        if dst_idx.numel():
            self.native.logfmt_encode_rows(dst, dst_pitch, dst_idx, src, src_pitch, src_idx, hidden, seq)

    def logfmt_row_seqs(self, base, pitch, idx, hidden):
        """The sequence numbers in the LogFMT rows idx (int64 [n]) of base (uint8 tensor): int32 [n]."""
        idx = idx.to(torch.int64).contiguous()
        out = torch.empty(idx.numel(), dtype=torch.int32)
        if idx.numel():
            self.native.logfmt_row_seqs(out, base, pitch, idx, hidden)
        return out

    def put_rows_streams(self, dst, local_offsets, remote_offsets, streams, row_bytes):
        """One WRITE per row, each on its own stream (LL messages: a signal counts them one by one)."""
        lo, ro, st = (t.to(torch.int64).contiguous() for t in (local_offsets, remote_offsets, streams))
        if lo.numel():
            self._writes_in_flight = True
            self._native.write_rows_streams(dst, lo, ro, st, row_bytes)

    def signal_many(self, dsts, streams, units):
        """Final signals for (dst, stream) pairs; `units` counts direct stores (proxies count their writes)."""
        self.lockstep.sending()
        dsts, streams, units = (t.to(torch.int64).contiguous() for t in (dsts, streams, units))
        direct = torch.tensor(
            [self.direct(int(d), low_latency=True) for d in range(self.num_ranks)], dtype=torch.uint8
        )[dsts].contiguous()
        self._native.signal_many(dsts, streams, units, direct)

    def consume_many(self, srcs, streams):
        """Waits for the final signal of each (src, stream) in order; returns (units, nanoseconds waited). In shrink
        mode masked sources give 0 units, and one that times out, left or is gone is masked (0 units)."""
        srcs, streams = (t.to(torch.int64).contiguous() for t in (srcs, streams))
        units = torch.empty(srcs.numel(), dtype=torch.int64)
        waited = torch.empty(srcs.numel(), dtype=torch.int64)
        self._native.consume_many(srcs, streams, units, waited, self.timeout_s, self.mask)
        return units, waited

    def masked(self, rank):
        return self.mask is not None and bool(self.mask[rank])

    def put_block(self, dst, local_offset, remote_offset, nbytes, stream):
        """One contiguous range, in commands of at most 16 MiB (the chunks of the HT internode path)."""
        chunk = MAX_COMMAND_BYTES
        full = nbytes // chunk
        if full:
            steps = torch.arange(full, dtype=torch.int64) * chunk
            self.put_rows(dst, local_offset + steps, remote_offset + steps, chunk, stream, merge=False)
        rest = nbytes - full * chunk
        if rest:
            done = full * chunk
            self.put_rows(dst, torch.tensor([local_offset + done]), torch.tensor([remote_offset + done]), rest, stream)

    def signal(self, dst, stream, direct_units=0, final=True):
        """Publish to dst's slot (this rank, stream): direct stores count `direct_units`; through the proxies the
        slot counts the WRITE commands issued on this stream since the last signal."""
        self.lockstep.sending()
        if self.direct(dst, low_latency=stream >= STREAM_LL_BASE):
            self._native.direct_signal(dst, stream, direct_units, final)
        else:
            self._native.signal(dst, stream, final)

    def consume(self, src, stream, min_units=0, need_final=True):
        return self._native.consume_signal(src, stream, min_units, need_final, self.timeout_s)

    # ---- count exchange (the notify step) ----
    def exchange_rows(self, row):
        """All-to-all of one int64 row per rank through the communication memory; returns [R, len(row)]. Each row
        carries the call's sequence number, which must be every rank's (lockstep.py)."""
        row = torch.cat([row.to(torch.int64), torch.tensor([self.lockstep.seq], dtype=torch.int64)])
        if row.numel() > self.max_count_row:
            raise ValueError(
                f"the count exchange needs {row.numel()} entries per rank, more than the "
                f"{self.max_count_row} reserved (channels <= {MAX_CHANNELS}, local experts <= "
                f"{self.max_local_experts})"
            )
        row_bytes = self.count_slot_bytes
        used = align(row.numel() * 8)
        parity = self.ht_calls % 2
        self.ht_calls += 1
        base = parity * self.num_ranks * row_bytes
        self.require_bytes(self.data_start, "the count exchange")
        mine = base + self.rank * row_bytes
        self.region[mine : mine + row.numel() * 8].view(torch.int64).copy_(row)
        self.lockstep.sending()
        for dst in range(self.num_ranks):
            if self.direct(dst):
                self.store(dst, mine, self.region[mine : mine + used])
                self._native.direct_signal(dst, STREAM_NOTIFY, 1, False)
            else:
                self.put_block(dst, mine, mine, used, STREAM_NOTIFY)
                self._native.signal(dst, STREAM_NOTIFY, False)
        for src in range(self.num_ranks):
            self.consume(src, STREAM_NOTIFY, 1, need_final=False)
        table = self.region[base : base + self.num_ranks * row_bytes].view(self.num_ranks, row_bytes)
        table = table[:, : row.numel() * 8].contiguous().view(torch.int64).clone()
        for src in range(self.num_ranks):
            self.lockstep.check_seq("the count exchange", int(table[src, -1]), src)
        return table[:, :-1]

    def require_bytes(self, needed, what):
        if needed > self.num_bytes:
            raise AgreedRefusal(
                f"the communication buffer has {self.num_bytes} bytes but {what} needs {needed} bytes "
                f"on some rank; create the Buffer with at least that many (num_nvl_bytes + "
                f"num_rdma_bytes)"
            )

    # ---- the API the Buffer calls ----
    def get_dispatch_layout(self, topk_idx, num_experts):
        return host_ht.dispatch_layout(self, topk_idx, num_experts)

    def _require_node_views(self):
        """Normal mode moves a node's traffic by loads and stores: every same-node peer must be mapped here."""
        unmapped = [d for d in self.node_ranks() if self.peer_view(d) is None]
        if unmapped:
            raise ValueError(
                f"normal-mode dispatch/combine with num_ranks_per_node={self.ranks_per_node} needs the "
                f"memory of same-node ranks {unmapped} mapped into this process, which the "
                f"{self.channel.transport} transport cannot do here (verbs maps the regions of ranks "
                f"on the same host only); use num_ranks_per_node=1, or place each node's ranks on one "
                f"host"
            )

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
        self._require_node_views()
        self.settle()
        tensors = (x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, num_tokens_per_rdma_rank)
        tensors += (is_token_in_rank, num_tokens_per_expert)
        return host_ht.dispatch(
            self, *(dense(t) for t in tensors), expert_alignment, num_worst_tokens, num_channels, dense(handle)
        )

    def combine(self, x, handle, topk_weights, bias):
        self._require_node_views()
        self.settle()
        return host_ht.combine(self, dense(x), handle, dense(topk_weights), tuple(dense(b) for b in bias))

    def low_latency_dispatch(
        self, x, topk_idx, T, E, use_fp8, round_scale, use_ue8m0, cumulative_stats, wait_stats, return_recv_hook
    ):
        self.settle()
        flags = (use_fp8, round_scale, use_ue8m0)
        return host_ll.dispatch(
            self, dense(x), dense(topk_idx), T, E, *flags, cumulative_stats, wait_stats, return_recv_hook
        )

    def low_latency_combine(
        self, x, topk_idx, topk_weights, handle, zero_copy, out, return_recv_hook, wait_stats, use_logfmt=False
    ):
        self.settle()
        return host_ll.combine(
            self,
            x,
            dense(topk_idx),
            dense(topk_weights),
            handle,
            zero_copy,
            out,
            return_recv_hook,
            wait_stats,
            use_logfmt,
        )

    def mark_checked(self, T, H, E, dispatch_flags=None):
        """The host backend has no native fast path that could skip the Buffer's checks: nothing to record."""

    def get_next_low_latency_combine_buffer(self, handle):
        return host_ll.next_combine_buffer(self, handle)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        """DeepEP's clean, which also resynchronises the ranks (lockstep.py): between two synchronisations, every
        signal slot of this rank goes back to zero but the LEFT ones and the synchronisation's own (a peer's second
        synchronisation may have arrived already), and so do the call counters."""
        self.settle()
        self.sync()
        signals = self.channel.signals
        keep = {STREAM_SYNC, self.status_stream + self.native.EVENT_LEFT}
        for begin, end in ranges_without(keep, signals.size(1)):
            signals[:, begin:end].zero_()
        self.ll_half = 0
        self.ht_calls = 0
        self.lockstep.resynced()
        self.sync()

    def sync(self):
        """Every rank that is not masked gets here (shrink mode: one that left, is gone or times out is masked),
        after everything it posted before was delivered."""
        self.channel.quiet()
        live = [r for r in range(self.num_ranks) if not self.masked(r)]
        for dst in live:
            self.signal(dst, STREAM_SYNC)
        self.consume_many(torch.tensor(live, device="cpu"), torch.full((len(live),), STREAM_SYNC, device="cpu"))

    def update_mask(self, rank, masked):
        self.mask[rank] = int(masked)

    def query_mask(self, out):
        out.copy_(self.mask.to(out.dtype))

    def clean_mask(self):
        self.mask.zero_()

    def get_local_buffer_tensor(self, dtype, size=None, offset=0, use_rdma_buffer=False):
        """A raw view of this rank's communication memory (the host backend has one memory for NVL and RDMA uses;
        use_rdma_buffer is accepted for compatibility)."""
        return byte_view(self.region[: self.num_bytes], dtype, size, offset)

    def barrier(self):
        self.channel.barrier()

    def destroy(self):
        try:  # what this rank sent goes out first; then peers waiting for it give up (or mask it)
            self.channel.quiet()
            self.channel.announce(self.native.EVENT_LEFT)
        except Exception:  # noqa: BLE001 - a failed channel has nobody to tell
            pass
        self._peer_views.clear()
        self.region = None
        self.channel.destroy()
