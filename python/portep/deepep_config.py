"""DeepEP's `Config`, its tuned per-EP-size defaults and its buffer-size hints, with DeepEP's exact formulas,
so that code which sizes buffers from them keeps getting the same numbers; across nodes the NVL hint is raised to
what portep's CUDA normal mode needs where DeepEP's is smaller (normal_mode_bytes). No torch."""

from typing import Optional

NUM_MAX_NVL_PEERS = 8
NUM_BUFFER_ALIGNMENT_BYTES = 128
MAX_TOPK_HINT = 128
MAX_SCALES_HINT = 128
SOURCE_META_BYTES = 8
INT4_BYTES = 16

# (nvl_send, nvl_recv, rdma_send, rdma_recv) per EP size, as in DeepEP V1's Buffer.get_*_config.
DISPATCH_CONFIGS = {
    2: (24, 256, 6, 128),
    4: (6, 256, 6, 128),
    8: (6, 256, 6, 128),
    16: (36, 288, 20, 128),
    24: (32, 288, 8, 128),
    32: (32, 288, 8, 128),
    48: (32, 288, 8, 128),
    64: (32, 288, 8, 128),
    96: (20, 480, 12, 128),
    128: (20, 560, 12, 128),
    144: (32, 720, 12, 128),
    160: (28, 720, 12, 128),
}
COMBINE_CONFIGS = {
    2: (10, 256, 6, 128),
    4: (9, 256, 6, 128),
    8: (4, 256, 6, 128),
    16: (4, 288, 12, 128),
    24: (1, 288, 8, 128),
    32: (1, 288, 8, 128),
    48: (1, 288, 8, 128),
    64: (1, 288, 8, 128),
    96: (1, 480, 8, 128),
    128: (1, 560, 8, 128),
    144: (2, 720, 8, 128),
    160: (2, 720, 8, 128),
}


def check_int(name: str, value: object, low: Optional[int] = None, high: Optional[int] = None) -> int:
    """`value` as an int, or TypeError/ValueError naming `name`, the value and the limit."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name}={value} must be >= {low}")
    if high is not None and value > high:
        raise ValueError(f"{name}={value} must be <= {high}")
    return value


def _align(value, alignment):
    return (value + alignment - 1) // alignment * alignment


class Config:
    """Chunking and SM settings of the normal (high-throughput) kernels, as DeepEP's `deep_ep.Config`.

    As in DeepEP, `num_max_rdma_chunked_recv_tokens` is rounded up to a multiple of
    `num_max_rdma_chunked_send_tokens`. Unlike DeepEP's binding, the fields are readable.
    """

    def __init__(
        self,
        num_sms: int = 20,
        num_max_nvl_chunked_send_tokens: int = 6,
        num_max_nvl_chunked_recv_tokens: int = 256,
        num_max_rdma_chunked_send_tokens: int = 6,
        num_max_rdma_chunked_recv_tokens: int = 256,
    ) -> None:
        self.num_sms = check_int("num_sms", num_sms, 0)
        nvl_send = check_int("num_max_nvl_chunked_send_tokens", num_max_nvl_chunked_send_tokens, 1)
        nvl_recv = check_int("num_max_nvl_chunked_recv_tokens", num_max_nvl_chunked_recv_tokens, 1)
        rdma_send = check_int("num_max_rdma_chunked_send_tokens", num_max_rdma_chunked_send_tokens, 1)
        rdma_recv = check_int("num_max_rdma_chunked_recv_tokens", num_max_rdma_chunked_recv_tokens, 1)
        if nvl_send >= nvl_recv:
            raise ValueError(
                f"num_max_nvl_chunked_send_tokens={nvl_send} must be < num_max_nvl_chunked_recv_tokens={nvl_recv}"
            )
        rdma_recv = _align(rdma_recv, rdma_send)
        if rdma_send > rdma_recv // 2:
            raise ValueError(
                f"num_max_rdma_chunked_send_tokens={rdma_send} must be <= half of "
                f"num_max_rdma_chunked_recv_tokens={rdma_recv} (after rounding up to a multiple "
                f"of the send chunk)"
            )
        self.num_max_nvl_chunked_send_tokens = nvl_send
        self.num_max_nvl_chunked_recv_tokens = nvl_recv
        self.num_max_rdma_chunked_send_tokens = rdma_send
        self.num_max_rdma_chunked_recv_tokens = rdma_recv

    def _fields(self):
        return (
            self.num_sms,
            self.num_max_nvl_chunked_send_tokens,
            self.num_max_nvl_chunked_recv_tokens,
            self.num_max_rdma_chunked_send_tokens,
            self.num_max_rdma_chunked_recv_tokens,
        )

    def __eq__(self, other):
        return isinstance(other, Config) and self._fields() == other._fields()

    def __hash__(self):
        return hash(self._fields())

    def __repr__(self):
        return "Config(num_sms={}, nvl_send={}, nvl_recv={}, rdma_send={}, rdma_recv={})".format(*self._fields())

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of NVLink buffer DeepEP would need for rows of `hidden_bytes` on `num_ranks` ranks; across nodes
        (more than 8 ranks) at least what portep's CUDA normal mode needs (normal_mode_bytes), so that a Buffer
        sized by the hints runs whether its normal mode keeps to the NVL bytes (low_latency_mode=True with both
        sizes) or takes both."""
        deepep = self._deepep_nvl_hint(hidden_bytes, num_ranks)
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return deepep
        return max(deepep, _align(normal_mode_bytes(self, hidden_bytes, num_ranks), NUM_BUFFER_ALIGNMENT_BYTES))

    def _deepep_nvl_hint(self, hidden_bytes, num_ranks):
        check_int("hidden_bytes", hidden_bytes, 0)
        _check_hint_ranks(num_ranks, self.num_sms, NUM_MAX_NVL_PEERS)
        num_rdma_ranks = max(num_ranks // NUM_MAX_NVL_PEERS, 1)
        num_nvl_ranks = min(num_ranks, NUM_MAX_NVL_PEERS)
        slots = (self.num_sms // 2) * num_nvl_ranks
        per_token = hidden_bytes + SOURCE_META_BYTES + MAX_TOPK_HINT * 8 + MAX_TOPK_HINT * 4 + MAX_SCALES_HINT * 4
        num_bytes = slots * (2 * num_rdma_ranks + 3) * 4 + slots * self.num_max_nvl_chunked_recv_tokens * per_token
        return _align(num_bytes, NUM_BUFFER_ALIGNMENT_BYTES)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of RDMA buffer DeepEP would need; 0 when all ranks fit in one node (<= 8 ranks)."""
        check_int("hidden_bytes", hidden_bytes, 0)
        check_int("num_ranks", num_ranks, 1)
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        _check_hint_ranks(num_ranks, self.num_sms, 1)
        slots = (self.num_sms // 2) * (num_ranks // NUM_MAX_NVL_PEERS)
        per_token = 2 * (
            hidden_bytes + SOURCE_META_BYTES + MAX_TOPK_HINT * 8 + MAX_TOPK_HINT * 4 + MAX_SCALES_HINT * 4 + INT4_BYTES
        )
        num_bytes = (
            slots * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4 + slots * self.num_max_rdma_chunked_recv_tokens * per_token
        )
        return _align(num_bytes, NUM_BUFFER_ALIGNMENT_BYTES)


def normal_mode_bytes(
    config: "Config", hidden_bytes: int, num_ranks: int, ranks_per_node: int = NUM_MAX_NVL_PEERS
) -> int:
    """Bytes the CUDA normal mode needs for `config`'s channels (num_sms / 2) on `num_ranks` ranks in nodes of
    ranks_per_node: HT_MIN_RING_ROWS rows per ring of DeepEP's largest rows (MAX_TOPK_HINT top-k, MAX_SCALES_HINT
    scales; a combine row across nodes is an FP32 partial), by the layout's own formula (gpu_kernels/cuda/ht_layout.h
    through native.HTLayout; docs/backends.md, "Memory"). 0 where the GPU kernels are not built."""
    from ._native import native

    if native is None or not hasattr(native, "HTLayout"):
        return 0
    L = min(num_ranks, ranks_per_node)
    layout = native.HTLayout(
        num_ranks=num_ranks, ranks_per_node=L, proxy=num_ranks > L, ctrl_off=1 << 60, area_off=0, area_bytes=16
    )
    row = max(
        native.HTLayout.dispatch_row_bytes(hidden_bytes, MAX_SCALES_HINT, MAX_TOPK_HINT),
        layout.combine_row_bytes(hidden_bytes // 2, MAX_TOPK_HINT),
    )
    return layout.area_bytes_for(native.HT_MIN_RING_ROWS, row, max(config.num_sms // 2, 1))


def _check_hint_ranks(num_ranks, num_sms, even_sms_above):
    check_int("num_ranks", num_ranks, 1)
    if num_ranks > NUM_MAX_NVL_PEERS and num_ranks % NUM_MAX_NVL_PEERS:
        raise ValueError(
            f"num_ranks={num_ranks} must be < {NUM_MAX_NVL_PEERS} or a multiple of "
            f"{NUM_MAX_NVL_PEERS} (DeepEP's size hints assume {NUM_MAX_NVL_PEERS} ranks per node)"
        )
    if num_ranks > even_sms_above and num_sms % 2:
        raise ValueError(f"num_sms={num_sms} must be even for num_ranks={num_ranks}")


def _table_entry(table, num_ranks):
    """DeepEP's tuned entry; above its largest EP size (160), for whole nodes of NUM_MAX_NVL_PEERS ranks (portep's
    normal mode runs up to 1024 ranks), that largest entry's chunk sizes with the NVL receive chunk raised to what
    DeepEP's internode checks ask of that many nodes (check_internode_config). None for any other size."""
    if num_ranks in table:
        return table[num_ranks]
    largest = max(table)
    if num_ranks <= largest or num_ranks % NUM_MAX_NVL_PEERS:
        return None
    nvl_send, nvl_recv, rdma_send, rdma_recv = table[largest]
    nodes = num_ranks // NUM_MAX_NVL_PEERS
    nvl_recv = max(_align(nvl_recv, nodes), nodes * (max(nvl_send, rdma_send) + 1))
    return nvl_send, nvl_recv, rdma_send, rdma_recv


def check_internode_config(config: "Config", num_nodes: int, ranks_per_node: int, what: str) -> "Config":
    """DeepEP's checks of a config across nodes of NUM_MAX_NVL_PEERS ranks (its internode topology; num_rdma_ranks =
    num_nodes): combine needs num_max_nvl_chunked_recv_tokens to be a multiple of the nodes and
    num_max_nvl_chunked_send_tokens <= its share per node; dispatch needs that share to exceed both send chunks. The
    error names the field. Other node sizes (portep's simulated nodes) are shapes DeepEP never runs: not checked."""
    if num_nodes <= 1 or ranks_per_node != NUM_MAX_NVL_PEERS:
        return config
    nvl_send, nvl_recv = config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens
    rdma_send, share = config.num_max_rdma_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens // num_nodes
    if what == "combine":
        if nvl_recv % num_nodes:
            raise ValueError(
                f"combine: config.num_max_nvl_chunked_recv_tokens={nvl_recv} must be a multiple of the "
                f"number of nodes {num_nodes}"
            )
        if nvl_send > share:
            raise ValueError(
                f"combine: config.num_max_nvl_chunked_send_tokens={nvl_send} must be <= "
                f"num_max_nvl_chunked_recv_tokens / nodes = {nvl_recv} / {num_nodes} = {share}"
            )
    elif share <= max(nvl_send, rdma_send):
        field = "num_max_nvl_chunked_send_tokens" if nvl_send >= rdma_send else "num_max_rdma_chunked_send_tokens"
        raise ValueError(
            f"dispatch: config.num_max_nvl_chunked_recv_tokens / nodes = {nvl_recv} / {num_nodes} = "
            f"{share} must be > config.{field}={max(nvl_send, rdma_send)}"
        )
    return config


def _table_config(table, kind, num_ranks, num_sms):
    check_int("num_ranks", num_ranks)
    entry = _table_entry(table, num_ranks)
    if entry is None:
        supported = ", ".join(str(r) for r in table)
        raise ValueError(
            f"no tuned {kind} config for num_ranks={num_ranks}; supported: {supported}, and multiples "
            f"of {NUM_MAX_NVL_PEERS} above {max(table)} (pass config=Config(...) for other sizes)"
        )
    return Config(num_sms, *entry)


def dispatch_config(num_ranks: int, num_sms: int) -> "Config":
    """DeepEP's tuned dispatch Config for num_ranks (get_dispatch_config), with num_sms SMs."""
    return _table_config(DISPATCH_CONFIGS, "dispatch", num_ranks, num_sms)


def combine_config(num_ranks: int, num_sms: int) -> "Config":
    """DeepEP's tuned combine Config for num_ranks (get_combine_config), with num_sms SMs."""
    return _table_config(COMBINE_CONFIGS, "combine", num_ranks, num_sms)


def default_config(table: dict, num_ranks: int, num_sms: int) -> "Config":
    """The tuned config when the EP size has one (_table_entry), else Config's defaults (portep runs sizes DeepEP
    does not)."""
    entry = _table_entry(table, num_ranks)
    return Config(num_sms) if entry is None else Config(num_sms, *entry)


def low_latency_rdma_size_hint(
    num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
) -> int:
    """DeepEP's LL buffer size: two halves of send, receive and signalling areas (num_ranks is unused)."""
    tokens = check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1)
    check_int("hidden", hidden, 1)
    check_int("num_ranks", num_ranks, 1)
    check_int("num_experts", num_experts, 1)
    num_scales = hidden // 128
    dispatch_msg = INT4_BYTES + max(hidden * 2, hidden + num_scales * 4)
    combine_msg = num_scales * 4 + hidden * 2
    send = max(tokens * dispatch_msg, num_experts * tokens * combine_msg)
    recv = max(num_experts * tokens * dispatch_msg, num_experts * tokens * combine_msg)
    signal = _align(num_experts * 4, NUM_BUFFER_ALIGNMENT_BYTES)
    total = 2 * send + 2 * recv + 2 * signal
    return (total + NUM_BUFFER_ALIGNMENT_BYTES) // NUM_BUFFER_ALIGNMENT_BYTES * NUM_BUFFER_ALIGNMENT_BYTES
