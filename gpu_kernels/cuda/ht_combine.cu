// The HT combine data kernel (ht_api.h): per channel one block sends this rank's rows back to their sources and
// one block reduces this rank's own tokens (bias, then every rank's row in rank order, FP32, as the host backend).
#include "gpu_runtime.h"

#include "ht_common.cuh"

namespace portep::cuda {
namespace {

constexpr int kReduceUnroll = 2;  // 16-byte words per lane a reducing warp loads at once from each row

PORTEP_DEVICE int contribution_bytes(const HTCombineArgs& a) { return (2 * a.hidden + 4 * a.num_topk + 15) / 16 * 16; }

// Warp-wide: x's row `row` (and its weights) as one contribution at dst.
PORTEP_DEVICE void write_contribution(const HTCombineArgs& a, uint8_t* dst, int64_t row) {
  warp_copy16(reinterpret_cast<uint4*>(dst), reinterpret_cast<const uint4*>(a.x + row * a.hidden), a.hidden * 2 / 16);
  if (a.topk_weights) {
    float* w = reinterpret_cast<float*>(dst + 2 * a.hidden);
    for (int k = lane_id(); k < a.num_topk; k += kWarpSize) w[k] = a.topk_weights[row * a.num_topk + k];
  }
}

// The rows of source s's tokens in channel ch back to s through ring (s, ch), batch by batch, each batch
// announced; false after a timeout (reported).
PORTEP_DEVICE bool send_to(const HTCombineArgs& a, int ch, int s, uint64_t epoch, int* failed) {
  const HTCommon& c = a.c;
  const int C = c.num_channels, warp = threadIdx.x / kWarpSize, stride = a.recv_prefix_stride;
  const uint32_t bytes = contribution_bytes(a), Q = a.ring_rows;
  const int64_t begin = a.recv_channel_prefix[s * C + ch];
  const uint32_t n = uint32_t(received_end(a.recv_channel_prefix, a.recv_prefix, stride, C, s, ch) - begin);
  const int64_t local_row0 = rows_before(a.recv_prefix, stride, s) + begin;  // in x
  const uint64_t remote_ring = ring_offset(c, s, c.rank, ch, Q, bytes);
  const uint64_t stage_ring = ring_offset(c, c.rank, s, ch, Q, bytes);
  uint32_t flushed = 0;  // thread 0's
  for (uint32_t b = 0; b < n; b += kHTWarps) {
    const uint32_t r = b + warp, done = min(b + kHTWarps, n);
    if (threadIdx.x == 0 && !await_room(c, true, s, ch, epoch, done, Q)) *failed = 1;
    __syncthreads();
    if (*failed) return false;
    if (r < n) {
      const uint64_t slot = ring_slot(r, Q, bytes);
      uint8_t* dst = c.peers[s] ? c.peers[s] + c.recv_off + remote_ring + slot
                                : c.local + c.stage_off + stage_ring + slot;
      write_contribution(a, dst, local_row0 + r);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      if (c.peers[s]) {
        publish_tail(tail_word(c, c.peers[s], true, c.rank, ch), epoch, done);
      } else {
        fence_sys();  // the staged rows before the WRITEs that copy them
        flush_rows(c, s, data_stream(c, true, ch), stage_ring, remote_ring, bytes, Q, &flushed, done, done == n);
      }
    }
  }
  return true;
}

PORTEP_DEVICE void send_channel(const HTCombineArgs& a, int ch) {
  __shared__ int failed;
  const HTCommon& c = a.c;
  const uint64_t epoch = *c.epoch;
  if (threadIdx.x == 0) failed = 0;
  for (int s = 0; s < c.num_ranks; ++s)
    if (s != c.rank && !send_to(a, ch, s, epoch, &failed)) return;
  const int d = threadIdx.x, C = c.num_channels;
  if (d < c.num_ranks) {
    const int64_t end = received_end(a.recv_channel_prefix, a.recv_prefix, a.recv_prefix_stride, C, d, ch);
    collect_credits(c, true, d, ch, uint32_t(end - a.recv_channel_prefix[d * C + ch]));
  }
}

struct ReduceState {
  uint32_t need[kHTMaxRanks];      // rows of this channel from each rank the batch needs in place
  uint32_t have[kHTMaxRanks];      // rows known to be in place
  uint32_t consumed[kHTMaxRanks];  // rows reduced (their ring slots handed back)
  uint32_t credited[kHTMaxRanks];  // proxy ranks: chunks credited back
  int failed;
};

// Lane d of warp 0 waits until rank d's rows the batch needs are in place; false (block-wide) after a timeout.
PORTEP_DEVICE bool await_batch(const HTCombineArgs& a, ReduceState& st, int ch, uint64_t epoch) {
  const HTCommon& c = a.c;
  const int d = threadIdx.x;
  if (d < c.num_ranks && d != c.rank && st.need[d] > st.have[d]) {
    if (c.peers[d]) {
      const uint64_t* word = tail_word(c, c.local, true, d, ch);
      if (await_tail(c, word, epoch, st.need[d], d, ch))
        st.have[d] = uint32_t(ld_acquire_sys_u64(word));
      else
        st.failed = 1;
    } else {
      const int64_t units = await_units(c, d, data_stream(c, true, ch), chunks(st.need[d]));
      if (units >= 0)
        st.have[d] = uint32_t(units * kHTChunkRows);
      else
        st.failed = 1;
    }
  }
  __syncthreads();
  return !st.failed;
}

// Warp-wide: token t's sum of bias and every rank's row, ranks ascending.
PORTEP_DEVICE void reduce_token(const HTCombineArgs& a, int t, int ch, uint32_t mask) {
  const HTCommon& c = a.c;
  const int R = c.num_ranks, C = c.num_channels, me = c.rank, lane = lane_id();
  const uint32_t bytes = contribution_bytes(a);
  const int32_t* head = a.send_head + int64_t(t) * R;
  const uint8_t* rows[kHTMaxRanks];
  const float* weights[kHTMaxRanks];
  int n = 0;
  for (int d = 0; d < R; ++d) {
    if (!(mask >> d & 1)) continue;
    if (d == me) {
      const int64_t row = rows_before(a.recv_prefix, a.recv_prefix_stride, me) + head[me];
      rows[n] = reinterpret_cast<const uint8_t*>(a.x + row * a.hidden);
      weights[n] = a.topk_weights ? a.topk_weights + row * a.num_topk : nullptr;
    } else {
      const uint32_t i = uint32_t(head[d] - sent_before_channel(a.channel_prefix, C, d, ch));
      rows[n] = c.local + c.recv_off + ring_offset(c, me, d, ch, a.ring_rows, bytes) + ring_slot(i, a.ring_rows, bytes);
      weights[n] = reinterpret_cast<const float*>(rows[n] + 2 * a.hidden);
    }
    ++n;
  }
  const int64_t base = int64_t(t) * a.hidden;
  const int words = a.hidden / 8;
  // kReduceUnroll words per lane of two rows at once: their loads are in flight together (one round trip per two
  // rows and round, not per row and word); the sums still run bias first, then the rows in rank order.
  for (int j0 = lane; j0 < words; j0 += kReduceUnroll * kWarpSize) {
    float acc[kReduceUnroll][8];
#pragma unroll
    for (int u = 0; u < kReduceUnroll; ++u) {
      const int j = j0 + u * kWarpSize;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        acc[u][i] = a.bias0 && j < words ? bf16_to_f32(a.bias0[base + j * 8 + i]) : 0.0f;
        if (a.bias1 && j < words) acc[u][i] = acc[u][i] + bf16_to_f32(a.bias1[base + j * 8 + i]);
      }
    }
    for (int q = 0; q < n; q += 2) {  // two rows' loads in flight together, added in rank order
      const bool two = q + 1 < n;
      uint4 v0[kReduceUnroll], v1[kReduceUnroll];
#pragma unroll
      for (int u = 0; u < kReduceUnroll; ++u) {
        const int j = j0 + u * kWarpSize;
        if (j < words) v0[u] = reinterpret_cast<const uint4*>(rows[q])[j];
        if (two && j < words) v1[u] = reinterpret_cast<const uint4*>(rows[q + 1])[j];
      }
#pragma unroll
      for (int u = 0; u < kReduceUnroll; ++u) {
        if (j0 + u * kWarpSize >= words) continue;
        accumulate_row(acc[u], v0[u], 1.0f);
        if (two) accumulate_row(acc[u], v1[u], 1.0f);
      }
    }
#pragma unroll
    for (int u = 0; u < kReduceUnroll; ++u)
      if (j0 + u * kWarpSize < words) reinterpret_cast<uint4*>(a.out + base)[j0 + u * kWarpSize] = pack_bf16x8(acc[u]);
  }
  if (a.out_weights) {
    for (int k = lane; k < a.num_topk; k += kWarpSize) {
      float acc = 0.0f;
      for (int q = 0; q < n; ++q) acc += weights[q] ? weights[q][k] : 0.0f;
      a.out_weights[int64_t(t) * a.num_topk + k] = acc;
    }
  }
}

PORTEP_DEVICE void reduce_channel(const HTCombineArgs& a, int ch) {
  __shared__ ReduceState st;
  const HTCommon& c = a.c;
  const int R = c.num_ranks, C = c.num_channels, warp = threadIdx.x / kWarpSize, lane = lane_id();
  const uint64_t epoch = *c.epoch;
  if (int(threadIdx.x) < R) st.have[threadIdx.x] = st.consumed[threadIdx.x] = st.credited[threadIdx.x] = 0;
  if (threadIdx.x == 0) st.failed = 0;
  const int t0 = channel_begin(a.num_tokens, C, ch), t1 = channel_begin(a.num_tokens, C, ch + 1);
  for (int b = t0; b < t1; b += kHTWarps) {
    const int t = b + warp;
    __syncthreads();  // the previous batch's waits are done
    if (int(threadIdx.x) < R) st.need[threadIdx.x] = 0;
    __syncthreads();
    const bool in = lane < R && t < t1 && a.is_token_in_rank[int64_t(t) * R + lane];
    if (in && lane != c.rank)
      atomicMax(&st.need[lane], uint32_t(a.send_head[int64_t(t) * R + lane] -
                                         sent_before_channel(a.channel_prefix, C, lane, ch) + 1));
    const uint32_t mask = uint32_t(warp_ballot(in));  // lanes < R <= kHTMaxRanks
    __syncthreads();
    if (!await_batch(a, st, ch, epoch)) return;
    if (t < t1) reduce_token(a, t, ch, mask);
    __syncthreads();  // every reduce's loads returned before the slots go back
    const int d = threadIdx.x;
    if (d < R && d != c.rank && st.need[d] > st.consumed[d]) {
      st.consumed[d] = st.need[d];
      return_rows(c, true, d, ch, epoch, st.consumed[d], &st.credited[d]);
    }
  }
  const int d = threadIdx.x;
  if (d < R && d != c.rank && !c.peers[d])
    consume_units(c, d, data_stream(c, true, ch),
                  chunks(a.channel_prefix[d * C + ch] - sent_before_channel(a.channel_prefix, C, d, ch)));
}

__global__ void __launch_bounds__(kHTThreads, 1) ht_combine_kernel(HTCombineArgs a) {
  if (failed_before(a.c)) return;
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

int load_ht_combine_kernels() {
  return int(load_kernel(ht_combine_kernel));
}

}  // namespace portep::cuda
