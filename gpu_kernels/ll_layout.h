// The low-latency mode's layout of one buffer half, the one definition both backends use (the host backend through
// the bindings' ll_layout(), the CUDA kernels through the offsets the host side computes from it). Offsets are
// bytes into a rank's data region and the same on every rank; two halves follow each other from offset 0 and every
// LL call flips the half.
//
//   send [send_off(h), + send_bytes)  dispatch: messages staged for proxy peers; combine: expert outputs
//                                      [E_l][R*T] rows of comb_pitch bytes (DeepEP's zero-copy buffer)
//   recv [recv_off(h), + recv_bytes)  dispatch: [R][E_l][T] messages; combine: [E][T] rows of comb_pitch bytes
//
// A dispatch message (disp_bytes) is a 16-byte header and the larger payload: a BF16 row (2H bytes) or an FP8 row
// with its H/128 float32 scales. A combine row (comb_pitch) is the BF16 row and a tail of H/128 * 4 bytes whose
// first int32 carries the call's sequence number. send_bytes and recv_bytes are the larger need of the two phases,
// since dispatch and combine of one half share them. gpu_kernels/cuda/ll_api.h and backends/host/ll.py describe
// what sits where inside these areas.
#pragma once

#include <stdint.h>

namespace portep {

constexpr int kLLHiddenStep = 512;  // hidden must be a multiple: 16-byte combine rows, whole FP8 scale groups
constexpr uint64_t kLLMessageHeaderBytes = 16;
constexpr int kLLScaleGroup = 128;  // channels per FP8 scale

struct LLHalfLayout {
  int T = 0, H = 0, E = 0, R = 0, E_l = 0, M = 0;  // tokens per rank, hidden, experts, ranks, E / R, R * T
  uint64_t disp_bytes = 0, comb_pitch = 0;
  uint64_t send_bytes = 0, recv_bytes = 0, half_bytes = 0;

  constexpr uint64_t send_off(int half) const { return uint64_t(half) * half_bytes; }
  constexpr uint64_t recv_off(int half) const { return uint64_t(half) * half_bytes + send_bytes; }
  constexpr uint64_t total_bytes() const { return 2 * half_bytes; }
};

constexpr uint64_t ll_max(uint64_t a, uint64_t b) { return a > b ? a : b; }

// Callers check hidden % kLLHiddenStep == 0 and num_experts % num_ranks == 0 first (the bindings raise).
constexpr LLHalfLayout ll_half_layout(int T, int H, int E, int R) {
  LLHalfLayout l;
  l.T = T, l.H = H, l.E = E, l.R = R, l.E_l = E / R, l.M = R * T;
  const uint64_t h = uint64_t(H), t = uint64_t(T), e = uint64_t(E);
  l.disp_bytes = kLLMessageHeaderBytes + ll_max(2 * h, h + h / kLLScaleGroup * 4);
  l.comb_pitch = 2 * h + h / kLLScaleGroup * 4;
  l.send_bytes = ll_max(t * l.disp_bytes, e * t * l.comb_pitch);
  l.recv_bytes = ll_max(e * t * l.disp_bytes, e * t * l.comb_pitch);
  l.half_bytes = l.send_bytes + l.recv_bytes;
  return l;
}

// DeepEP's test shape (128 tokens, hidden 7168, 288 experts on 2 ranks) and the smallest hidden: rows and messages
// stay 16-byte aligned, which the kernels' vector copies need.
static_assert(ll_half_layout(128, 7168, 288, 2).comb_pitch % 16 == 0, "combine rows must be 16-byte aligned");
static_assert(ll_half_layout(128, 7168, 288, 2).disp_bytes % 16 == 0, "dispatch messages must be 16-byte aligned");
static_assert(ll_half_layout(1, kLLHiddenStep, 1, 1).comb_pitch % 16 == 0, "combine rows must be 16-byte aligned");
static_assert(ll_half_layout(1, kLLHiddenStep, 1, 1).disp_bytes % 16 == 0, "dispatch messages must be 16-byte aligned");
static_assert(ll_half_layout(128, 7168, 288, 2).disp_bytes == 16 + 2 * 7168, "BF16 is the larger payload");

}  // namespace portep
