"""Normal (HT) mode on the CUDA backend. Kernels: gpu_kernels/cuda/ht_api.h; every offset and size of their memory:
gpu_kernels/cuda/ht_layout.h, which Python reads through native.HTLayout (no copy of it here). Each op is a notify
kernel (a count exchange, or with a handle only a flag each rank waits for) and a data kernel; a non-cached
dispatch without num_worst_tokens waits on the CPU for the notify's counts in mapped host memory to size its
outputs (as DeepEP does), everything else can be captured in a CUDA graph.

Rows travel through a ring per (channel, sender, receiver), so any buffer that holds HT_MIN_RING_ROWS rows per
ring works, DeepEP's size hints included. Same-node peers get stores through CUDA IPC; peers on other nodes get
rows staged in this rank's buffer and copied by the proxies (WRITE + SIGNAL through the device FIFOs). Across
nodes of several GPUs each a token crosses to another node once, to the rank there with the sender's local index,
which forwards it to its node peers (and in combine sums their rows into one partial per token). Results match the
host backend bit for bit (the same receive order, the same FP32 reduction order: bias, then the node's ranks
ascending, then other ranks or nodes ascending).
"""

from dataclasses import dataclass
from typing import Optional

import torch

from ..._native import require_native
from .. import common as hb
from ...handles import InternodeHandle, IntranodeHandle


@dataclass
class HTMemory:
    """What one rank's normal-mode kernels reach, given explicitly. engine_memory() fills it from a CudaEngine and
    its Channel; the loopback benchmark (bench/portep_bench/ht_loopback_ranks.py) from two buffers on one GPU.
    Memory the Channel owns stays native (HTKernels reads its regions and its same-node peers'); tensors are torch's;
    the mapped host words are native MappedHost objects. The layout: gpu_kernels/cuda/ht_layout.h."""

    rank: int
    num_ranks: int
    ranks_per_node: int
    device: torch.device
    device_sms: int  # blocks the GPU runs at once (one per SM): a data kernel needs all of its blocks running
    channel: object  # the native Channel whose regions (and same-node peers' regions) the kernels use, or None
    region: Optional[torch.Tensor]  # without a channel: uint8, this rank's buffer (control area, normal-mode area)
    signals: Optional[torch.Tensor]  # without a channel: int64 [R][num_streams], this rank's signal slots
    peers: Optional[torch.Tensor]  # without a channel: int64 [R], the regions stored into directly (all of them)
    place: torch.Tensor  # device int64 [R]: a proxy peer's region mapped here (placed WRITEs), else 0
    ctrl_off: int  # the control area, at the same offset in every rank's region
    area_off: int  # the normal-mode area: receive rings, then (proxy peers) staging rings
    area_bytes: int
    errors: object  # backends/cuda/kernel_errors.KernelErrors: the records the host reads, the words kernels test
    peer_status: object  # native.MappedHost [R] uint32 of the peer watch (proxy/peer_status.h), or None
    signal_seen: torch.Tensor  # device int64 [R][num_streams]: what the kernels consumed of each slot
    num_streams: int
    stream_base: int  # the normal mode's HT_NUM_STREAMS signal streams begin here
    fifos: object  # native.DeviceFifoSet: the device FIFOs to the proxies (None with every peer on this node)
    timeout_s: float


def engine_memory(eng, ctrl_off, stream_base):
    """A CudaEngine's HTMemory: its Channel (the region, the same-node peers' regions through CUDA IPC, the proxies'
    signal slots), its FIFOs, its kernel error words; the normal-mode area is the engine's normal_off/normal_bytes."""
    return HTMemory(
        rank=eng.rank,
        num_ranks=eng.num_ranks,
        ranks_per_node=eng.ranks_per_node,
        device=eng.device,
        device_sms=eng.device_sms,
        channel=eng.channel.native_channel,
        region=None,
        signals=None,
        peers=None,
        place=eng.place_table,
        ctrl_off=ctrl_off,
        area_off=eng.normal_off,
        area_bytes=eng.normal_bytes,
        errors=eng.errors,
        peer_status=eng.peer_status,
        signal_seen=eng.signal_seen,
        num_streams=eng.channel.num_streams,
        stream_base=stream_base,
        fifos=eng.fifos,
        timeout_s=eng.timeout_s,
    )


def ctrl_bytes(native, num_ranks, ranks_per_node):
    """(bytes of the normal mode's control area for these ranks, '') where the normal mode's limits (ht_layout.h:
    1 to HT_MAX_NODE_RANKS ranks per node, 1 to HT_MAX_NODES nodes) allow them, else (0, why not). A Buffer whose
    ranks they refuse runs the LL mode, and its first normal-mode call raises why (CudaHT)."""
    try:
        return native.ht_ctrl_layout(num_ranks, ranks_per_node)["bytes"], ""
    except ValueError as e:
        return 0, f"the CUDA normal mode: {e}"


class CudaHT:
    """One per CudaEngine, created on first use: its control area sits after the LL flags and meta blocks, its
    signal streams after the LL ones. CudaHT.from_memory builds one from an explicit HTMemory instead.

    `owner` (the CudaEngine) answers at call time: raw_stream() (where the kernels launch), launch_stream (the
    Buffer's communication stream during a call, else None: where an op's own preparation runs), lockstep.sending()
    (before each op's first kernel), check_error() (raises what a kernel reported), synchronize(). No method of an
    op synchronizes with the CPU except a dispatch without handle and without num_worst_tokens, which waits for the
    counts."""

    def __init__(self, eng, ctrl_off, stream_base):
        self._setup(eng, engine_memory(eng, ctrl_off, stream_base))

    @classmethod
    def from_memory(cls, owner, memory):
        ht = cls.__new__(cls)
        ht._setup(owner, memory)
        return ht

    def _setup(self, owner, m):
        native = self.native = require_native()
        refused = ctrl_bytes(native, m.num_ranks, m.ranks_per_node)[1]
        if refused:
            raise NotImplementedError(refused)
        self.owner, self.memory = owner, m
        self.rank, self.num_ranks, self.ranks_per_node = m.rank, m.num_ranks, m.ranks_per_node
        self.num_nodes = m.num_ranks // m.ranks_per_node
        self.device, self.device_sms, self.timeout_s = m.device, m.device_sms, m.timeout_s
        self.proxy = m.num_ranks > m.ranks_per_node  # the ranks of other nodes: through the proxies
        self.layout = native.HTLayout(
            num_ranks=m.num_ranks,
            ranks_per_node=m.ranks_per_node,
            proxy=self.proxy,
            ctrl_off=m.ctrl_off,
            area_off=m.area_off,
            area_bytes=m.area_bytes,
        )
        self.forward = self.layout.forwarding  # forwarders on each node (ht_api.h)
        self.peers = m.peers
        if m.peers is None:  # HTKernels writes it whole from the Channel with a synchronous copy: nothing may race it
            self.peers = torch.empty(m.num_ranks, dtype=torch.int64, device=m.device)
            torch.cuda.current_stream(m.device).synchronize()
        self.epoch = torch.zeros(native.HT_EPOCH_WORDS, dtype=torch.int64, device=m.device)  # HTCommon::epoch
        self.host_counts = native.MappedHost(native.HT_HOST_COUNTS_BYTES)  # the count record the CPU waits on
        self.ticket = 0
        self.kernels = native.HTKernels(
            self.layout,
            m.fifos,
            rank=m.rank,
            channel=m.channel,
            region=m.region,
            signals=m.signals,
            peers=self.peers,
            place=m.place,
            epoch=self.epoch,
            host_counts=self.host_counts,
            errors=m.errors.records,
            failed=m.errors.words,
            peer_status=m.peer_status,
            signal_seen=m.signal_seen,
            num_streams=m.num_streams,
            stream_base=m.stream_base,
            timeout_s=m.timeout_s,
        )
        owner.synchronize()  # epoch, peers in place before any kernel reads them; earlier ops done
        self._load_torch_kernels()

    def _load_torch_kernels(self):
        """Launches once, while this Buffer runs nothing, the torch kernels an op queues behind its own: with
        CUDA's lazy module loading (the default) a kernel's first launch waits for running kernels and holds up the
        proxies' copy calls meanwhile, so a notify or data kernel waiting for those copies would time out."""
        dev, R = self.device, self.num_ranks
        torch.empty(1, 2, dtype=torch.int64, device=dev).fill_(-1)
        torch.empty(1, 2, dtype=torch.float32, device=dev).zero_()
        in_rank = torch.ones(1, R, dtype=torch.bool, device=dev)
        if self.forward:
            torch.full((1, self.native.HT_NVL_HEAD_COLUMNS), -1, dtype=torch.int32, device=dev)
            meta = torch.empty(1, 2, dtype=torch.int32, device=dev).fill_(-1)
            self._forwarding_tensors(
                in_rank, torch.zeros(R, dtype=torch.int32, device=dev), None, None, (None, None, None), meta, None
            )
        elif self.num_nodes > 1:  # one row from every rank to every rank
            prefix = torch.arange(1, R + 1, dtype=torch.int32, device=dev)
            ones = torch.ones(R, 1, dtype=torch.int32, device=dev)
            head = torch.zeros(1, R, dtype=torch.int32, device=dev)
            for self_rows in ((self.rank, 1), None):
                self._internode_tensors(in_rank, prefix, ones, ones, head, R, self_rows)

    def destroy(self):
        self.host_counts.close()

    def _on_comm(self):
        """Where this op's own preparation runs (input copies, fills, the internode handle): the stream its kernels
        run on, so they are ordered, and temporaries go back to that stream's pool (no record_stream). Outside a
        Buffer call (launch_stream None) this leaves the current stream as it is."""
        return torch.cuda.stream(self.owner.launch_stream)

    def _for_caller(self, tensors):
        """Tensors made on the communication stream and handed to the caller, kept for the current stream too."""
        if self.owner.launch_stream is not None and not torch.cuda.is_current_stream_capturing():
            compute = torch.cuda.current_stream(self.device)
            for t in tensors:
                t.record_stream(compute)
        return tensors

    def _check_handle(self, handle):
        for i, (field, t) in enumerate(zip(handle._fields, handle)):
            if t.device != self.device or not t.is_contiguous():
                raise ValueError(
                    f"handle[{i}] ({field}) is a {'contiguous' if t.is_contiguous() else 'non-contiguous'} tensor "
                    f"on {t.device}; a dispatch handle of this Buffer holds contiguous tensors on "
                    f"{self.device} (pass the handle dispatch returned)"
                )

    def _recv_prefix(self, handle):
        """The rows from sources 0..s to this rank (inclusive) in a handle, as the kernels take them: the internode
        handle's vector (recv_prefix), else the intranode handle's [R][R] matrix, whose column `rank` they read."""
        if self.num_nodes > 1:
            return dict(recv_prefix=handle.recv_gbl_rank_prefix_sum)
        return dict(rank_prefix_matrix=handle.rank_prefix_matrix)

    def _forward_prefixes(self, handle):
        """(fwd_channel_prefix, fwd_rank_prefix) of an internode handle with forwarding, else (None, None)."""
        if not self.forward:
            return None, None
        return handle.recv_rdma_channel_prefix_matrix, handle.recv_rdma_rank_prefix_sum

    def _notify(self, num_channels, stream, **count):
        """The op's first kernel; count: the count mode's arguments (native HTKernels.notify), none for a flag."""
        self.owner.lockstep.sending()
        self.kernels.notify(channels=num_channels, stream=stream, **count)

    def exchange_flags(self, num_channels, is_token_in_rank=None):
        """The notify kernel of a cached dispatch or a combine alone, on raw_stream(): advances the op count on every
        rank that calls it (all must); benchmarks time it. (is_token_in_rank: unused, a flag carries no counts.)"""
        self._notify(num_channels, self.owner.raw_stream())

    def _check_channels(self, num_channels, what):
        """Every block of a data kernel must run at once (senders wait for readers): 2 per channel (3 with
        forwarding), one per SM."""
        sms, per = self.device_sms, self.layout.blocks_per_channel
        if per * num_channels > sms:
            raise ValueError(
                f"{what}: {num_channels} channels (config.num_sms={2 * num_channels}) need "
                f"{per * num_channels} SMs at once ({per} blocks per channel); this GPU has {sms}: use "
                f"config.num_sms <= {2 * (sms // per)}"
            )

    def _ring_rows(self, row_bytes, num_channels, what):
        """Rows per (channel, peer) ring for rows of row_bytes (ht_layout.h: as many whole chunks as the receive
        area holds); the kernels size their rings the same way. The same on every rank (same buffer size, same
        rows), so every rank raises here alike, before any kernel."""
        least, layout = self.native.HT_MIN_RING_ROWS, self.layout
        rows = layout.rows_per_ring(row_bytes, num_channels)
        if rows < least:
            need = layout.area_bytes_for(least, row_bytes, num_channels)
            raise ValueError(
                f"{what}: the normal-mode buffer ({layout.area_bytes} bytes) holds {rows} rows of "
                f"{row_bytes} bytes per (channel, peer) ring with {num_channels} channels; at least "
                f"{least} rows are needed: give the normal mode >= {need} bytes (num_nvl_bytes; "
                "num_nvl_bytes + num_rdma_bytes when low_latency_mode=False or one of them is 0), or "
                "use fewer channels (config.num_sms)"
            )
        return rows

    def _check_rows(self, row_bytes, num_channels, what):
        """The op's rows of row_bytes fit: a proxy WRITE of whole chunks, all data blocks at once, the rings."""
        chunk = self.layout.chunk_bytes(row_bytes)
        if self.proxy and chunk > self.native.HT_MAX_WRITE_BYTES:
            raise ValueError(
                f"{what}: rows of {row_bytes} bytes travel through the proxies in WRITEs of "
                f"{self.native.HT_CHUNK_ROWS} rows, {chunk} bytes, above the "
                f"{self.native.HT_MAX_WRITE_BYTES} bytes a command moves"
            )
        self._check_channels(num_channels, what)
        self._ring_rows(row_bytes, num_channels, what)

    # ---- dispatch ----
    def dispatch(
        self,
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
    ):
        stream = self.owner.raw_stream()
        R, N, dev, me = self.num_ranks, x.size(0), self.device, self.rank
        with self._on_comm():
            x = x.contiguous()
            scales = None if x_scales is None else x_scales.contiguous()
            if topk_idx is not None:
                topk_idx = topk_idx.to(torch.int64).contiguous()
                topk_weights = topk_weights.to(torch.float32).contiguous()
            if handle is None:
                is_token_in_rank = is_token_in_rank.contiguous()
                per_expert = num_tokens_per_expert.to(torch.int32).contiguous()
        K = 0 if topk_idx is None else topk_idx.size(1)
        S = 0 if scales is None else scales.size(1)
        row_bytes = x.size(1) * x.element_size()
        self._check_rows(self.layout.dispatch_row_bytes(row_bytes, S, K), num_channels, "dispatch")
        counts_list, self_rows, forward_rows = [], None, 0
        cached = handle is not None
        fwd = (None, None, None)  # forwarding: node_channel_prefix, fwd_channel_prefix, fwd_rank_prefix
        if cached:
            self._check_handle(handle)
            is_token_in_rank, channel_prefix = handle.is_token_in_rank, handle.send_channel_prefix
            rcp = handle.recv_channel_prefix
            if self.forward:
                fwd = (None, handle.recv_rdma_channel_prefix_matrix, handle.recv_rdma_rank_prefix_sum)
            num_recv = handle.num_recv_tokens
            if 0 < num_worst_tokens < num_recv:
                raise RuntimeError(
                    f"rank {me} receives {num_recv} tokens with this handle but num_worst_tokens={num_worst_tokens}"
                )
            recv_prefix = self._recv_prefix(handle)
            self._notify(num_channels, stream)
            num_recv = max(num_recv, num_worst_tokens)
        else:
            E = num_tokens_per_expert.numel()
            recv_rank_prefix = torch.empty(R, dtype=torch.int32, device=dev)  # rows from sources 0..s, inclusive
            rank_prefix = torch.empty(R, R, dtype=torch.int32, device=dev) if self.num_nodes == 1 else None
            channel_prefix = torch.empty(R, num_channels, dtype=torch.int32, device=dev)
            rcp = torch.empty(R, num_channels, dtype=torch.int32, device=dev)
            if self.forward:
                Nn = self.num_nodes
                fwd = (
                    torch.empty(Nn, num_channels, dtype=torch.int32, device=dev),
                    torch.empty(Nn, num_channels, dtype=torch.int32, device=dev),
                    torch.empty(Nn, dtype=torch.int32, device=dev),
                )
            recv_prefix = dict(recv_prefix=recv_rank_prefix)
            count = dict(
                count_mode=True,
                is_token_in_rank=is_token_in_rank,
                tokens_per_expert=per_expert,
                num_tokens=N,
                num_experts=E,
                recv_rank_prefix=recv_rank_prefix,
                rank_prefix=rank_prefix,
                channel_prefix=channel_prefix,
                recv_channel_prefix=rcp,
                node_channel_prefix=fwd[0],
                fwd_channel_prefix=fwd[1],
                fwd_rank_prefix=fwd[2],
            )
            if num_worst_tokens > 0:
                self._notify(num_channels, stream, max_recv=num_worst_tokens, **count)
                num_recv = num_worst_tokens
                forward_rows = num_worst_tokens * self.ranks_per_node  # each row reaches a local rank
            else:
                self.ticket += 1
                self._notify(num_channels, stream, ticket=self.ticket, **count)
                num_recv, self_rows, forward_rows, counts_list = self._wait_counts(E // R, expert_alignment)
        rows = num_recv
        recv_x = torch.empty(rows, x.size(1), dtype=x.dtype, device=dev)
        recv_scales = None if scales is None else torch.empty(rows, S, dtype=scales.dtype, device=dev)
        recv_idx = recv_w = src_idx = send_head = meta = nvl_head = None
        if not cached:
            if K:
                recv_idx = torch.empty(rows, K, dtype=torch.int64, device=dev)
                recv_w = torch.empty(rows, K, dtype=torch.float32, device=dev)
                with self._on_comm():  # before the kernel, which writes the real rows
                    recv_idx.fill_(-1)
                    recv_w.zero_()
            if self.forward:
                meta = torch.empty(rows, 2, dtype=torch.int32, device=dev)
                with self._on_comm():  # the kernel writes the real rows, and the local ranks' columns of nvl_head
                    if num_worst_tokens > 0:
                        meta.fill_(-1)
                    nvl_head = torch.full(
                        (forward_rows, self.native.HT_NVL_HEAD_COLUMNS), -1, dtype=torch.int32, device=dev
                    )
            else:
                src_idx = torch.empty(rows, dtype=torch.int32, device=dev)
                send_head = torch.empty(N, R, dtype=torch.int32, device=dev)
        self.kernels.dispatch(
            channels=num_channels,
            stream=stream,
            x=x,
            row_bytes=row_bytes,
            num_tokens=N,
            is_token_in_rank=is_token_in_rank,
            **recv_prefix,
            channel_prefix=channel_prefix,
            recv_channel_prefix=rcp,
            max_recv=rows,
            recv_x=recv_x,
            scales=scales,
            num_scales=S,
            recv_scales=recv_scales,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            num_topk=K,
            num_local_experts=0 if cached else num_tokens_per_expert.numel() // R,
            recv_topk_idx=recv_idx,
            recv_topk_weights=recv_w,
            recv_src_idx=src_idx,
            send_head=send_head,
            fwd_channel_prefix=fwd[1],
            fwd_rank_prefix=fwd[2],
            recv_src_meta=meta,
            nvl_head=nvl_head,
            nvl_rows=0 if nvl_head is None else nvl_head.size(0),
        )
        if cached:
            return recv_x, recv_scales, None, None, None, None
        if self.forward:
            new_handle = self._forwarding_handle(
                is_token_in_rank, recv_rank_prefix, channel_prefix, rcp, fwd, meta, nvl_head
            )
        elif self.num_nodes > 1:
            new_handle = self._internode_handle(
                is_token_in_rank, recv_rank_prefix, channel_prefix, rcp, send_head, rows, self_rows
            )
        else:
            new_handle = IntranodeHandle(rank_prefix, channel_prefix, rcp, src_idx, is_token_in_rank, send_head)
        return recv_x, recv_scales, recv_idx, recv_w, counts_list, new_handle

    def _forwarding_handle(self, is_token_in_rank, recv_rank_prefix, channel_prefix, rcp, fwd, meta, nvl_head):
        """DeepEP's 10-tuple with forwarders (ht_api.h). send_nvl_head holds, per row this rank forwards, the row's
        index among its source's rows of its channel to each local rank (-1: not sent there)."""
        with self._on_comm():  # reads what the kernels wrote
            h = self._forwarding_tensors(is_token_in_rank, recv_rank_prefix, channel_prefix, rcp, fwd, meta, nvl_head)
        self._for_caller([h.recv_gbl_rank_prefix_sum, h.send_rdma_head, h.send_nvl_head])
        return h

    def _forwarding_tensors(self, is_token_in_rank, recv_rank_prefix, channel_prefix, rcp, fwd, meta, nvl_head):
        N = is_token_in_rank.size(0)
        to_node = is_token_in_rank.view(N, self.num_nodes, self.ranks_per_node).any(2)
        return InternodeHandle(
            is_token_in_rank,
            fwd[0],
            channel_prefix,
            fwd[1],
            fwd[2],
            rcp,
            recv_rank_prefix,
            meta.view(torch.uint8),
            hb.positions(to_node),
            nvl_head,
        )

    def _wait_counts(self, E_l, expert_alignment):
        got = self.kernels.wait_counts(self.ticket, E_l)
        if got is None:
            self.owner.check_error()
            raise RuntimeError(
                f"rank {self.rank}: dispatch: the count exchange did not finish within "
                f"{self.timeout_s} s (a peer rank did not call dispatch?)"
            )
        num_recv, self_begin, self_rows, forward_rows, experts = got
        a = expert_alignment
        return num_recv, (self_begin, self_rows), forward_rows, [(int(c) + a - 1) // a * a for c in experts]

    def _internode_handle(self, is_token_in_rank, recv_prefix, channel_prefix, rcp, send_head, rows, self_rows):
        """DeepEP's 10-tuple for one rank per node (node = rank): the forwarder is the destination itself. With
        num_worst_tokens (self_rows None) recv_src_meta and send_nvl_head keep a row per output row: this rank's own
        rows and the padding have -1 in send_nvl_head."""
        with self._on_comm():  # reads what the notify kernel wrote
            h = self._internode_tensors(is_token_in_rank, recv_prefix, channel_prefix, rcp, send_head, rows, self_rows)
        self._for_caller([h.recv_rdma_rank_prefix_sum, h.recv_src_meta, h.send_nvl_head])
        return h

    def _internode_tensors(self, is_token_in_rank, recv_prefix, channel_prefix, rcp, send_head, rows, self_rows):
        me, dev = self.rank, self.device
        row = torch.arange(rows, dtype=torch.int32, device=dev)
        src = torch.searchsorted(recv_prefix, row, right=True).to(torch.int32)  # the source rank of each row
        begins = torch.cat([torch.zeros(1, dtype=torch.int32, device=dev), recv_prefix])
        meta = torch.stack([src, torch.ones_like(src)], 1).contiguous().view(torch.uint8)  # [rows, 8]: node, mask
        in_block = row - begins[src.clamp(max=recv_prefix.numel())]
        nvl_head = torch.full((rows, self.native.HT_NVL_HEAD_COLUMNS), -1, dtype=torch.int32, device=dev)
        nvl_head[:, 0] = torch.where(src == me, -1, in_block)
        if self_rows is not None:  # the rows this rank forwards are those of other nodes only
            begin, n = self_rows
            nvl_head = torch.cat([nvl_head[:begin], nvl_head[begin + n :]])
        return InternodeHandle(
            is_token_in_rank,
            channel_prefix,
            channel_prefix,
            rcp,
            recv_prefix,
            rcp,
            recv_prefix,
            meta,
            send_head,
            nvl_head,
        )

    # ---- combine ----
    def combine(self, x, handle, topk_weights, bias):
        stream = self.owner.raw_stream()
        self._check_handle(handle)
        is_token_in_rank, channel_prefix = handle.is_token_in_rank, handle.send_channel_prefix
        rcp = handle.recv_channel_prefix
        N, H = is_token_in_rank.size(0), x.size(1)
        C = channel_prefix.size(1)
        K = 0 if topk_weights is None else topk_weights.size(1)
        self._check_rows(self.layout.combine_row_bytes(H, K), C, "combine")  # with forwarding, partial rows (FP32)
        with self._on_comm():
            x = x.contiguous()
            weights = None if topk_weights is None else topk_weights.to(torch.float32).contiguous()
            b0 = bias[0].contiguous() if len(bias) > 0 else None
            b1 = bias[1].contiguous() if len(bias) > 1 else None
        out = torch.empty(N, H, dtype=torch.bfloat16, device=self.device)
        out_w = torch.empty(N, K, dtype=torch.float32, device=self.device) if weights is not None else None
        recv_prefix = self._recv_prefix(handle)
        fwd_channel_prefix, fwd_rank_prefix = self._forward_prefixes(handle)
        self._notify(C, stream)
        self.kernels.combine(
            channels=C,
            stream=stream,
            x=x,
            hidden=H,
            num_tokens=N,
            is_token_in_rank=is_token_in_rank,
            **recv_prefix,
            recv_channel_prefix=rcp,
            out=out,
            topk_weights=weights,
            num_topk=K,
            out_weights=out_w,
            bias0=b0,
            bias1=b1,
            fwd_channel_prefix=fwd_channel_prefix,
            fwd_rank_prefix=fwd_rank_prefix,
            nvl_head=handle.send_nvl_head if self.forward else None,
        )
        return out, out_w
