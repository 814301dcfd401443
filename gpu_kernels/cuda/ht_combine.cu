// The HT combine data kernel (ht_api.h): per channel one block sends this rank's rows back to their sources and
// one block reduces this rank's own tokens (bias, then every rank's row in rank order, FP32, as the host backend).
#include <cuda_runtime.h>

#include "ht_common.cuh"

namespace portep::cuda {
namespace {

PORTEP_DEVICE int contribution_bytes(const HTCombineArgs& a) { return (2 * a.hidden + 4 * a.num_topk + 15) / 16 * 16; }

// Row (in the combine area of source s) where rank d's contributions to s begin.
PORTEP_DEVICE int64_t contributions_begin(const HTCombineArgs& a, int s, int d) {
  int64_t row = 0;
  for (int j = 0; j < d; ++j) row += rows_from(a.rank_prefix, a.c.num_ranks, s, j);
  return row;
}

// The rows of source s's tokens in channel ch back to s, batch by batch, each batch announced by s's tail.
PORTEP_DEVICE void send_to(const HTCombineArgs& a, int ch, int s, uint64_t epoch) {
  const HTCommon& c = a.c;
  const int R = c.num_ranks, C = c.num_channels, me = c.rank, warp = threadIdx.x / kWarpSize, lane = lane_id();
  const int bytes = contribution_bytes(a);
  const int begin = a.recv_channel_prefix[s * C + ch];
  const int end = ch + 1 < C ? a.recv_channel_prefix[s * C + ch + 1] : rows_from(a.rank_prefix, R, s, me);
  const int64_t x_first = rows_before(a.rank_prefix, R, s, me) + begin;
  const int64_t dst_first = contributions_begin(a, s, me) + begin;
  if (uint64_t(contributions_begin(a, s, R)) * bytes > c.data_bytes) {
    if (threadIdx.x == 0) report_error(c.error, kErrBufferTooSmall, uint32_t(me), uint32_t(s), 0);
    return;
  }
  uint8_t* area = c.peers[s] + c.data_off;
  for (int b = 0; b < end - begin; b += kHTWarps) {
    const int r = b + warp;
    if (r < end - begin) {
      uint8_t* dst = area + uint64_t(dst_first + r) * bytes;
      warp_copy16(reinterpret_cast<uint4*>(dst), reinterpret_cast<const uint4*>(a.x + (x_first + r) * a.hidden),
                  a.hidden * 2 / 16);
      if (a.topk_weights) {
        float* w = reinterpret_cast<float*>(dst + 2 * a.hidden);
        for (int k = lane; k < a.num_topk; k += kWarpSize) w[k] = a.topk_weights[(x_first + r) * a.num_topk + k];
      }
    }
    __syncthreads();
    if (threadIdx.x == 0)
      publish_tail(tail_word(c, c.peers[s], true, me, ch), epoch, uint32_t(min(b + kHTWarps, end - begin)));
  }
}

PORTEP_DEVICE void send_channel(const HTCombineArgs& a, int ch) {
  const uint64_t epoch = *a.c.epoch;
  for (int s = 0; s < a.c.num_ranks; ++s)
    if (s != a.c.rank) send_to(a, ch, s, epoch);
}

// Warp-wide: token t's sum. Lane d < R first waits until rank d's row for t has arrived.
PORTEP_DEVICE bool reduce_token(const HTCombineArgs& a, int ch, int t, uint64_t epoch) {
  const HTCommon& c = a.c;
  const int R = c.num_ranks, C = c.num_channels, me = c.rank, lane = lane_id();
  const int bytes = contribution_bytes(a);
  const int32_t* head = a.send_head + int64_t(t) * R;
  const bool in = lane < R && a.is_token_in_rank[int64_t(t) * R + lane];
  bool ok = true;
  if (in && lane != me) {
    const int in_channel = head[lane] - (ch > 0 ? a.channel_prefix[lane * C + ch - 1] : 0);
    ok = await_tail(c, tail_word(c, c.local, true, lane, ch), epoch, uint32_t(in_channel + 1), lane, ch);
  }
  const uint32_t mask = __ballot_sync(0xffffffffu, in);
  if (!warp_all(ok)) return false;
  const uint8_t* rows[kHTMaxRanks];
  const float* weights[kHTMaxRanks];
  int n = 0;
  for (int d = 0; d < R; ++d) {
    if (!(mask >> d & 1)) continue;
    if (d == me) {
      const int64_t row = rows_before(a.rank_prefix, R, me, me) + head[me];
      rows[n] = reinterpret_cast<const uint8_t*>(a.x + row * a.hidden);
      weights[n] = a.topk_weights ? a.topk_weights + row * a.num_topk : nullptr;
    } else {
      rows[n] = c.local + c.data_off + uint64_t(contributions_begin(a, me, d) + head[d]) * bytes;
      weights[n] = reinterpret_cast<const float*>(rows[n] + 2 * a.hidden);
    }
    ++n;
  }
  const int64_t base = int64_t(t) * a.hidden;
  for (int j = lane; j < a.hidden / 8; j += kWarpSize) {
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      acc[i] = a.bias0 ? bf16_to_f32(a.bias0[base + j * 8 + i]) : 0.0f;
      if (a.bias1) acc[i] = acc[i] + bf16_to_f32(a.bias1[base + j * 8 + i]);
    }
    for (int q = 0; q < n; ++q) {
      const uint4 v = reinterpret_cast<const uint4*>(rows[q])[j];
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        acc[2 * i] += bf16_to_f32(uint16_t(w[i] & 0xFFFFu));
        acc[2 * i + 1] += bf16_to_f32(uint16_t(w[i] >> 16));
      }
    }
    uint4 o;
    o.x = uint32_t(f32_to_bf16(acc[0])) | uint32_t(f32_to_bf16(acc[1])) << 16;
    o.y = uint32_t(f32_to_bf16(acc[2])) | uint32_t(f32_to_bf16(acc[3])) << 16;
    o.z = uint32_t(f32_to_bf16(acc[4])) | uint32_t(f32_to_bf16(acc[5])) << 16;
    o.w = uint32_t(f32_to_bf16(acc[6])) | uint32_t(f32_to_bf16(acc[7])) << 16;
    reinterpret_cast<uint4*>(a.out + base)[j] = o;
  }
  if (a.out_weights) {
    for (int k = lane; k < a.num_topk; k += kWarpSize) {
      float acc = 0.0f;
      for (int q = 0; q < n; ++q) acc += weights[q] ? weights[q][k] : 0.0f;
      a.out_weights[int64_t(t) * a.num_topk + k] = acc;
    }
  }
  return true;
}

PORTEP_DEVICE void reduce_channel(const HTCombineArgs& a, int ch) {
  const uint64_t epoch = *a.c.epoch;
  const int t0 = channel_begin(a.num_tokens, a.c.num_channels, ch);
  const int t1 = channel_begin(a.num_tokens, a.c.num_channels, ch + 1);
  for (int t = t0 + int(threadIdx.x) / kWarpSize; t < t1; t += kHTWarps)
    if (!reduce_token(a, ch, t, epoch)) return;
}

__global__ void __launch_bounds__(kHTThreads, 1) ht_combine_kernel(HTCombineArgs a) {
  if (blockIdx.x % 2 == 0)
    send_channel(a, blockIdx.x / 2);
  else
    reduce_channel(a, blockIdx.x / 2);
}

}  // namespace

int ht_combine(const HTCombineArgs& a) {
  ht_combine_kernel<<<2 * a.c.num_channels, kHTThreads, 0, static_cast<cudaStream_t>(a.c.stream)>>>(a);
  return int(cudaGetLastError());
}

}  // namespace portep::cuda
