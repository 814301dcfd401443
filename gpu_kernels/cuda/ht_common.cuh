// Device helpers shared by the normal-mode (HT) kernels (layouts in ht_api.h).
#pragma once

#include <stdint.h>

#include "ht_api.h"
#include "ll_common.cuh"

namespace portep::cuda {

constexpr int kHTWarps = 32;  // warps per data block: one token (or row) per warp per batch
constexpr int kHTThreads = kHTWarps * kWarpSize;
constexpr uint32_t kErrBufferTooSmall = 6;  // LLError code: rows past the data area (src = destination rank)

// DeepEP's split of tokens into channels: contiguous ranges of ceil(N / C) tokens.
PORTEP_DEVICE int channel_tokens(int num_tokens, int num_channels) {
  return num_tokens > 0 ? (num_tokens + num_channels - 1) / num_channels : 1;
}
PORTEP_DEVICE int channel_begin(int num_tokens, int num_channels, int ch) {
  return min(num_tokens, ch * channel_tokens(num_tokens, num_channels));
}

PORTEP_DEVICE uint8_t* notify_slot(const HTCommon& c, uint8_t* region, int src) {
  return region + c.ctrl_off + uint64_t(src) * kHTSlotBytes;
}
PORTEP_DEVICE int32_t* slot_counts(uint8_t* slot) { return reinterpret_cast<int32_t*>(slot + 8); }
PORTEP_DEVICE int32_t* slot_channels(uint8_t* slot) { return slot_counts(slot) + kHTMaxRanks; }
PORTEP_DEVICE int32_t* slot_experts(uint8_t* slot) { return slot_channels(slot) + kHTMaxChannels; }

// combine = false: dispatch tails; true: combine tails. In `region`'s control area, (source, channel).
PORTEP_DEVICE uint64_t* tail_word(const HTCommon& c, uint8_t* region, bool combine, int src, int ch) {
  uint8_t* tails = region + c.ctrl_off + kHTMaxRanks * kHTSlotBytes + (combine ? kHTTailBytes : 0);
  return reinterpret_cast<uint64_t*>(tails) + src * kHTMaxChannels + ch;
}
PORTEP_DEVICE uint64_t tail_value(uint64_t epoch, uint32_t rows) { return epoch << 32 | rows; }

// rank_prefix_matrix (inclusive over sources): rows from sources before s to d, and from s to d.
PORTEP_DEVICE int rows_before(const int32_t* rpm, int R, int s, int d) { return s > 0 ? rpm[(s - 1) * R + d] : 0; }
PORTEP_DEVICE int rows_from(const int32_t* rpm, int R, int s, int d) {
  return rpm[s * R + d] - rows_before(rpm, R, s, d);
}

// Lane 0 waits until the tail word reaches (epoch, rows); false after the timeout (reported as a wait on src).
PORTEP_DEVICE bool await_tail(const HTCommon& c, const uint64_t* word, uint64_t epoch, uint32_t rows, int src,
                              int ch) {
  uint64_t v = 0, waited = 0;
  const uint64_t want = tail_value(epoch, rows);
  if (wait_until([&] { return ld_acquire_sys_u64(word); }, [&](uint64_t x) { return x >= want; }, c.timeout_ns, &v,
                 &waited))
    return true;
  report_error(c.error, kErrWaitTimeout, uint32_t(c.rank), uint32_t(src), uint32_t(ch));
  return false;
}

// Publishes `rows` stores of this block to dst's tail word: the block's stores before the barrier are visible
// system-wide before the tail (fence after the barrier, then a plain store). Called by one thread.
PORTEP_DEVICE void publish_tail(uint64_t* word, uint64_t epoch, uint32_t rows) {
  fence_sys();
  st_relaxed_sys_u64(word, tail_value(epoch, rows));
}

PORTEP_DEVICE bool any_error(const HTCommon& c) { return *reinterpret_cast<volatile uint32_t*>(&c.error->code) != 0; }

}  // namespace portep::cuda
