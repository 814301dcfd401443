#include "gpu_kernels/host/row_kernels.h"

#include <string.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "gpu_kernels/host/bf16.h"
#include "gpu_kernels/host/logfmt_rows.h"
#include "gpu_kernels/logfmt.h"

namespace portep {

namespace {
// decoded: scratch of `width` floats for kRowLogfmt rows.
void accumulate(float* acc, const uint8_t* row, int dtype, int64_t width, float w, std::vector<float>& decoded) {
  if (dtype == kRowLogfmt) {
    decoded.resize(size_t(width));
    host_logfmt_decode_row(decoded.data(), row, int(width));
    for (int64_t i = 0; i < width; ++i) acc[i] += w * decoded[size_t(i)];
  } else if (dtype == kRowBf16) {
    const uint16_t* r = reinterpret_cast<const uint16_t*>(row);
    for (int64_t i = 0; i < width; ++i) acc[i] += w * bf16_to_f32(r[i]);
  } else {
    const float* r = reinterpret_cast<const float*>(row);
    for (int64_t i = 0; i < width; ++i) acc[i] += w * r[i];
  }
}
}  // namespace

void check_row(const char* what, const ByteSpan& span, int64_t r, int64_t pitch, int64_t row_bytes) {
  if (r < 0 || r * pitch + row_bytes > span.bytes)
    throw std::invalid_argument(std::string(what) + ": row " + std::to_string(r) + " (" + std::to_string(row_bytes) +
                                " bytes at a pitch of " + std::to_string(pitch) + ") lies outside its " +
                                std::to_string(span.bytes) + " bytes");
}

void host_copy_rows(ByteSpan dst, int64_t dst_pitch, const int64_t* dst_idx, ByteSpan src, int64_t src_pitch,
                    const int64_t* src_idx, int64_t n, int64_t row_bytes) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t d = dst_idx ? dst_idx[i] : i;
    const int64_t s = src_idx ? src_idx[i] : i;
    check_row("copy_rows: dst", dst, d, dst_pitch, row_bytes);
    check_row("copy_rows: src", src, s, src_pitch, row_bytes);
    memcpy(dst.data + d * dst_pitch, src.data + s * src_pitch, size_t(row_bytes));
  }
}

namespace {
int64_t source_row_bytes(int dtype, int64_t width) {
  return dtype == kRowLogfmt ? logfmt_max_row_bytes(int(width)) : width * (dtype == kRowBf16 ? 2 : 4);
}
}  // namespace

void host_reduce_rows(ByteSpan out, int64_t out_pitch, int out_dtype, int64_t n, int64_t width,
                      const ReduceSource* sources, int num_sources, const float* init) {
  std::vector<float> acc(static_cast<size_t>(width)), decoded;
  const int64_t out_row = width * (out_dtype == kRowBf16 ? 2 : 4);
  for (int64_t t = 0; t < n; ++t) {
    check_row("reduce_rows: out", out, t, out_pitch, out_row);
    if (init)
      memcpy(acc.data(), init + t * width, size_t(width) * 4);
    else
      std::fill(acc.begin(), acc.end(), 0.0f);
    for (int j = 0; j < num_sources; ++j) {
      const ReduceSource& s = sources[j];
      const int64_t r = s.index[t];
      if (r < 0) continue;
      check_row("reduce_rows: a source", s.rows, r, s.pitch, source_row_bytes(s.dtype, width));
      accumulate(acc.data(), s.rows.data + r * s.pitch, s.dtype, width, s.weight ? s.weight[t] : 1.0f, decoded);
    }
    uint8_t* o = out.data + t * out_pitch;
    if (out_dtype == kRowBf16) {
      uint16_t* ob = reinterpret_cast<uint16_t*>(o);
      for (int64_t i = 0; i < width; ++i) ob[i] = f32_to_bf16(acc[size_t(i)]);
    } else {
      memcpy(o, acc.data(), size_t(width) * 4);
    }
  }
}

}  // namespace portep
