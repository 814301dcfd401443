"""ElasticBuffer's sizes and counts: the buffer size hint (what its V1 Buffer needs for V2's rows, so no more
than a V1 Buffer at the same shape; docs/api.md) and V2's SM and queue-pair estimates."""

from typing import Optional

import torch

from ..buffer import Buffer, select_backend
from ..deepep_config import DISPATCH_CONFIGS, MAX_SCALES_HINT, check_int, default_config, normal_mode_bytes
from .domains import physical_domain
from .wire import CombineColumns

MIB2 = 2 << 20
MAX_TOPK = 32
HOST_RECORD_HEADER = 16  # backends/host/ht.py's record: header, row, scale columns, top-k ids and weights


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def dispatch_columns(num_topk: int, hidden: int, use_fp8_dispatch: bool) -> int:
    """int32 metadata columns of a dispatched row (wire.DispatchColumns), FP8 with V2's ceil(hidden / 32) scale
    packs at most."""
    return 1 + num_topk + ((hidden + 31) // 32 if use_fp8_dispatch else 0)


def buffer_size_hint(
    group: object,
    num_max_tokens_per_rank: int,
    hidden: int,
    num_topk: int,
    use_fp8_dispatch: bool,
    num_ranks_per_node: Optional[int],
    backend: Optional[str],
) -> int:
    """Bytes per rank, a multiple of 2 MiB, for group's topology on `backend` (default: the one a Buffer takes)."""
    nodes, per_node = physical_domain(group, num_ranks_per_node)
    if select_backend(backend) == "cuda":
        return cuda_buffer_bytes(nodes * per_node, per_node, hidden, num_topk, use_fp8_dispatch)
    return host_buffer_bytes(nodes * per_node, per_node, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch)


def _check_shape(hidden, num_topk):
    check_int("hidden", hidden, 1)
    check_int("num_topk", num_topk, 0, MAX_TOPK)
    return num_topk or MAX_TOPK


def cuda_buffer_bytes(num_ranks: int, ranks_per_node: int, hidden: int, num_topk: int, use_fp8_dispatch: bool) -> int:
    """What a V1 Buffer of the CUDA backend takes for BF16 rows of `hidden` (DeepEP's NVL + RDMA size hints of the
    dispatch and combine configs, the larger), at least what its normal mode needs for V2's rows (2 x hidden bytes
    plus the metadata columns; its rings do not grow with the token count)."""
    K = _check_shape(hidden, num_topk)
    config = default_config(DISPATCH_CONFIGS, num_ranks, Buffer.num_sms)
    extra = 4 * max(0, dispatch_columns(K, hidden, use_fp8_dispatch) - MAX_SCALES_HINT)
    needed = normal_mode_bytes(config, 2 * hidden + extra, num_ranks, ranks_per_node)
    return _align(max(needed, v1_buffer_bytes(num_ranks, hidden), 1), MIB2)  # one rank needs no rings: 2 MiB


def v1_buffer_bytes(num_ranks: int, hidden: int) -> int:
    """num_nvl_bytes + num_rdma_bytes of a V1 Buffer sized as DeepEP's users size it for BF16 rows of `hidden`: the
    larger of the dispatch and combine configs' hints (0 where DeepEP's hints do not cover num_ranks)."""
    try:
        configs = (Buffer.get_dispatch_config(num_ranks), Buffer.get_combine_config(num_ranks))
        return max(
            c.get_nvl_buffer_size_hint(2 * hidden, num_ranks) + c.get_rdma_buffer_size_hint(2 * hidden, num_ranks)
            for c in configs
        )
    except ValueError:
        return 0


def host_buffer_bytes(
    num_ranks: int,
    ranks_per_node: int,
    num_max_tokens_per_rank: int,
    hidden: int,
    num_topk: int,
    use_fp8_dispatch: bool,
) -> int:
    """What the host backend lays out for the worst of a dispatch and of a combine's return trip, after the count
    exchange's area (backends/host/ht.py): each receives its records from every rank and stages what crosses nodes
    both ways. A dispatch: T = num_max_tokens_per_rank tokens from each rank, staged once per other node: (R + 2
    (nodes - 1)) T records. A combine (with multiple reduction): one contribution per (token, rank it reached), so
    min(R, K) T arrive, and a rank forwards up to ranks_per_node T for each other node: (min(R, K) + 2 (R -
    ranks_per_node)) T. An expanded combine without multiple reduction may need more (docs/api.md)."""
    from ..backends.host.engine import count_area_bytes

    K = _check_shape(hidden, num_topk)
    T = check_int("num_max_tokens_per_rank", num_max_tokens_per_rank, 1)
    nodes = num_ranks // ranks_per_node
    dispatch_rows = (num_ranks + 2 * (nodes - 1)) * T
    combine_rows = (min(num_ranks, K) + 2 * (num_ranks - ranks_per_node)) * T
    record = max(
        _host_record(hidden, dispatch_columns(K, hidden, use_fp8_dispatch), K),
        _host_record(hidden, CombineColumns(K).width, 1),  # a contribution goes to one rank
    )
    return _align(count_area_bytes(num_ranks, nodes) + max(dispatch_rows, combine_rows) * record, MIB2)


def _host_record(hidden: int, columns: int, num_topk: int) -> int:
    """Bytes of one host-backend record: header, BF16 row, int32 metadata columns, then top-k ids and weights."""
    return _align(HOST_RECORD_HEADER + 2 * hidden + 4 * columns + 4 + 12 * num_topk, 16)


def default_num_allocated_qps(hybrid: bool) -> int:
    """V2's default GIN contexts: 129 with allow_hybrid_mode, 17 without."""
    return 129 if hybrid else 17


def theoretical_num_sms(device: torch.device, prefer_overlap_with_compute: bool) -> int:
    """An even count >= 4: the V1 Buffer's SMs (>= 64 unless prefer_overlap_with_compute), at most the GPU's."""
    n = max(4, Buffer.num_sms if prefer_overlap_with_compute else max(Buffer.num_sms, 64))
    if device.type == "cuda":
        n = min(n, torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count)
    return max(4, n - n % 2)


def theoretical_num_qps(num_sms: int, hybrid: bool, num_allocated_qps: int) -> int:
    """V2's count: min(num_sms, 9) without allow_hybrid_mode, num_sms x 16 + 1 with it; at most num_allocated_qps."""
    return min(num_sms * 16 + 1 if hybrid else min(num_sms, 9), num_allocated_qps)
