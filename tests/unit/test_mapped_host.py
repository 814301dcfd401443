"""MappedHost, the native owner of the mapped host words the CUDA kernels share with the host (error records, the
normal mode's count record, the peer watch's status words): Python holds the object, never an address. Without a
GPU its emulated form (plain host memory) checks what the bindings check: the size each one needs, use after
close, the error record's reading and the peer watch's mirror."""

import pytest
import torch

from portep import native

from native_channel import native_channel

pytestmark = pytest.mark.skipif(
    not native.build_info()["gpu_built"] or torch.cuda.is_available(),
    reason="needs portep's GPU kernels compiled in, and no GPU (emulated mapped memory is host memory)",
)

RECORD_WORDS = native.KERNEL_ERROR_BYTES // 4  # (code, rank, src, index, value...) as uint32 words


def _records():
    return native.MappedHost(native.KERNEL_ERROR_WORDS * native.KERNEL_ERROR_BYTES, emulated=True)


def test_mapped_host_words_start_zeroed_and_round_trip():
    m = native.MappedHost(64, emulated=True)
    assert m.nbytes == 64 and not m.closed
    assert [m.load_u32(i) for i in range(16)] == [0] * 16
    m.store_u32(3, 0xDEADBEEF)
    m.store_u32(15, 7)
    assert m.load_u32(3) == 0xDEADBEEF and m.load_u32(15) == 7 and m.load_u32(4) == 0
    m.zero()
    assert m.load_u32(3) == m.load_u32(15) == 0


def test_mapped_host_refuses_a_word_past_its_end_and_use_after_close():
    m = native.MappedHost(16, emulated=True)
    with pytest.raises(ValueError, match="store_u32: 16 bytes of mapped host memory, 20 needed"):
        m.store_u32(4, 1)
    m.close()
    m.close()  # a second close does nothing
    assert m.closed
    with pytest.raises(ValueError, match="load_u32: the mapped host memory was closed"):
        m.load_u32(0)
    with pytest.raises(ValueError, match="bytes must be positive"):
        native.MappedHost(0, emulated=True)


def test_an_error_record_reads_back_as_a_kernel_wrote_it():
    records = _records()
    assert native.kernel_error_record(records, 0) == (0, 0, 0, 0, 0)
    notice = RECORD_WORDS  # record 1 (notices): code, rank, src, index, then the 64-bit value
    for i, v in enumerate((5, 3, 2, 9)):
        records.store_u32(notice + i, v)
    records.store_u32(notice + 4, 12345)  # the 64-bit value's low word (little-endian), after the four fields
    code, rank, src, index, value = native.kernel_error_record(records, 1)
    assert (code, rank, src, index) == (5, 3, 2, 9) and value == 12345
    assert native.kernel_error_record(records, 0) == (0, 0, 0, 0, 0)
    with pytest.raises(IndexError, match="word 2 is not 0 or 1"):
        native.kernel_error_record(records, 2)
    with pytest.raises(ValueError, match="records: 8 bytes of mapped host memory"):
        native.kernel_error_record(native.MappedHost(8, emulated=True), 0)


def test_the_peer_watch_mirror_needs_status_streams_and_a_word_per_rank():
    plain = native_channel()
    plain.connect([plain.endpoint_blob()])
    plain.bootstrap_done()
    try:
        with pytest.raises(RuntimeError, match="this Channel has no status streams"):
            native.cuda_mirror_peer_status(plain, native.MappedHost(4, emulated=True))
    finally:
        plain.destroy()
