"""Normal (HT) mode on the CUDA backend. Kernels and layouts: gpu_kernels/cuda/ht_api.h. Each op is a notify
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

import ctypes

import torch

from .. import common as hb


def _ptr(t):
    return 0 if t is None else t.data_ptr()


class CudaHT:
    """One per CudaEngine, created on first use. Its control area sits after the LL flags and meta blocks; its
    signal streams after the LL ones."""

    def __init__(self, eng, ctrl_off, stream_base):
        native = eng.native
        R = eng.num_ranks
        if R > native.HT_MAX_RANKS:
            raise NotImplementedError(f"the CUDA HT kernels support at most {native.HT_MAX_RANKS} ranks, got {R}")
        ch = eng.channel._native
        peers = [ch.peer_data_ptr(d) if eng.node_of(d) == eng.node else 0 for d in range(R)]
        unmapped = [d for d in range(R) if eng.node_of(d) == eng.node and not peers[d]]
        if unmapped:
            raise NotImplementedError(f"normal mode on GPU tensors needs the buffers of same-node ranks mapped (CUDA "
                                      f"IPC); transport {eng.channel.transport!r} did not map ranks {unmapped}")
        self.eng = eng
        self.forward = eng.num_nodes > 1 and eng.ranks_per_node > 1  # forwarders on each node (ht_api.h)
        self.proxy = not all(peers)
        area = eng.normal_bytes  # from eng.normal_off: receive rings, then (proxy peers) as many staging bytes
        self.recv_bytes = area // 2 // 16 * 16 if self.proxy else area
        self.peers = torch.tensor(peers, dtype=torch.int64, device=eng.device)
        self.epoch = torch.zeros(2, dtype=torch.int64, device=eng.device)  # ops so far; data kernels stop (ht_api.h)
        self.host_counts, host_counts_device = native.cuda_host_alloc_mapped(native.HT_HOST_COUNTS_BYTES)
        ctypes.memset(self.host_counts, 0, native.HT_HOST_COUNTS_BYTES)
        self.ticket = 0
        self.kernels = native.HTKernels(
            eng.rank, R, eng.ranks_per_node, ch.device_data_ptr(), self.peers.data_ptr(), eng._place.data_ptr(),
            ctrl_off, eng.normal_off,
            eng.normal_off + self.recv_bytes, self.epoch.data_ptr(), self.host_counts, host_counts_device,
            eng.error_device, eng.errors.host, eng.timeout_s, eng.fifos, ch.device_signals_ptr(),
            eng._signal_seen.data_ptr(), eng.channel.num_streams, stream_base, eng.failed_flag.data_ptr(),
            eng.status_device)
        eng.synchronize()  # epoch, peers in place before any kernel reads them; earlier ops done
        self._load_torch_kernels()

    def _load_torch_kernels(self):
        """Launches once, while this Buffer runs nothing, the torch kernels an op queues behind its own: with
        CUDA's lazy module loading (the default) a kernel's first launch waits for running kernels and holds up the
        proxies' copy calls meanwhile, so a notify or data kernel waiting for those copies would time out."""
        dev, R = self.eng.device, self.eng.num_ranks
        torch.empty(1, 2, dtype=torch.int64, device=dev).fill_(-1)
        torch.empty(1, 2, dtype=torch.float32, device=dev).zero_()
        in_rank = torch.ones(1, R, dtype=torch.bool, device=dev)
        if self.forward:
            torch.full((1, self.eng.native.HT_NVL_HEAD_COLUMNS), -1, dtype=torch.int32, device=dev)
            meta = torch.empty(1, 2, dtype=torch.int32, device=dev).fill_(-1)
            self._forwarding_tensors(in_rank, torch.zeros(R, R, dtype=torch.int32, device=dev), None, None,
                                     (None, None, None), meta, None)
        elif self.eng.num_nodes > 1:  # one row from every rank to every rank
            prefix = torch.arange(1, R + 1, dtype=torch.int32, device=dev).repeat_interleave(R).view(R, R)
            ones = torch.ones(R, 1, dtype=torch.int32, device=dev)
            head = torch.zeros(1, R, dtype=torch.int32, device=dev)
            for self_rows in ((self.eng.rank, 1), None):
                self._internode_tensors(in_rank, prefix, ones, ones, head, R, self_rows)

    def destroy(self):
        if self.host_counts:
            self.eng.native.cuda_host_free_mapped(self.host_counts)
            self.host_counts = 0

    def _on_comm(self):
        """Where this op's own preparation runs (input copies, fills, the internode handle): the stream its kernels
        run on, so they are ordered, and temporaries go back to that stream's pool (no record_stream). Outside a
        Buffer call (launch_stream None) this leaves the current stream as it is."""
        return torch.cuda.stream(self.eng.launch_stream)

    def _for_caller(self, tensors):
        """Tensors made on the communication stream and handed to the caller, kept for the current stream too."""
        if self.eng.launch_stream is not None and not torch.cuda.is_current_stream_capturing():
            compute = torch.cuda.current_stream(self.eng.device)
            for t in tensors:
                t.record_stream(compute)
        return tensors

    def _check_handle(self, handle):
        for i, t in enumerate(handle):
            if t.device != self.eng.device or not t.is_contiguous():
                raise ValueError(f"handle[{i}] is a {'contiguous' if t.is_contiguous() else 'non-contiguous'} tensor "
                                 f"on {t.device}; a dispatch handle of this Buffer holds contiguous tensors on "
                                 f"{self.eng.device} (pass the handle dispatch returned)")

    def _recv_prefix(self, handle):
        """(pointer, stride) of the rows from sources 0..s to this rank (inclusive), from a handle."""
        if self.eng.num_nodes > 1:
            return handle[6].data_ptr(), 1
        return handle[0].data_ptr() + 4 * self.eng.rank, self.eng.num_ranks

    def _forward_prefixes(self, handle):
        """(fwd_channel_prefix, fwd_rank_prefix) pointers of an internode handle with forwarding, else (0, 0)."""
        return (handle[3].data_ptr(), handle[4].data_ptr()) if self.forward else (0, 0)

    def _notify(self, num_channels, stream, count_mode, is_token_in_rank, per_expert=None, N=0, E=0,
                prefixes=(None,) * 6, max_recv=0, ticket=0):
        self.eng.lockstep.sending()
        self.kernels.notify(num_channels, stream, count_mode, is_token_in_rank.data_ptr(), _ptr(per_expert), N, E,
                            *(_ptr(p) for p in prefixes), max_recv, ticket)

    def _check_channels(self, num_channels, what):
        """Every block of a data kernel must run at once (senders wait for readers): 2 per channel (3 with
        forwarding), one per SM."""
        sms, eng = self.eng.device_sms, self.eng
        per = eng.native.ht_blocks_per_channel(eng.num_ranks, eng.ranks_per_node)
        if per * num_channels > sms:
            raise ValueError(f"{what}: {num_channels} channels (config.num_sms={2 * num_channels}) need "
                             f"{per * num_channels} SMs at once ({per} blocks per channel); this GPU has {sms}: use "
                             f"config.num_sms <= {2 * (sms // per)}")

    def _ring_rows(self, row_bytes, num_channels, what):
        """Rows per (channel, peer) ring for rows of row_bytes (ht_api.h): as many as the receive area (and the
        staging area, which is as large) holds, in whole chunks. The same on every rank (same buffer size, same
        rows), so every rank raises here alike, before any kernel."""
        native, R = self.eng.native, self.eng.num_ranks
        chunk, least = native.HT_CHUNK_ROWS, native.HT_MIN_RING_ROWS
        if R == 1:
            return least
        rings = (R - 1 + (self.eng.ranks_per_node if self.forward else 0)) * num_channels
        rows = rows_per_ring(self.recv_bytes, rings, row_bytes, chunk)
        if rows < least:
            need = least * rings * row_bytes * (2 if self.proxy else 1)
            raise ValueError(f"{what}: the normal-mode buffer ({self.eng.normal_bytes} bytes) holds {rows} rows of "
                             f"{row_bytes} bytes per (channel, peer) ring with {num_channels} channels; at least "
                             f"{least} rows are needed: give the normal mode >= {need} bytes (num_nvl_bytes; "
                             "num_nvl_bytes + num_rdma_bytes when low_latency_mode=False or one of them is 0), or "
                             "use fewer channels (config.num_sms)")
        return rows

    # ---- dispatch ----
    def dispatch(self, x, x_scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert, expert_alignment,
                 num_worst_tokens, num_channels, handle):
        eng = self.eng
        stream = eng.raw_stream()
        R, N, dev, me = eng.num_ranks, x.size(0), eng.device, eng.rank
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
        rec = _record_bytes(x, scales, K)
        self._check_row(rec, "dispatch")
        self._check_channels(num_channels, "dispatch")
        ring_rows = self._ring_rows(rec, num_channels, "dispatch")
        counts_list, self_rows, forward_rows = [], None, 0
        cached = handle is not None
        fwd = (None, None, None)  # forwarding: node_channel_prefix, fwd_channel_prefix, fwd_rank_prefix
        if cached:
            self._check_handle(handle)
            internode = eng.num_nodes > 1
            is_token_in_rank, channel_prefix, rcp = ((handle[0], handle[2], handle[5]) if internode else
                                                     (handle[4], handle[1], handle[2]))
            if self.forward:
                fwd = (None, handle[3], handle[4])
            num_recv = (handle[7] if internode else handle[3]).size(0)
            if 0 < num_worst_tokens < num_recv:
                raise RuntimeError(f"rank {me} receives {num_recv} tokens with this handle but "
                                   f"num_worst_tokens={num_worst_tokens}")
            recv_prefix = self._recv_prefix(handle)
            self._notify(num_channels, stream, False, is_token_in_rank)
            num_recv = max(num_recv, num_worst_tokens)
        else:
            E = num_tokens_per_expert.numel()
            rank_prefix = torch.empty(R, R, dtype=torch.int32, device=dev)
            channel_prefix = torch.empty(R, num_channels, dtype=torch.int32, device=dev)
            rcp = torch.empty(R, num_channels, dtype=torch.int32, device=dev)
            if self.forward:
                Nn = eng.num_nodes
                fwd = (torch.empty(Nn, num_channels, dtype=torch.int32, device=dev),
                       torch.empty(Nn, num_channels, dtype=torch.int32, device=dev),
                       torch.empty(Nn, dtype=torch.int32, device=dev))
            prefixes = (rank_prefix, channel_prefix, rcp) + fwd
            recv_prefix = (rank_prefix.data_ptr() + 4 * me, R)
            if num_worst_tokens > 0:
                self._notify(num_channels, stream, True, is_token_in_rank, per_expert, N, E, prefixes,
                             max_recv=num_worst_tokens)
                num_recv = num_worst_tokens
                forward_rows = num_worst_tokens * eng.ranks_per_node  # each row reaches a local rank
            else:
                self.ticket += 1
                self._notify(num_channels, stream, True, is_token_in_rank, per_expert, N, E, prefixes,
                             ticket=self.ticket)
                num_recv, self_rows, forward_rows, counts_list = self._wait_counts(E // R, expert_alignment)
        rows = num_recv
        recv_x = torch.empty(rows, x.size(1), dtype=x.dtype, device=dev)
        recv_scales = None if scales is None else torch.empty(rows, scales.size(1), dtype=scales.dtype, device=dev)
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
                    nvl_head = torch.full((forward_rows, self.eng.native.HT_NVL_HEAD_COLUMNS), -1, dtype=torch.int32,
                                          device=dev)
            else:
                src_idx = torch.empty(rows, dtype=torch.int32, device=dev)
                send_head = torch.empty(N, R, dtype=torch.int32, device=dev)
        E_l = 0 if cached else num_tokens_per_expert.numel() // R
        self.kernels.dispatch(num_channels, stream, x.data_ptr(), _ptr(scales), _ptr(topk_idx), _ptr(topk_weights),
                              is_token_in_rank.data_ptr(), recv_prefix[0], recv_prefix[1], channel_prefix.data_ptr(),
                              rcp.data_ptr(), N, x.size(1) * x.element_size(),
                              0 if scales is None else scales.size(1), K, E_l, ring_rows, rows, recv_x.data_ptr(),
                              _ptr(recv_scales), _ptr(recv_idx), _ptr(recv_w), _ptr(src_idx), _ptr(send_head),
                              _ptr(fwd[1]), _ptr(fwd[2]), _ptr(meta), _ptr(nvl_head),
                              0 if nvl_head is None else nvl_head.size(0))
        if cached:
            return recv_x, recv_scales, None, None, None, None
        if self.forward:
            new_handle = self._forwarding_handle(is_token_in_rank, rank_prefix, channel_prefix, rcp, fwd, meta,
                                                 nvl_head)
        elif eng.num_nodes > 1:
            new_handle = self._internode_handle(is_token_in_rank, rank_prefix, channel_prefix, rcp, send_head, rows,
                                                self_rows)
        else:
            new_handle = (rank_prefix, channel_prefix, rcp, src_idx, is_token_in_rank, send_head)
        return recv_x, recv_scales, recv_idx, recv_w, counts_list, new_handle

    def _forwarding_handle(self, is_token_in_rank, rank_prefix, channel_prefix, rcp, fwd, meta, nvl_head):
        """DeepEP's 10-tuple with forwarders (ht_api.h). send_nvl_head holds, per row this rank forwards, the row's
        index among its source's rows of its channel to each local rank (-1: not sent there)."""
        with self._on_comm():  # reads what the kernels wrote
            h = self._forwarding_tensors(is_token_in_rank, rank_prefix, channel_prefix, rcp, fwd, meta, nvl_head)
        self._for_caller([h[6], h[8], h[9]])
        return h

    def _forwarding_tensors(self, is_token_in_rank, rank_prefix, channel_prefix, rcp, fwd, meta, nvl_head):
        eng = self.eng
        N = is_token_in_rank.size(0)
        to_node = is_token_in_rank.view(N, eng.num_nodes, eng.ranks_per_node).any(2)
        return (is_token_in_rank, fwd[0], channel_prefix, fwd[1], fwd[2], rcp, rank_prefix[:, eng.rank].contiguous(),
                meta.view(torch.uint8), hb.positions(to_node), nvl_head)

    def _check_row(self, row_bytes, what):
        chunk = self.eng.native.HT_CHUNK_ROWS * row_bytes
        if self.proxy and chunk > 16 << 20:
            raise ValueError(f"{what}: rows of {row_bytes} bytes travel through the proxies in WRITEs of "
                             f"{self.eng.native.HT_CHUNK_ROWS} rows, {chunk} bytes, above the 16 MiB a command moves")

    def _wait_counts(self, E_l, expert_alignment):
        eng = self.eng
        got = self.kernels.wait_counts(self.ticket, E_l)
        if got is None:
            eng.check_error()
            raise RuntimeError(f"rank {eng.rank}: dispatch: the count exchange did not finish within "
                               f"{eng.timeout_s} s (a peer rank did not call dispatch?)")
        num_recv, self_begin, self_rows, forward_rows, experts = got
        a = expert_alignment
        return num_recv, (self_begin, self_rows), forward_rows, [(int(c) + a - 1) // a * a for c in experts]

    def _internode_handle(self, is_token_in_rank, rank_prefix, channel_prefix, rcp, send_head, rows, self_rows):
        """DeepEP's 10-tuple for one rank per node (node = rank): the forwarder is the destination itself. With
        num_worst_tokens (self_rows None) recv_src_meta and send_nvl_head keep a row per output row: this rank's own
        rows and the padding have -1 in send_nvl_head."""
        with self._on_comm():  # reads what the notify kernel wrote
            h = self._internode_tensors(is_token_in_rank, rank_prefix, channel_prefix, rcp, send_head, rows,
                                        self_rows)
        self._for_caller([h[4], h[7], h[9]])
        return h

    def _internode_tensors(self, is_token_in_rank, rank_prefix, channel_prefix, rcp, send_head, rows, self_rows):
        me, dev = self.eng.rank, self.eng.device
        recv_prefix = rank_prefix[:, me].contiguous()
        row = torch.arange(rows, dtype=torch.int32, device=dev)
        src = torch.searchsorted(recv_prefix, row, right=True).to(torch.int32)  # the source rank of each row
        begins = torch.cat([torch.zeros(1, dtype=torch.int32, device=dev), recv_prefix])
        meta = torch.stack([src, torch.ones_like(src)], 1).contiguous().view(torch.uint8)  # [rows, 8]: node, mask
        in_block = row - begins[src.clamp(max=recv_prefix.numel())]
        nvl_head = torch.full((rows, 8), -1, dtype=torch.int32, device=dev)
        nvl_head[:, 0] = torch.where(src == me, -1, in_block)
        if self_rows is not None:  # the rows this rank forwards are those of other nodes only
            begin, n = self_rows
            nvl_head = torch.cat([nvl_head[:begin], nvl_head[begin + n:]])
        return (is_token_in_rank, channel_prefix, channel_prefix, rcp, recv_prefix, rcp, recv_prefix, meta, send_head,
                nvl_head)

    # ---- combine ----
    def combine(self, x, handle, topk_weights, bias):
        eng = self.eng
        stream = eng.raw_stream()
        self._check_handle(handle)
        if eng.num_nodes > 1:
            is_token_in_rank, channel_prefix, rcp = handle[0], handle[2], handle[5]
        else:
            _, channel_prefix, rcp, _, is_token_in_rank, _ = handle
        N, H = is_token_in_rank.size(0), x.size(1)
        C = channel_prefix.size(1)
        K = 0 if topk_weights is None else topk_weights.size(1)
        row_bytes = hb.align((4 if self.forward else 2) * H + 4 * K, 16)  # with forwarding, partial rows (FP32)
        self._check_row(row_bytes, "combine")
        self._check_channels(C, "combine")
        ring_rows = self._ring_rows(row_bytes, C, "combine")
        with self._on_comm():
            x = x.contiguous()
            weights = None if topk_weights is None else topk_weights.to(torch.float32).contiguous()
            b0 = bias[0].contiguous() if len(bias) > 0 else None
            b1 = bias[1].contiguous() if len(bias) > 1 else None
        out = torch.empty(N, H, dtype=torch.bfloat16, device=eng.device)
        out_w = torch.empty(N, K, dtype=torch.float32, device=eng.device) if weights is not None else None
        recv_prefix = self._recv_prefix(handle)
        fwd_channel_prefix, fwd_rank_prefix = self._forward_prefixes(handle)
        nvl_head = handle[9].data_ptr() if self.forward else 0
        self._notify(C, stream, False, is_token_in_rank)
        self.kernels.combine(C, stream, x.data_ptr(), _ptr(weights), _ptr(b0), _ptr(b1), is_token_in_rank.data_ptr(),
                             recv_prefix[0], recv_prefix[1], rcp.data_ptr(), fwd_channel_prefix, fwd_rank_prefix,
                             nvl_head, N, H, K, ring_rows, out.data_ptr(), _ptr(out_w))
        return out, out_w


def rows_per_ring(recv_bytes, num_rings, row_bytes, chunk_rows):
    """Whole chunks of rows of row_bytes that fit each of the num_rings rings of a receive area of recv_bytes
    (ht_api.h: (num_ranks - 1) x num_channels, with forwarding (num_ranks - 1 + ranks_per_node) x num_channels),
    capped where the kernels' 32-bit row counts need it."""
    return min(recv_bytes // (num_rings * row_bytes) // chunk_rows * chunk_rows, 1 << 30)


def _record_bytes(x, scales, K):
    """A dispatch record's bytes (ht_api.h): header, row, scales, top-k ids from an 8-byte boundary, weights."""
    S = 0 if scales is None else scales.size(1)
    return hb.align(hb.align(16 + x.size(1) * x.element_size() + 4 * S, 8) + 12 * K, 16)
