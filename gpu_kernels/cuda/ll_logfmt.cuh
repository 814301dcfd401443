// LogFMT-10 rows in the low-latency combine (low_latency_combine(use_logfmt=True)); the format and its arithmetic
// are gpu_kernels/logfmt.h's. The send side encodes each row as it stores it (a warp per row, straight into the
// peer's slot or the proxies' staging rows); the receive side decodes 16 channels at a time, fused with the
// weighted FP32 sum (ll_combine.cu). Both work in chunks: a chunk's bytes (cast or BF16) follow the earlier chunks'.
#pragma once

#include "gpu_kernels/cuda/ll_common.cuh"
#include "gpu_kernels/logfmt.h"

namespace portep::cuda {

// uint4 loads (8 channels each) per lane per chunk, at most (chunks of 1024 channels).
constexpr int kLogfmtMaxLoads = 1024 / 8 / kWarpSize;
constexpr int kLogfmtGroupLanes = kLogfmtGroup / 8;  // lanes whose loads make one group
static_assert(kLogfmtMaxLoads >= 1 && kWarpSize % kLogfmtGroupLanes == 0 && kLogfmtBlockValues == 16,
              "a warp's loads cover whole groups; a block is two lanes' loads");

// Magnitude range of the 8 BF16 values of v (NaNs left out), then over the aligned 16 lanes holding one group.
PORTEP_DEVICE void group_range(const uint4& v, uint32_t* amax, uint32_t* amin) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
  uint32_t hi = 0, lo = kLogfmtBf16Inf;
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    const uint32_t m = (words[q / 2] >> (16 * (q % 2))) & 0x7fffu;
    if (m > kLogfmtBf16Inf) continue;  // NaN
    hi = max(hi, m);
    lo = min(lo, m);
  }
#pragma unroll
  for (int o = kLogfmtGroupLanes / 2; o > 0; o /= 2) {
    hi = max(hi, warp_xor_u32(hi, o));
    lo = min(lo, warp_xor_u32(lo, o));
  }
  *amax = hi;
  *amin = lo;
}

// This lane's half of a 20-byte block: its 8 values' codes and signs at their bits (an even lane holds channels
// 0..7 of the block, an odd lane 8..15), the other half's bits zero.
PORTEP_DEVICE void block_half(const uint4& v, const LogfmtEncoding& e, bool odd, uint32_t w[5]) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
  uint64_t lo = 0;  // codes' bits 0..63 (code q at bit 9q)
  uint32_t hi = 0, signs = 0;
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    const uint32_t h = (words[q / 2] >> (16 * (q % 2))) & 0xffffu;
    const uint32_t code = logfmt_encode_value(logfmt_bf16_value(uint16_t(h & 0x7fffu)), e);
    lo |= uint64_t(code) << (9 * q);
    if (9 * q + 9 > 64) hi |= code >> (64 - 9 * q);
    signs |= (h >> 15) << q;
  }
  if (!odd) {  // bits 0..71, signs at 144..151
    w[0] = uint32_t(lo), w[1] = uint32_t(lo >> 32), w[2] = hi, w[3] = 0, w[4] = signs << 16;
  } else {  // bits 72..143, signs at 152..159
    w[0] = 0, w[1] = 0, w[2] = uint32_t(lo) << 8, w[3] = uint32_t(lo >> 24);
    w[4] = uint32_t(lo >> 56) | hi << 8 | signs << 24;
  }
}

// Warp-wide: the BF16 row src (hidden channels, 16-byte aligned) into dst (16-byte aligned) as a LogFMT-10 row
// without a sequence number. Every lane of the warp takes part.
PORTEP_DEVICE void warp_logfmt_encode(uint8_t* dst, const uint8_t* src, int hidden) {
  const int chunk = logfmt_chunk(hidden), loads = chunk / 8 / kWarpSize, lane = lane_id();
  const uint4* s = reinterpret_cast<const uint4*>(src);
  uint32_t* meta = reinterpret_cast<uint32_t*>(dst);
  uint8_t* at = dst + logfmt_meta_bytes(hidden);
  for (int c = 0; c < hidden / chunk; ++c) {
    uint4 v[kLogfmtMaxLoads];
    uint32_t amax[kLogfmtMaxLoads], amin[kLogfmtMaxLoads];
    bool castable = true;
#pragma unroll
    for (int i = 0; i < kLogfmtMaxLoads; ++i) {
      if (i >= loads) break;
      const int u = c * chunk / 8 + i * kWarpSize + lane;  // this lane's 8 channels
      v[i] = s[u];
      group_range(v[i], &amax[i], &amin[i]);
      if (lane % kLogfmtGroupLanes == 0) meta[u / kLogfmtGroupLanes] = amax[i] | amin[i] << 16;
      castable = castable && logfmt_castable(uint16_t(amax[i]), uint16_t(amin[i]));
    }
    if (!warp_all(castable)) {  // the chunk's BF16 bytes unchanged
#pragma unroll
      for (int i = 0; i < kLogfmtMaxLoads; ++i)
        if (i < loads) reinterpret_cast<uint4*>(at)[i * kWarpSize + lane] = v[i];
      at += logfmt_bf16_bytes(chunk);
      continue;
    }
#pragma unroll
    for (int i = 0; i < kLogfmtMaxLoads; ++i) {
      if (i >= loads) break;
      uint32_t w[5];
      block_half(v[i], logfmt_encoding(logfmt_scale(uint16_t(amax[i]), uint16_t(amin[i]))), lane & 1, w);
#pragma unroll
      for (int q = 0; q < 5; ++q) w[q] |= warp_xor_u32(w[q], 1);
      uint32_t* block = reinterpret_cast<uint32_t*>(at + (i * kWarpSize + lane) / 2 * kLogfmtBlockBytes);
      if (lane & 1) {
        block[3] = w[3], block[4] = w[4];
      } else {
        block[0] = w[0], block[1] = w[1], block[2] = w[2];
      }
    }
    at += logfmt_cast_bytes(chunk);
  }
}

// Block-wide: masks[i] <- bit c set where chunk c of row rows[i] (a LogFMT row, i < n) is cast, from its metadata.
// The caller synchronises before reading masks.
PORTEP_DEVICE void logfmt_cast_masks(const uint64_t* rows, int n, int hidden, uint32_t* masks) {
  const int chunk = logfmt_chunk(hidden), chunks = hidden / chunk, per = chunk / kLogfmtGroup, lane = lane_id();
  for (int i = int(threadIdx.x) / kWarpSize; i < n; i += int(blockDim.x) / kWarpSize) {
    const uint32_t* meta = reinterpret_cast<const uint32_t*>(rows[i]);
    bool cast = lane < chunks;
    for (int g = lane * per; cast && g < (lane + 1) * per; ++g) {
      const uint32_t m = meta[g] & kLogfmtMetaMagnitudes;  // sign bits: the host backend's sequence number
      cast = logfmt_castable(uint16_t(m), uint16_t(m >> 16));
    }
    const uint32_t mask = uint32_t(warp_ballot(cast));
    if (lane == 0) masks[i] = mask;
  }
}

// acc[0..16) += w * channels [16j, 16j + 16) of the LogFMT row `row` (mask: its cast chunks), each product and sum
// rounded on its own.
PORTEP_DEVICE void logfmt_accumulate(float* acc, const uint8_t* row, uint32_t mask, int j, int hidden, float w) {
  const int chunk = logfmt_chunk(hidden), c = 16 * j / chunk, within = 16 * j - c * chunk;
  const int64_t saved = logfmt_bf16_bytes(chunk) - logfmt_cast_bytes(chunk);  // per cast chunk before this one
  const uint8_t* at =
      row + logfmt_meta_bytes(hidden) + int64_t(c) * logfmt_bf16_bytes(chunk) - __popc(mask & ((1u << c) - 1u)) * saved;
  if (!(mask >> c & 1u)) {
    const uint4* b = reinterpret_cast<const uint4*>(at + int64_t(within) * 2);
    accumulate_row(acc, b[0], w);
    accumulate_row(acc + 8, b[1], w);
    return;
  }
  const uint32_t m = reinterpret_cast<const uint32_t*>(row)[16 * j / kLogfmtGroup] & kLogfmtMetaMagnitudes;
  const LogfmtScale g = logfmt_scale(uint16_t(m), uint16_t(m >> 16));
  const uint32_t* block = reinterpret_cast<const uint32_t*>(at + within / kLogfmtBlockValues * kLogfmtBlockBytes);
  uint32_t words[5];
#pragma unroll
  for (int q = 0; q < 5; ++q) words[q] = block[q];
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    const float v = logfmt_decode_value(logfmt_block_code(words, k), g);
    acc[k] = logfmt_add(acc[k], logfmt_mul(w, logfmt_block_negative(words, k) ? -v : v));
  }
}

}  // namespace portep::cuda
