// V2 combine's final sum (python/portep/elastic/reduce.py, sum_slots), defined once for the host loop
// (gpu_kernels/host/slot_sums.cpp) and the kernel (gpu_kernels/cuda/slot_sums.cu): for each token t and channel h,
//   fp32(bias0) + fp32(bias1) (or +0.0 without a bias), then + fp32(rows[row_of_slot[t, k]]) for k = 0..K-1 where
//   that is >= 0, then + 0.0 if a slot had no row (else + -0.0, which changes nothing), rounded once to BF16.
// Plain FP32 additions in that order, no contraction, so the host and every GPU give the same bits as the same
// sequence of torch operations would, NaN's bits excepted: a NaN result is NaN at the same place, its bits as
// f32_to_bf16 keeps them (torch's own NaN bits differ by backend: 0x7FC0, 0x7FFF or 0xFFFF).
#pragma once

#include <stdint.h>

#include "gpu_kernels/host/bf16.h"
#include "gpu_kernels/host_device.h"

namespace portep {

struct SlotSumArgs {
  const uint16_t* rows;  // [num_rows, hidden] BF16 (num_rows may be 0)
  int64_t num_rows;
  const int64_t* row_of_slot;  // [num_tokens, num_topk]: the row that takes slot k's place, -1 where none
  const uint16_t* bias0;       // [num_tokens, hidden] BF16 or null
  const uint16_t* bias1;       // [num_tokens, hidden] BF16 or null (only beside bias0)
  uint16_t* out;               // [num_tokens, hidden] BF16
  int64_t num_tokens;
  int num_topk;
  int64_t hidden;
};

constexpr uint16_t kSlotSumBadRow = 0x7fc0;  // a quiet NaN: what a token gets for a row index past num_rows

// The most slots a token may have (the kernel keeps a token's rows in shared memory).
constexpr int kSlotSumMaxTopk = 128;

// Token t's rows in slot order into present[0..n) (present holds num_topk entries); returns n, or -1 where an index
// lies outside [-1, num_rows).
PORTEP_HOST_DEVICE int slot_rows_of(const SlotSumArgs& a, int64_t t, int64_t* present) {
  int n = 0;
  for (int k = 0; k < a.num_topk; ++k) {
    const int64_t r = a.row_of_slot[t * a.num_topk + k];
    if (r < -1 || r >= a.num_rows) return -1;
    if (r >= 0) present[n++] = r;
  }
  return n;
}

// The sum's start at [t, h]: fp32(bias0) + fp32(bias1), or +0.0 without a bias.
PORTEP_HOST_DEVICE float slot_sum_start(const SlotSumArgs& a, int64_t t, int64_t h) {
  const int64_t at = t * a.hidden + h;
  float acc = a.bias0 ? bf16_to_f32(a.bias0[at]) : 0.0f;
  if (a.bias1) acc = acc + bf16_to_f32(a.bias1[at]);
  return acc;
}

// The sum's end for a token with n of num_topk slots filled: + 0.0 if one was empty (x + -0.0 is x for every x;
// + 0.0 turns -0.0 into +0.0), rounded once to BF16.
PORTEP_HOST_DEVICE uint16_t slot_sum_end(const SlotSumArgs& a, float acc, int n) {
  return f32_to_bf16(acc + (n == a.num_topk ? -0.0f : 0.0f));
}

// out[t, h] from the token's rows (slot_rows_of), added in slot order.
PORTEP_HOST_DEVICE uint16_t slot_sum_at(const SlotSumArgs& a, int64_t t, int64_t h, const int64_t* present, int n) {
  float acc = slot_sum_start(a, t, h);
  for (int j = 0; j < n; ++j) acc = acc + bf16_to_f32(a.rows[present[j] * a.hidden + h]);
  return slot_sum_end(a, acc, n);
}

}  // namespace portep
