#include "gpu_kernels/host/logfmt_rows.h"

#include <string.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "gpu_kernels/host/bf16.h"
#include "gpu_kernels/ll_layout.h"
#include "gpu_kernels/logfmt.h"

namespace portep {

static_assert(ll_half_layout(1, 7168, 8, 1).comb_pitch == uint64_t(logfmt_max_row_bytes(7168)) &&
                  ll_half_layout(1, 2048, 8, 1).comb_pitch == uint64_t(logfmt_max_row_bytes(2048)),
              "an all-BF16 LogFMT row fills a combine row slot exactly");

namespace {

// A group's scale, and whether it is cast, from its metadata magnitudes (sign bits cleared).
struct GroupScale {
  LogfmtScale scale;
  bool castable;
};

GroupScale group_scale(uint16_t amax, uint16_t amin) {
  return GroupScale{logfmt_scale(amax, amin), logfmt_castable(amax, amin)};
}

// 16 channels into a 20-byte block (logfmt.h's bit layout).
void pack_block(uint8_t* dst, const uint16_t* x, const LogfmtEncoding& e) {
  uint32_t w[kLogfmtBlockBytes / 4] = {};
  for (int k = 0; k < kLogfmtBlockValues; ++k) {
    const uint32_t code = logfmt_encode_value(bf16_to_f32(uint16_t(x[k] & ~kLogfmtSignMask)), e);
    const int bit = k * kLogfmtCodeBits, word = bit / 32, shift = bit % 32;
    w[word] |= code << shift;
    if (shift + kLogfmtCodeBits > 32) w[word + 1] |= code >> (32 - shift);
    const int sign = kLogfmtSignBit0 + k;
    w[sign / 32] |= uint32_t(x[k] >> 15) << (sign % 32);
  }
  memcpy(dst, w, sizeof(w));  // little-endian words: the format's bit order on little-endian hosts
}

void unpack_block(float* out, const uint8_t* src, const GroupScale& g) {
  uint32_t w[kLogfmtBlockBytes / 4];
  memcpy(w, src, sizeof(w));
  for (int k = 0; k < kLogfmtBlockValues; ++k) {
    const float v = logfmt_decode_value(logfmt_block_code(w, k), g.scale);
    out[k] = logfmt_block_negative(w, k) ? -v : v;
  }
}

void check_hidden(int hidden) {
  if (!logfmt_hidden_ok(hidden))
    throw std::invalid_argument("LogFMT rows: hidden=" + std::to_string(hidden) +
                                " must be a multiple of 512, at least " + std::to_string(kLogfmtMinHidden) +
                                " and at most " + std::to_string(kLogfmtMaxChunks) + " chunks of " +
                                std::to_string(logfmt_chunk(hidden)) + " channels");
}

// The groups' scales from a row's metadata, sign bits (the sequence number) cleared.
void read_scales(std::vector<GroupScale>& gs, const uint8_t* row, int hidden) {
  const uint16_t* meta = reinterpret_cast<const uint16_t*>(row);
  gs.resize(size_t(hidden / kLogfmtGroup));
  for (size_t g = 0; g < gs.size(); ++g)
    gs[g] = group_scale(uint16_t(meta[2 * g] & ~kLogfmtSignMask), uint16_t(meta[2 * g + 1] & ~kLogfmtSignMask));
}

bool chunk_cast(const std::vector<GroupScale>& gs, int chunk, int c) {
  const int per = chunk / kLogfmtGroup;
  for (int g = c * per; g < (c + 1) * per; ++g)
    if (!gs[size_t(g)].castable) return false;
  return true;
}

void encode_row(uint8_t* dst, const uint16_t* x, int hidden, uint32_t seq, std::vector<GroupScale>& gs) {
  uint16_t* meta = reinterpret_cast<uint16_t*>(dst);
  const int groups = hidden / kLogfmtGroup, chunk = logfmt_chunk(hidden);
  for (int g = 0; g < groups; ++g) {
    uint16_t amax = 0, amin = kLogfmtBf16Inf;
    for (int i = g * kLogfmtGroup; i < (g + 1) * kLogfmtGroup; ++i) {
      const uint16_t m = uint16_t(x[i] & ~kLogfmtSignMask);
      if (m > kLogfmtBf16Inf) continue;  // NaN: left out of the range, as DeepEP's __hmax2/__hmin2 leave it
      amax = m > amax ? m : amax;        // magnitudes order as their bit patterns do
      amin = m < amin ? m : amin;
    }
    meta[2 * g] = amax, meta[2 * g + 1] = amin;
  }
  read_scales(gs, dst, hidden);
  uint8_t* at = dst + logfmt_meta_bytes(hidden);
  for (int c = 0; c < hidden / chunk; ++c) {
    const uint16_t* xc = x + int64_t(c) * chunk;
    if (!chunk_cast(gs, chunk, c)) {
      memcpy(at, xc, size_t(logfmt_bf16_bytes(chunk)));
      at += logfmt_bf16_bytes(chunk);
      continue;
    }
    for (int g = 0; g < chunk / kLogfmtGroup; ++g) {
      const LogfmtEncoding e = logfmt_encoding(gs[size_t(c * chunk / kLogfmtGroup + g)].scale);
      for (int b = 0; b < kLogfmtGroup / kLogfmtBlockValues; ++b, at += kLogfmtBlockBytes)
        pack_block(at, xc + g * kLogfmtGroup + b * kLogfmtBlockValues, e);
    }
  }
  for (int i = 0; i < kLogfmtSeqBits; ++i) meta[i] = uint16_t(meta[i] | ((seq >> i & 1u) << 15));
}

}  // namespace

void host_logfmt_encode_rows(ByteSpan dst, int64_t dst_pitch, const int64_t* dst_idx, ByteSpan src, int64_t src_pitch,
                             const int64_t* src_idx, int64_t n, int hidden, uint32_t seq) {
  check_hidden(hidden);
  std::vector<GroupScale> gs;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t d = dst_idx ? dst_idx[i] : i, s = src_idx ? src_idx[i] : i;
    check_row("logfmt_encode_rows: dst", dst, d, dst_pitch, logfmt_max_row_bytes(hidden));
    check_row("logfmt_encode_rows: src", src, s, src_pitch, logfmt_bf16_bytes(hidden));
    encode_row(dst.data + d * dst_pitch, reinterpret_cast<const uint16_t*>(src.data + s * src_pitch), hidden, seq, gs);
  }
}

void host_logfmt_row_seqs(uint32_t* out, ByteSpan rows, int64_t pitch, const int64_t* idx, int64_t n, int hidden) {
  check_hidden(hidden);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = idx ? idx[i] : i;
    check_row("logfmt_row_seqs", rows, r, pitch, logfmt_meta_bytes(hidden));
    const uint16_t* meta = reinterpret_cast<const uint16_t*>(rows.data + r * pitch);
    uint32_t seq = 0;
    for (int b = 0; b < kLogfmtSeqBits; ++b) seq |= uint32_t(meta[b] >> 15) << b;
    out[i] = seq;
  }
}

void host_logfmt_decode_row(float* out, const uint8_t* row, int hidden) {
  check_hidden(hidden);
  thread_local std::vector<GroupScale> gs;
  read_scales(gs, row, hidden);
  const int chunk = logfmt_chunk(hidden);
  const uint8_t* at = row + logfmt_meta_bytes(hidden);
  for (int c = 0; c < hidden / chunk; ++c) {
    float* oc = out + int64_t(c) * chunk;
    if (!chunk_cast(gs, chunk, c)) {
      const uint16_t* b = reinterpret_cast<const uint16_t*>(at);
      for (int i = 0; i < chunk; ++i) oc[i] = bf16_to_f32(b[i]);
      at += logfmt_bf16_bytes(chunk);
      continue;
    }
    for (int b = 0; b < chunk / kLogfmtBlockValues; ++b, at += kLogfmtBlockBytes)
      unpack_block(oc + b * kLogfmtBlockValues, at, gs[size_t((c * chunk + b * kLogfmtBlockValues) / kLogfmtGroup)]);
  }
}

}  // namespace portep
