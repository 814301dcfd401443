// Host "kernels" for the row work of the EP protocols on the host backend: copying rows between arbitrary
// row positions of two buffers, and reducing rows from several sources in a fixed order with FP32
// accumulation (so results are bitwise reproducible). Torch-free: raw pointers, pitches and index arrays.
#pragma once

#include <stddef.h>
#include <stdint.h>

namespace portep {

// kRowLogfmt: a source row in LogFMT-10 (gpu_kernels/logfmt.h), decoded to FP32 before it is weighted and added.
enum RowDtype : int { kRowBf16 = 0, kRowF32 = 1, kRowLogfmt = 2 };

// A buffer and its size: every row a function touches is checked to lie inside it (std::invalid_argument names the
// row), so a wrong index raises instead of writing past the buffer.
struct ByteSpan {
  uint8_t* data;
  int64_t bytes;
};
// Throws unless row r of `pitch` bytes, `row_bytes` long, lies inside span (`what` names it in the message).
void check_row(const char* what, const ByteSpan& span, int64_t r, int64_t pitch, int64_t row_bytes);

// dst rows dst_idx[i] (or i when dst_idx is null) <- src rows src_idx[i] (or i), row_bytes each.
void host_copy_rows(ByteSpan dst, int64_t dst_pitch, const int64_t* dst_idx, ByteSpan src, int64_t src_pitch,
                    const int64_t* src_idx, int64_t n, int64_t row_bytes);

struct ReduceSource {
  ByteSpan rows;         // row r starts at rows.data + r * pitch
  int64_t pitch;         // bytes
  int dtype;             // RowDtype
  const int64_t* index;  // [n]: row of this source for output row t, or -1 (no contribution)
  const float* weight;   // [n] or null (weight 1)
};

// out[t] = sum over sources j in order of weight_j[t] * src_j[index_j[t]] (FP32), then cast to out_dtype.
// `init` (FP32 [n, width] or null) is the starting value (e.g. the bias sum).
void host_reduce_rows(ByteSpan out, int64_t out_pitch, int out_dtype, int64_t n, int64_t width,
                      const ReduceSource* sources, int num_sources, const float* init);

}  // namespace portep
