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
// A row all of whose chunks fall back fills the slot exactly: 2H + H/32 bytes.
#pragma once

#include <stdint.h>

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
static_assert(kLogfmtSignBit0 + kLogfmtBlockValues == kLogfmtBlockBytes * 8, "codes and signs fill a block");
static_assert(kLogfmtMinHidden == 2048, "DeepEP's smallest LogFMT hidden size carries a whole 32-bit sequence");

// Chunk size (channels decided together): 1024 where hidden allows, else 512. hidden % 512 == 0 (ll_layout.h).
constexpr int logfmt_chunk(int hidden) { return hidden % 1024 == 0 ? 1024 : 512; }
constexpr int64_t logfmt_meta_bytes(int hidden) { return int64_t(hidden) / kLogfmtGroup * kLogfmtMetaEntryBytes; }
constexpr int64_t logfmt_cast_bytes(int channels) { return int64_t(channels) / kLogfmtBlockValues * kLogfmtBlockBytes; }
constexpr int64_t logfmt_bf16_bytes(int channels) { return int64_t(channels) * 2; }
// The most bytes a row takes (every chunk BF16), and what a fully cast row takes (DeepEP's byte count).
constexpr int64_t logfmt_max_row_bytes(int hidden) { return logfmt_meta_bytes(hidden) + logfmt_bf16_bytes(hidden); }
constexpr int64_t logfmt_cast_row_bytes(int hidden) { return logfmt_meta_bytes(hidden) + logfmt_cast_bytes(hidden); }
constexpr bool logfmt_hidden_ok(int hidden) { return hidden >= kLogfmtMinHidden && hidden % 512 == 0; }

static_assert(logfmt_cast_bytes(1024) == 1280 && logfmt_cast_bytes(512) == 640, "DeepEP's chunk sizes");
static_assert(logfmt_cast_row_bytes(7168) == 9184 && logfmt_max_row_bytes(7168) == 2 * 7168 + 7168 / 32,
              "DeepEP's sizes at hidden 7168; the largest row fills a combine slot (2H + H/128 * 4)");
static_assert(logfmt_meta_bytes(2048) / 2 == kLogfmtSeqBits, "a half-word's sign bit per sequence bit");

}  // namespace portep
