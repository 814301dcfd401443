// LogFMT-10 rows (gpu_kernels/logfmt.h) on the host backend: encoding BF16 rows into combine row slots, reading the
// sequence number back, and decoding a row into FP32 (host_reduce_rows decodes kRowLogfmt sources with it).
// Torch-free: raw pointers, pitches and index arrays, as row_kernels.h.
#pragma once

#include <stdint.h>

#include "gpu_kernels/host/row_kernels.h"  // ByteSpan

namespace portep {

// dst rows dst_idx[i] (or i) <- the LogFMT encoding of BF16 rows src_idx[i] (or i) of `hidden` channels, with the
// call's sequence number `seq` in the metadata. Throws std::invalid_argument for a hidden size logfmt_hidden_ok
// refuses.
void host_logfmt_encode_rows(ByteSpan dst, int64_t dst_pitch, const int64_t* dst_idx, ByteSpan src, int64_t src_pitch,
                             const int64_t* src_idx, int64_t n, int hidden, uint32_t seq);

// out[i] <- the sequence number in row idx[i] (or i) of base.
void host_logfmt_row_seqs(uint32_t* out, ByteSpan rows, int64_t pitch, const int64_t* idx, int64_t n, int hidden);

// out[0, hidden) <- the FP32 values of one encoded row.
void host_logfmt_decode_row(float* out, const uint8_t* row, int hidden);

}  // namespace portep
