"""The CUDA backend's normal-mode ring sizing and its refusals (CudaHT._ring_rows, _check_channels), on the CPU:
rows per (channel, peer) ring against the layout's definition (ht_api.h), the boundary of the smallest Buffer that
is accepted, and a Buffer sized by DeepEP's hint for its own test shape."""

import types

import pytest

import portep
from portep import native
from portep.backends.cuda.ht import CudaHT, _record_bytes

pytestmark = pytest.mark.skipif(not native.build_info()["gpu_built"], reason="needs the CUDA kernels built")


def _ht(num_ranks, normal_bytes, proxy, sms=132, ranks_per_node=None):
    ht = CudaHT.__new__(CudaHT)
    rpn = ranks_per_node or (1 if proxy else num_ranks)
    ht.eng = types.SimpleNamespace(native=native, num_ranks=num_ranks, normal_bytes=normal_bytes, device_sms=sms,
                                   ranks_per_node=rpn)
    ht.forward = 1 < rpn < num_ranks
    ht.proxy = proxy
    ht.recv_bytes = normal_bytes // 2 // 16 * 16 if proxy else normal_bytes
    return ht


def _expected_rows(recv_bytes, R, C, row_bytes):
    """ht_api.h: rings [R - 1 peers][C channels] x rows, rows a multiple of HT_CHUNK_ROWS."""
    per_ring = recv_bytes // ((R - 1) * C * row_bytes)
    return per_ring - per_ring % native.HT_CHUNK_ROWS


@pytest.mark.parametrize("R,C,row_bytes,nbytes,proxy", [(2, 12, 14448, 100712960, False), (8, 10, 7264, 1 << 28, False),
                                                         (2, 2, 2160, 600064, True), (4, 64, 2080, 3 << 27, True)])
def test_ring_rows_fill_the_area_in_whole_chunks(R, C, row_bytes, nbytes, proxy):
    ht = _ht(R, nbytes, proxy)
    rows = ht._ring_rows(row_bytes, C, "dispatch")
    assert rows == _expected_rows(ht.recv_bytes, R, C, row_bytes)
    assert rows % native.HT_CHUNK_ROWS == 0 and rows >= native.HT_MIN_RING_ROWS
    assert (R - 1) * C * rows * row_bytes <= ht.recv_bytes  # and staging is at least as large
    assert (R - 1) * C * (rows + native.HT_CHUNK_ROWS) * row_bytes > ht.recv_bytes  # no whole chunk left unused


@pytest.mark.parametrize("proxy", [False, True])
def test_smallest_buffer_is_accepted_and_one_chunk_less_refused_naming_the_bytes(proxy):
    R, C, row_bytes = 4, 6, 4112
    need = native.HT_MIN_RING_ROWS * (R - 1) * C * row_bytes * (2 if proxy else 1)
    assert _ht(R, need, proxy)._ring_rows(row_bytes, C, "combine") == native.HT_MIN_RING_ROWS
    short = need - 16 * (2 if proxy else 1)
    with pytest.raises(ValueError) as exc:
        _ht(R, short, proxy)._ring_rows(row_bytes, C, "combine")
    msg = str(exc.value)
    assert "combine" in msg and f">= {need} bytes" in msg and "num_nvl_bytes" in msg and "config.num_sms" in msg


def test_deepep_hint_buffer_holds_its_test_shape_without_wrapping():
    # DeepEP's HT test: 4096 tokens per rank, hidden 7168, top-8, EP2, 24 SMs (12 channels), BF16 with top-k
    import torch

    hint = portep.Config(24, 24, 256, 6, 128).get_nvl_buffer_size_hint(7168 * 2, 2)
    rec = _record_bytes(torch.empty(1, 7168, dtype=torch.bfloat16), None, 8)
    rows = _ht(2, hint, False)._ring_rows(rec, 12, "dispatch")
    assert rows >= -(-4096 // 12)  # a channel's rows from the peer fit in its ring: no sender ever waits


@pytest.mark.parametrize("R,L,C,row_bytes,nbytes", [(4, 2, 10, 2336, 1 << 28), (8, 4, 6, 28704, 1 << 30),
                                                    (8, 2, 3, 1040, 8 << 20)])
def test_forwarding_adds_a_forward_ring_per_local_rank_and_channel(R, L, C, row_bytes, nbytes):
    # ht_api.h: with forwarding the receive area holds the peer rings [R - 1][C] and the forward rings [L][C]
    ht = _ht(R, nbytes, True, ranks_per_node=L)
    rows = ht._ring_rows(row_bytes, C, "dispatch")
    rings = (R - 1 + L) * C
    assert rows % native.HT_CHUNK_ROWS == 0 and rows >= native.HT_MIN_RING_ROWS
    assert rings * rows * row_bytes <= ht.recv_bytes < rings * (rows + native.HT_CHUNK_ROWS) * row_bytes
    need = native.HT_MIN_RING_ROWS * rings * row_bytes * 2
    assert _ht(R, need, True, ranks_per_node=L)._ring_rows(row_bytes, C, "dispatch") == native.HT_MIN_RING_ROWS
    with pytest.raises(ValueError, match=f">= {need} bytes"):
        _ht(R, need - 32, True, ranks_per_node=L)._ring_rows(row_bytes, C, "dispatch")


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
