"""Normal (HT) mode on the CUDA backend, between ranks of one node that store into each other's memory (NVLink
through CUDA IPC). Kernels and layouts: gpu_kernels/cuda/ht_api.h. Each op is a notify kernel (count exchange or
barrier) and a data kernel on the current stream; a non-cached dispatch without num_worst_tokens waits on the CPU
for the notify's counts in mapped host memory to size its outputs (as DeepEP does), everything else is
capturable in a CUDA graph.

Records in the data area are DeepEP-like rows with a 16-byte header; results match the host backend bit for bit
(the same receive order, the same FP32 reduction order: bias, then ranks ascending).
"""

import ctypes

import torch

from . import host_backend as hb


def _ptr(t):
    return 0 if t is None else t.data_ptr()


class CudaHT:
    """One per CudaEngine; created on first use. Its control area sits after the LL flags and meta blocks."""

    def __init__(self, eng, ctrl_off):
        native = eng.native
        if eng.num_nodes > 1:
            raise NotImplementedError(
                f"normal-mode dispatch/combine on GPU tensors across nodes (num_ranks_per_node={eng.ranks_per_node} < "
                f"{eng.num_ranks} ranks) is not implemented yet: the CUDA HT kernels store into same-node peers only; "
                "use one node or a backend='host' Buffer")
        if eng.num_ranks > native.HT_MAX_RANKS:
            raise NotImplementedError(f"the CUDA HT kernels support at most {native.HT_MAX_RANKS} ranks in one node, "
                                      f"got {eng.num_ranks}")
        ch = eng.channel._native
        peers = [ch.peer_data_ptr(d) for d in range(eng.num_ranks)]
        if not all(peers):
            raise NotImplementedError(f"normal mode on GPU tensors needs every rank's buffer mapped (CUDA IPC); "
                                      f"transport {eng.channel.transport!r} did not map ranks "
                                      f"{[d for d, p in enumerate(peers) if not p]}")
        self.eng = eng
        self.peers = torch.tensor(peers, dtype=torch.int64, device=eng.device)
        self.epoch = torch.zeros(1, dtype=torch.int64, device=eng.device)
        self.host_counts, host_counts_device = native.cuda_host_alloc_mapped(native.HT_HOST_COUNTS_BYTES)
        ctypes.memset(self.host_counts, 0, native.HT_HOST_COUNTS_BYTES)
        self.ticket = 0
        self.kernels = native.HTKernels(eng.rank, eng.num_ranks, ch.device_data_ptr(), self.peers.data_ptr(), ctrl_off,
                                        0, eng.num_bytes, self.epoch.data_ptr(), self.host_counts, host_counts_device,
                                        eng.error_device, eng._error_host, eng.timeout_s)

    def destroy(self):
        if self.host_counts:
            self.eng.native.cuda_host_free_mapped(self.host_counts)
            self.host_counts = 0

    def _copy(self, original, converted):
        """converted (original made contiguous or cast): a temporary, kept until the kernels that read it ran."""
        if converted is not original:
            self.eng.keep_for_launch(converted)
        return converted

    # ---- dispatch ----
    def dispatch(self, x, x_scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert, expert_alignment,
                 num_worst_tokens, num_channels, handle):
        eng = self.eng
        stream = eng.raw_stream()
        R, N, dev = eng.num_ranks, x.size(0), eng.device
        x = self._copy(x, x.contiguous())
        scales = None if x_scales is None else self._copy(x_scales, x_scales.contiguous())
        counts_list = []
        if handle is not None:
            rank_prefix, channel_prefix, recv_channel_prefix, src_idx, is_token_in_rank, _ = handle
            num_recv = src_idx.size(0)
            self._notify(num_channels, stream, False, is_token_in_rank, None, N, 0, None, 0)
        else:
            is_token_in_rank = self._copy(is_token_in_rank, is_token_in_rank.contiguous())
            E = num_tokens_per_expert.numel()
            per_expert = self._copy(num_tokens_per_expert, num_tokens_per_expert.to(torch.int32).contiguous())
            rank_prefix = torch.empty(R, R, dtype=torch.int32, device=dev)
            channel_prefix = torch.empty(R, num_channels, dtype=torch.int32, device=dev)
            recv_channel_prefix = torch.empty(R, num_channels, dtype=torch.int32, device=dev)
            prefixes = (rank_prefix, channel_prefix, recv_channel_prefix)
            if num_worst_tokens > 0:
                self._notify(num_channels, stream, True, is_token_in_rank, per_expert, N, E, prefixes,
                             num_worst_tokens)
                num_recv = num_worst_tokens
            else:
                self.ticket += 1
                self._notify(num_channels, stream, True, is_token_in_rank, per_expert, N, E, prefixes, 0, self.ticket)
                num_recv, counts_list = self._wait_counts(E // R, x, scales, topk_idx, expert_alignment)
        rows = num_recv
        row_bytes = x.size(1) * x.element_size()
        recv_x = torch.empty(rows, x.size(1), dtype=x.dtype, device=dev)
        recv_scales = None if scales is None else torch.empty(rows, scales.size(1), dtype=scales.dtype, device=dev)
        recv_idx = recv_w = src_out = send_head = None
        cached = handle is not None
        K = 0 if topk_idx is None else topk_idx.size(1)
        if not cached:
            if K:
                recv_idx = torch.full((rows, K), -1, dtype=torch.int64, device=dev)
                recv_w = torch.zeros(rows, K, dtype=torch.float32, device=dev)
                topk_idx = self._copy(topk_idx, topk_idx.to(torch.int64).contiguous())
                topk_weights = self._copy(topk_weights, topk_weights.to(torch.float32).contiguous())
            src_out = torch.empty(rows, dtype=torch.int32, device=dev)
            send_head = torch.empty(N, R, dtype=torch.int32, device=dev)
        E_l = 0 if cached else num_tokens_per_expert.numel() // R
        self.kernels.dispatch(num_channels, stream, x.data_ptr(), _ptr(scales), _ptr(topk_idx), _ptr(topk_weights),
                              is_token_in_rank.data_ptr(), rank_prefix.data_ptr(), channel_prefix.data_ptr(),
                              recv_channel_prefix.data_ptr(), N, row_bytes,
                              0 if scales is None else scales.size(1), K, E_l, rows, recv_x.data_ptr(),
                              _ptr(recv_scales), _ptr(recv_idx), _ptr(recv_w), _ptr(src_out), _ptr(send_head))
        if cached:
            return recv_x, recv_scales, None, None, None, None
        new_handle = (rank_prefix, channel_prefix, recv_channel_prefix, src_out, is_token_in_rank, send_head)
        return recv_x, recv_scales, recv_idx, recv_w, counts_list, new_handle

    def _notify(self, num_channels, stream, exchange, is_token_in_rank, per_expert, N, E, prefixes, max_recv,
                ticket=0):
        rp, cp, rcp = prefixes if prefixes is not None else (None, None, None)
        self.kernels.notify(num_channels, stream, exchange, is_token_in_rank.data_ptr(), _ptr(per_expert), N, E,
                            _ptr(rp), _ptr(cp), _ptr(rcp), max_recv, ticket)

    def _wait_counts(self, E_l, x, scales, topk_idx, expert_alignment):
        eng = self.eng
        got = self.kernels.wait_counts(self.ticket, E_l)
        if got is None:
            eng.check_error()
            raise RuntimeError(f"rank {eng.rank}: dispatch: the count exchange did not finish within "
                               f"{eng.timeout_s} s (a peer rank did not call dispatch?)")
        num_recv, most, experts = got
        rec = _record_bytes(x, scales, topk_idx)
        if most * rec > eng.num_bytes:
            raise ValueError(f"the communication buffer has {eng.num_bytes} bytes but this dispatch needs "
                             f"{most * rec} bytes ({most} rows of {rec} bytes on the busiest rank); create the "
                             "Buffer with a larger num_nvl_bytes")
        a = expert_alignment
        return num_recv, [(int(c) + a - 1) // a * a for c in experts]

    # ---- combine ----
    def combine(self, x, handle, topk_weights, bias):
        eng = self.eng
        stream = eng.raw_stream()
        rank_prefix, channel_prefix, recv_channel_prefix, _, is_token_in_rank, send_head = handle
        N, H = is_token_in_rank.size(0), x.size(1)
        C = channel_prefix.size(1)
        x = self._copy(x, x.contiguous())
        K = 0 if topk_weights is None else topk_weights.size(1)
        weights = None if topk_weights is None else self._copy(topk_weights,
                                                               topk_weights.to(torch.float32).contiguous())
        out = torch.empty(N, H, dtype=torch.bfloat16, device=eng.device)
        out_w = torch.empty(N, K, dtype=torch.float32, device=eng.device) if weights is not None else None
        b0 = self._copy(bias[0], bias[0].contiguous()) if len(bias) > 0 else None
        b1 = self._copy(bias[1], bias[1].contiguous()) if len(bias) > 1 else None
        self._notify(C, stream, False, is_token_in_rank, None, N, 0, None, 0)
        self.kernels.combine(C, stream, x.data_ptr(), _ptr(weights), _ptr(b0), _ptr(b1), is_token_in_rank.data_ptr(),
                             rank_prefix.data_ptr(), channel_prefix.data_ptr(), recv_channel_prefix.data_ptr(),
                             send_head.data_ptr(), N, H, K, out.data_ptr(), _ptr(out_w))
        return out, out_w


def _record_bytes(x, scales, topk_idx):
    K = 0 if topk_idx is None else topk_idx.size(1)
    S = 0 if scales is None else scales.size(1)
    return hb.align(16 + x.size(1) * x.element_size() + 4 * S + 12 * K, 16)
