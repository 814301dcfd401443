// Host "kernels" for the row work of the EP protocols on the host backend: copying rows between arbitrary
// row positions of two buffers, and reducing rows from several sources in a fixed order with FP32
// accumulation (so results are bitwise reproducible). Torch-free: raw pointers, pitches and index arrays.
#pragma once

#include <stddef.h>
#include <stdint.h>

namespace portep {

// kRowLogfmt: a source row in LogFMT-10 (gpu_kernels/logfmt.h), decoded to FP32 before it is weighted and added.
enum RowDtype : int { kRowBf16 = 0, kRowF32 = 1, kRowLogfmt = 2 };

// dst rows dst_idx[i] (or i when dst_idx is null) <- src rows src_idx[i] (or i), row_bytes each.
void host_copy_rows(uint8_t* dst, int64_t dst_pitch, const int64_t* dst_idx, const uint8_t* src, int64_t src_pitch,
                    const int64_t* src_idx, int64_t n, int64_t row_bytes);

struct ReduceSource {
  const uint8_t* base;   // row r starts at base + r * pitch
  int64_t pitch;         // bytes
  int dtype;             // RowDtype
  const int64_t* index;  // [n]: row of this source for output row t, or -1 (no contribution)
  const float* weight;   // [n] or null (weight 1)
};

// out[t] = sum over sources j in order of weight_j[t] * src_j[index_j[t]] (FP32), then cast to out_dtype.
// `init` (FP32 [n, width] or null) is the starting value (e.g. the bias sum).
void host_reduce_rows(uint8_t* out, int64_t out_pitch, int out_dtype, int64_t n, int64_t width,
                      const ReduceSource* sources, int num_sources, const float* init);

}  // namespace portep
