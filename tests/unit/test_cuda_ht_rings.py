"""The CUDA backend's normal-mode layout (gpu_kernels/cuda/ht_layout.h through native.HTLayout) and its ring sizing
and refusals (CudaHT._ring_rows, _check_rows, _check_channels), on the CPU: the control area's table, rows per
(channel, peer) ring against the layout's definition, the boundary of the smallest Buffer that is accepted, and a
Buffer sized by DeepEP's hint for its own test shape."""

import pytest

import ci_expect
import portep
from portep import native
from portep.backends.cuda.ht import CudaHT

pytestmark = ci_expect.needs("cuda-kernels", native.build_info()["gpu_built"], "this build has no GPU kernels")


def _layout(num_ranks, area_bytes, proxy, ranks_per_node):
    return native.HTLayout(
        num_ranks=num_ranks,
        ranks_per_node=ranks_per_node,
        proxy=proxy,
        ctrl_off=area_bytes,
        area_off=0,
        area_bytes=area_bytes,
    )


def _ht(num_ranks, normal_bytes, proxy, sms=132, ranks_per_node=None):
    """A CudaHT with only what the checks read (no kernels, no GPU)."""
    ht = CudaHT.__new__(CudaHT)
    ht.native, ht.device_sms, ht.proxy = native, sms, proxy
    ht.layout = _layout(num_ranks, normal_bytes, proxy, ranks_per_node or (1 if proxy else num_ranks))
    ht.forward = ht.layout.forwarding
    return ht


def _peers(R, L, rank):
    """The ranks `rank` exchanges rows with (ht_layout.h, "Peers"): its node's, and its local index's on other
    nodes; itself left out."""
    node, local = divmod(rank, L)
    return {r for r in range(R) if r != rank and (r // L == node or r % L == local)}


def _expected_rows(recv_bytes, R, C, row_bytes, L=None):
    """ht_layout.h: rings [peers][C channels] x rows, rows a multiple of HT_CHUNK_ROWS."""
    per_ring = recv_bytes // (len(_peers(R, L or R, 0)) * C * row_bytes)
    return per_ring - per_ring % native.HT_CHUNK_ROWS


@pytest.mark.parametrize("R,L", [(2, 2), (8, 8), (8, 4), (16, 8), (32, 8), (12, 4), (128, 1), (1024, 8)])
def test_control_area_table_is_contiguous_aligned_and_sized_by_peers_not_ranks(R, L):
    c, slot = native.ht_ctrl_layout(R, L), native.HT_SLOT_LAYOUT
    C = native.HT_MAX_CHANNELS
    order = ["slots", "tails", "outgoing", "heads", "fwd_tails", "fwd_heads", "scratch", "bytes"]
    sizes = {
        "slots": 2 * R * c["slot_bytes"],
        "outgoing": 2 * R * c["slot_bytes"],
        "scratch": 16,
        "fwd_tails": 2 * 8 * L * C,
        "fwd_heads": 2 * 8 * L * C,
    }
    assert c["word_table_bytes"] == 8 * (L + R // L) * C  # a word per (peer index, channel)
    for a, b in zip(order, order[1:]):
        assert c[b] - c[a] == sizes.get(a, 2 * c["word_table_bytes"]), (a, b)
        assert c[a] % native.HT_ALIGN == 0
    assert c["slots"] == 0
    assert c["bytes"] == 4 * R * slot["bytes"] + 2048 * (L + R // L) + 2048 * L + 16 < 64 << 20  # docs/backends.md
    lay = native.HTLayout(num_ranks=R, ranks_per_node=L, proxy=R > L, ctrl_off=1 << 30, area_off=0, area_bytes=1 << 20)
    assert lay.ctrl_bytes == c["bytes"]
    fields = [
        ("flag", 8),
        ("counts", 4 * native.HT_MAX_NODE_RANKS),
        ("channels", 4 * C),
        ("node_channels", 4 * C),
        ("experts", 4 * native.HT_MAX_LOCAL_EXPERTS),
    ]
    for (a, size), (b, _) in zip(fields, fields[1:] + [("bytes", 0)]):
        assert slot[b] - slot[a] >= size and slot[a] % 4 == 0, (a, b)
    assert slot["bytes"] == c["slot_bytes"] and slot["bytes"] % native.HT_ALIGN == 0
    assert slot["bytes"] - slot["experts"] - 4 * native.HT_MAX_LOCAL_EXPERTS < native.HT_ALIGN  # only padding


def test_signal_streams_are_consecutive_from_the_base():
    s = native.HT_STREAMS
    C = native.HT_MAX_CHANNELS
    assert [s[k] for k in ("notify", "dispatch_data", "combine_data", "dispatch_credits", "combine_credits")] == [
        0,
        1,
        1 + C,
        1 + 2 * C,
        1 + 3 * C,
    ]
    assert native.HT_NUM_STREAMS == 1 + 4 * C


@pytest.mark.parametrize("proxy", [False, True])
def test_areas_split_for_staging_only_with_proxy_peers(proxy):
    lay = native.HTLayout(
        num_ranks=4, ranks_per_node=2 if proxy else 4, proxy=proxy, ctrl_off=0, area_off=1 << 20, area_bytes=1000016
    )
    assert lay.recv_off == 1 << 20
    if proxy:
        assert lay.recv_bytes == 1000016 // 2 // 16 * 16 and lay.stage_off == lay.recv_off + lay.recv_bytes
        assert lay.stage_bytes == 1000016 - lay.recv_bytes >= lay.recv_bytes
    else:
        assert lay.recv_bytes == 1000016 and lay.stage_bytes == 0


def test_row_sizes_follow_their_definitions():
    # dispatch: [16-byte header][x][scales][pad to 8][ids K x 8][weights K x 4], padded to 16
    for row, S, K in [(14336, 0, 8), (7168, 56, 8), (7168, 57, 3), (16, 1, 0), (2048, 0, 0)]:
        want = -(-(-(-(16 + row + 4 * S) // 8) * 8 + 12 * K) // 16) * 16
        assert native.HTLayout.dispatch_row_bytes(row, S, K) == want, (row, S, K)
    direct, fwd = _layout(8, 1 << 20, False, 8), _layout(8, 1 << 20, True, 4)
    assert not direct.forwarding and fwd.forwarding and fwd.blocks_per_channel == 3 and direct.blocks_per_channel == 2
    for H, K in [(7168, 8), (7168, 0), (4096, 3)]:
        assert direct.combine_row_bytes(H, K) == -(-(2 * H + 4 * K) // 16) * 16  # BF16 contributions
        assert fwd.combine_row_bytes(H, K) == -(-(4 * H + 4 * K) // 16) * 16  # FP32 partials travel too
    assert native.HTLayout.chunk_bytes(4112) == native.HT_CHUNK_ROWS * 4112


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_ranks=9, ranks_per_node=9), "1 to 8 ranks per node"),
        (dict(num_ranks=129, ranks_per_node=1), "129 nodes; the normal mode runs at most 128 nodes"),
        (dict(num_ranks=1032, ranks_per_node=8), "at most 128 nodes"),
        (dict(num_ranks=6, ranks_per_node=4), "must divide"),
        (dict(ctrl_off=8), "multiples of 16"),
        (dict(area_bytes=1000), "multiples of 16"),
        (dict(ctrl_off=1 << 20), "overlaps"),
    ],
)
def test_layout_refuses_what_the_kernels_cannot_address(kwargs, match):
    args = dict(num_ranks=4, ranks_per_node=4, proxy=False, ctrl_off=0, area_off=1 << 20, area_bytes=1 << 20)
    with pytest.raises(ValueError, match=match):
        native.HTLayout(**{**args, **kwargs})


@pytest.mark.parametrize(
    "R,C,row_bytes,nbytes,proxy",
    [
        (2, 12, 14448, 100712960, False),
        (8, 10, 7264, 1 << 28, False),
        (2, 2, 2160, 600064, True),
        (4, 64, 2080, 3 << 27, True),
    ],
)
def test_ring_rows_fill_the_area_in_whole_chunks(R, C, row_bytes, nbytes, proxy):
    ht = _ht(R, nbytes, proxy)
    rows = ht._ring_rows(row_bytes, C, "dispatch")
    recv = ht.layout.recv_bytes
    assert recv == (nbytes // 2 // 16 * 16 if proxy else nbytes)
    assert rows == _expected_rows(recv, R, C, row_bytes) == ht.layout.rows_per_ring(row_bytes, C)
    assert rows % native.HT_CHUNK_ROWS == 0 and rows >= native.HT_MIN_RING_ROWS
    assert (R - 1) * C * rows * row_bytes <= recv  # and staging is at least as large
    assert (R - 1) * C * (rows + native.HT_CHUNK_ROWS) * row_bytes > recv  # no whole chunk left unused


@pytest.mark.parametrize("R,L", [(16, 8), (32, 8), (12, 4), (128, 1), (1024, 8)])
def test_rings_are_one_per_peer_and_channel_plus_forward_rings(R, L):
    C, row_bytes = 12, 14448
    for rank in (0, R - 1, R // 2 + 1):
        assert len(_peers(R, L, rank)) == len(_peers(R, L, 0))  # every rank has as many peers
    forward = L if 1 < L < R else 0
    rings = (len(_peers(R, L, 0)) + forward) * C
    ht = _ht(R, 1 << 34, True, ranks_per_node=L)
    assert ht.layout.rings(C) == rings
    need = native.HT_MIN_RING_ROWS * rings * row_bytes * 2
    assert ht.layout.area_bytes_for(native.HT_MIN_RING_ROWS, row_bytes, C) == need
    assert _ht(R, need, True, ranks_per_node=L)._ring_rows(row_bytes, C, "dispatch") == native.HT_MIN_RING_ROWS


@pytest.mark.parametrize("proxy", [False, True])
def test_smallest_buffer_is_accepted_and_one_chunk_less_refused_naming_the_bytes(proxy):
    R, C, row_bytes = 4, 6, 4112
    need = native.HT_MIN_RING_ROWS * (R - 1) * C * row_bytes * (2 if proxy else 1)
    assert _ht(R, need, proxy).layout.area_bytes_for(native.HT_MIN_RING_ROWS, row_bytes, C) == need
    assert _ht(R, need, proxy)._ring_rows(row_bytes, C, "combine") == native.HT_MIN_RING_ROWS
    short = need - 16 * (2 if proxy else 1)
    with pytest.raises(ValueError) as exc:
        _ht(R, short, proxy)._ring_rows(row_bytes, C, "combine")
    msg = str(exc.value)
    assert "combine" in msg and f">= {need} bytes" in msg and "num_nvl_bytes" in msg and "config.num_sms" in msg


def test_deepep_hint_buffer_holds_its_test_shape_without_wrapping():
    # DeepEP's HT test: 4096 tokens per rank, hidden 7168, top-8, EP2, 24 SMs (12 channels), BF16 with top-k
    hint = portep.Config(24, 24, 256, 6, 128).get_nvl_buffer_size_hint(7168 * 2, 2)
    rec = native.HTLayout.dispatch_row_bytes(7168 * 2, 0, 8)
    rows = _ht(2, hint, False)._ring_rows(rec, 12, "dispatch")
    assert rows >= -(-4096 // 12)  # a channel's rows from the peer fit in its ring: no sender ever waits


@pytest.mark.parametrize(
    "R,L,C,row_bytes,nbytes", [(4, 2, 10, 2336, 1 << 28), (8, 4, 6, 28704, 1 << 30), (8, 2, 3, 1040, 8 << 20)]
)
def test_forwarding_adds_a_forward_ring_per_local_rank_and_channel(R, L, C, row_bytes, nbytes):
    # ht_layout.h: with forwarding the receive area holds the peer rings [L - 1 + Nn - 1][C] and the forward rings
    # [L][C]
    ht = _ht(R, nbytes, True, ranks_per_node=L)
    rows = ht._ring_rows(row_bytes, C, "dispatch")
    rings = (len(_peers(R, L, 0)) + L) * C
    assert ht.layout.rings(C) == rings
    assert rows % native.HT_CHUNK_ROWS == 0 and rows >= native.HT_MIN_RING_ROWS
    assert rings * rows * row_bytes <= ht.layout.recv_bytes < rings * (rows + native.HT_CHUNK_ROWS) * row_bytes
    need = native.HT_MIN_RING_ROWS * rings * row_bytes * 2
    assert _ht(R, need, True, ranks_per_node=L)._ring_rows(row_bytes, C, "dispatch") == native.HT_MIN_RING_ROWS
    with pytest.raises(ValueError, match=f">= {need} bytes"):
        _ht(R, need - 32, True, ranks_per_node=L)._ring_rows(row_bytes, C, "dispatch")


def test_one_rank_has_no_rings_and_any_area_does():
    assert _ht(1, 1 << 20, False)._ring_rows(1 << 20, 64, "dispatch") == native.HT_MIN_RING_ROWS


def test_the_v2_size_hint_of_one_rank_is_a_usable_buffer():
    """One rank needs no rings, so the normal mode asks for 0 bytes; the V2 hint must still be a size a Buffer
    takes (> 0, a multiple of 2 MiB), and grow with the ranks."""
    from portep.elastic.sizing import cuda_buffer_bytes

    one, two = (cuda_buffer_bytes(r, r, 7168, 8, False) for r in (1, 2))
    assert one == 2 << 20 and two > one and two % (2 << 20) == 0


@pytest.mark.parametrize("hidden", [4096, 7168])
@pytest.mark.parametrize("ranks", [2, 8, 16, 32, 64, 128, 160])
def test_the_v2_size_hint_is_no_larger_than_v1s_buffer(ranks, hidden):
    """Issue 36's memory rule at the models' shapes (top-8, BF16 and FP8): an ElasticBuffer sized by its hint takes
    no more than DeepEP's V1 hints give a Buffer, up to the 2 MiB alignment V2's hints carry (at these shapes V1's
    bytes exceed what the normal mode's rings need for V2's rows)."""
    from portep.elastic.sizing import MIB2, cuda_buffer_bytes, v1_buffer_bytes

    v1 = v1_buffer_bytes(ranks, hidden)
    for fp8 in (False, True):
        v2 = cuda_buffer_bytes(ranks, min(ranks, 8), hidden, 8, fp8)
        assert v2 % MIB2 == 0 and v1 <= v2 < v1 + MIB2, (fp8, v1, v2)


def test_rows_too_large_for_one_proxy_write_are_refused():
    ht = _ht(2, 1 << 30, True)
    big = native.HT_MAX_WRITE_BYTES // native.HT_CHUNK_ROWS + 16
    with pytest.raises(ValueError, match=f"rows of {big} bytes travel through the proxies"):
        ht._check_rows(big, 1, "dispatch")
    _ht(2, 1 << 30, False)._check_rows(big, 1, "dispatch")  # direct peers: no WRITE


def test_forwarding_runs_three_blocks_per_channel():
    assert native.ht_blocks_per_channel(4, 2) == 3 and native.ht_blocks_per_channel(8, 8) == 2
    assert native.ht_blocks_per_channel(2, 1) == 2
    ht = _ht(4, 1 << 26, True, sms=132, ranks_per_node=2)
    ht._check_channels(44, "combine")  # 132 blocks
    with pytest.raises(ValueError, match=r"config.num_sms=90.*need 135 SMs.*3 blocks per channel.*num_sms <= 88"):
        ht._check_channels(45, "combine")


def test_more_channels_than_the_gpu_runs_at_once_are_refused():
    ht = _ht(2, 1 << 26, False, sms=132)
    ht._check_channels(66, "dispatch")  # 132 blocks: exactly one per SM
    with pytest.raises(ValueError, match=r"config.num_sms=134.*has 132: use config.num_sms <= 132"):
        ht._check_channels(67, "dispatch")
