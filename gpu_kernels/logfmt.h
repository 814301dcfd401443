// LogFMT-10, the low-latency combine's optional row format (low_latency_combine(use_logfmt=True)): DeepEP's format
// (docs/logfmt.md), with the call's sequence number carried in the metadata's sign bits. The one definition of the
// wire format; gpu_kernels/host/logfmt_rows.cpp encodes and decodes it on the host backend.
//
// A row of H BF16 channels occupies one combine row slot (ll_layout.h's comb_pitch, 2H + H/32 bytes):
//   [0, H/32)     metadata: per group g of 128 channels two BF16 magnitudes, amax_g then amin_g (max and min of |x|
//                 over the group). Their sign bits, always 0 in a magnitude, carry the call's sequence number: bit
//                 i of it (i < 32) in the sign bit of half-word i (amax_0, amin_0, amax_1, ...), hence H >= 2048.
//   [H/32, ...)   the chunks of kLogfmtChunk(H) channels, back to back: a chunk is cast (10 bits a value:
//                 chunk * 10 / 8 bytes) when every group in it is castable (logfmt_castable), else its BF16 bytes
//                 unchanged (chunk * 2 bytes). The receiver recomputes each decision from the metadata.
// A cast chunk is blocks of 16 channels in 20 bytes, little-endian bits: bits [9k, 9k + 9) the code of channel k,
// bits 144 + k its sign. Code 0 is zero; code c > 0 is 2^(Lmin + (c - 1) * s), s = (Lmax - Lmin) / 510 (FP32).
// A row all of whose chunks fall back fills the slot exactly: 2H + H/32 bytes. The CUDA kernels write no sequence
// number (their flags order the calls); receivers clear the sign bits either way.
//
// The arithmetic (below: a group's scale, a value's code and its decoding) is FP32, each product and sum rounded on
// its own (no fused multiply-add), with log2f / exp2f: the host's C library's, the GPU's accurate ones (not the
// approximate lg2 / ex2 that DeepEP's kernels use). The two may differ in the last bit, so a code may differ by one
// level on a level boundary; cast decisions, metadata, signs and BF16 chunks never differ.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "gpu_kernels/host_device.h"

namespace portep {

constexpr int kLogfmtGroup = 128;         // channels per metadata entry
constexpr int kLogfmtMetaEntryBytes = 4;  // BF16 amax, BF16 amin
constexpr int kLogfmtBlockValues = 16;    // channels per packed block
constexpr int kLogfmtBlockBytes = 20;     // 16 x 9-bit codes, then 16 sign bits
constexpr int kLogfmtCodeBits = 9;
constexpr int kLogfmtSignBit0 = kLogfmtBlockValues * kLogfmtCodeBits;  // bit of channel 0's sign in a block
constexpr uint32_t kLogfmtMaxCode = (1u << kLogfmtCodeBits) - 1;
constexpr int kLogfmtLevels = int(kLogfmtMaxCode) - 1;  // s divides the log range into 510 steps
constexpr float kLogfmtRange = 32.0f;                   // Lmin >= Lmax - 32: 32 binades at most
constexpr int kLogfmtSeqBits = 32;
constexpr int kLogfmtMinHidden = kLogfmtSeqBits / 2 * kLogfmtGroup;  // two sign bits per group carry the sequence
constexpr int kLogfmtMaxChunks = 32;  // a row's cast decisions fit one 32-bit mask (the CUDA receive side's)
constexpr uint16_t kLogfmtSignMask = 0x8000u, kLogfmtBf16One = 0x3f80u, kLogfmtBf16Inf = 0x7f80u;
static_assert(kLogfmtSignBit0 + kLogfmtBlockValues == kLogfmtBlockBytes * 8, "codes and signs fill a block");
static_assert(kLogfmtMinHidden == 2048, "DeepEP's smallest LogFMT hidden size carries a whole 32-bit sequence");

// Chunk size (channels decided together): 1024 where hidden allows, else 512. hidden % 512 == 0 (ll_layout.h).
PORTEP_HOST_DEVICE constexpr int logfmt_chunk(int hidden) { return hidden % 1024 == 0 ? 1024 : 512; }
PORTEP_HOST_DEVICE constexpr int64_t logfmt_meta_bytes(int hidden) {
  return int64_t(hidden) / kLogfmtGroup * kLogfmtMetaEntryBytes;
}
PORTEP_HOST_DEVICE constexpr int64_t logfmt_cast_bytes(int channels) {
  return int64_t(channels) / kLogfmtBlockValues * kLogfmtBlockBytes;
}
PORTEP_HOST_DEVICE constexpr int64_t logfmt_bf16_bytes(int channels) { return int64_t(channels) * 2; }
// The most bytes a row takes (every chunk BF16), and what a fully cast row takes (DeepEP's byte count).
PORTEP_HOST_DEVICE constexpr int64_t logfmt_max_row_bytes(int hidden) {
  return logfmt_meta_bytes(hidden) + logfmt_bf16_bytes(hidden);
}
PORTEP_HOST_DEVICE constexpr int64_t logfmt_cast_row_bytes(int hidden) {
  return logfmt_meta_bytes(hidden) + logfmt_cast_bytes(hidden);
}
PORTEP_HOST_DEVICE constexpr bool logfmt_hidden_ok(int hidden) {
  return hidden >= kLogfmtMinHidden && hidden % 512 == 0 && hidden / logfmt_chunk(hidden) <= kLogfmtMaxChunks;
}

static_assert(logfmt_cast_bytes(1024) == 1280 && logfmt_cast_bytes(512) == 640, "DeepEP's chunk sizes");
static_assert(logfmt_cast_row_bytes(7168) == 9184 && logfmt_max_row_bytes(7168) == 2 * 7168 + 7168 / 32,
              "DeepEP's sizes at hidden 7168; the largest row fills a combine slot (2H + H/128 * 4)");
static_assert(logfmt_meta_bytes(2048) / 2 == kLogfmtSeqBits, "a half-word's sign bit per sequence bit");
static_assert(logfmt_hidden_ok(32768) && !logfmt_hidden_ok(33792) && logfmt_hidden_ok(16384 - 512) &&
                  !logfmt_hidden_ok(16384 + 512),
              "at most 32 chunks a row: hidden <= 32768 (chunks of 1024), <= 16384 (chunks of 512)");
static_assert(logfmt_meta_bytes(2048) % 16 == 0 && logfmt_cast_bytes(512) % 16 == 0,
              "metadata and every chunk keep the next chunk 16-byte aligned (the kernels' vector loads)");

// A metadata entry read as one little-endian uint32 (amax | amin << 16) with its sign bits cleared.
constexpr uint32_t kLogfmtMetaMagnitudes = 0x7fff7fffu;
static_assert(kLogfmtMetaMagnitudes == (0xffffu & ~kLogfmtSignMask) * 0x10001u, "both halves' sign bits cleared");

// Channel k's code and sign in a cast block read as five little-endian uint32 words (the bit layout above).
PORTEP_HOST_DEVICE uint32_t logfmt_block_code(const uint32_t* w, int k) {
  const int bit = k * kLogfmtCodeBits, word = bit / 32, shift = bit % 32;
  uint32_t code = w[word] >> shift;
  if (shift + kLogfmtCodeBits > 32) code |= w[word + 1] << (32 - shift);
  return code & kLogfmtMaxCode;
}
PORTEP_HOST_DEVICE bool logfmt_block_negative(const uint32_t* w, int k) {
  const int bit = kLogfmtSignBit0 + k;
  return w[bit / 32] >> (bit % 32) & 1u;
}

// Whether a group is cast, from its metadata magnitudes (sign bits cleared): 0 < amax < 1 and amin < amax. DeepEP
// tests the same in logs (log2(amax) < 0 and log2(amin) < log2(amax)); magnitudes order as their bit patterns do,
// and a NaN never enters the range (the encoder leaves NaNs out; an all-NaN group has amax 0).
PORTEP_HOST_DEVICE constexpr bool logfmt_castable(uint16_t amax, uint16_t amin) {
  return amax > 0 && amax < kLogfmtBf16One && amin < amax;
}
static_assert(logfmt_castable(0x3f7f, 0) && !logfmt_castable(kLogfmtBf16One, 0) && !logfmt_castable(0, 0) &&
                  !logfmt_castable(0x3e00, 0x3e00) && !logfmt_castable(0, kLogfmtBf16Inf),
              "cast below 1, with some range, never an empty or all-NaN group");

// Products and sums rounded on their own: the compilers may not fuse them into one multiply-add.
PORTEP_HOST_DEVICE float logfmt_mul(float a, float b) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
PORTEP_HOST_DEVICE float logfmt_add(float a, float b) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

PORTEP_HOST_DEVICE float logfmt_bf16_value(uint16_t v) {
  const uint32_t bits = uint32_t(v) << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

// A group's log range from its metadata magnitudes: Lmax = log2(amax), Lmin = max(log2(amin), Lmax - 32) (Lmax - 32
// for amin 0), and the step between levels, (Lmax - Lmin) / 510.
struct LogfmtScale {
  float lmin, step;
};
PORTEP_HOST_DEVICE LogfmtScale logfmt_scale(uint16_t amax, uint16_t amin) {
  const float lmax = log2f(logfmt_bf16_value(amax));
  const float floor_l = logfmt_add(lmax, -kLogfmtRange);
  const float lmin = amin == 0 ? floor_l : fmaxf(log2f(logfmt_bf16_value(amin)), floor_l);
  return LogfmtScale{lmin, logfmt_add(lmax, -lmin) / float(kLogfmtLevels)};
}

// The encoder's constants of a cast group: code = floor(max(log2(a) * sinv + bias, 0)), which rounds to the nearest
// level in the linear domain (bias = 2 - log2((1 + 2^s) / 2) / s - Lmin / s).
struct LogfmtEncoding {
  float sinv, bias;
};
PORTEP_HOST_DEVICE LogfmtEncoding logfmt_encoding(const LogfmtScale& g) {
  const float sinv = 1.0f / g.step;
  const float mid = logfmt_mul(log2f(logfmt_mul(logfmt_add(1.0f, exp2f(g.step)), 0.5f)), sinv);
  return LogfmtEncoding{sinv, logfmt_add(logfmt_add(2.0f, -mid), -logfmt_mul(g.lmin, sinv))};
}

// The code of magnitude a (0 for zero, NaN and values below half the lowest level; a tie goes up).
PORTEP_HOST_DEVICE uint32_t logfmt_encode_value(float a, const LogfmtEncoding& e) {
  const float code = floorf(fmaxf(logfmt_add(logfmt_mul(log2f(a), e.sinv), e.bias), 0.0f));
  return code >= float(kLogfmtMaxCode) ? kLogfmtMaxCode : uint32_t(code);
}

// The magnitude of code c: 0, or 2^(Lmin + (c - 1) * s).
PORTEP_HOST_DEVICE float logfmt_decode_value(uint32_t code, const LogfmtScale& g) {
  return code == 0 ? 0.0f : exp2f(logfmt_add(logfmt_mul(float(code - 1), g.step), g.lmin));
}

}  // namespace portep
