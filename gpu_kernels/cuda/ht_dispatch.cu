// The HT dispatch data kernel (ht_api.h): per channel one sending and one receiving block.
#include <cuda_runtime.h>

#include "ht_common.cuh"

namespace portep::cuda {
namespace {

struct Record {  // byte offsets inside one record (layout in ht_api.h)
  int scales, topk, weights, bytes;
  PORTEP_DEVICE explicit Record(const HTDispatchArgs& a) {
    scales = 16 + a.row_bytes;
    topk = scales + 4 * a.num_scales;
    weights = topk + 8 * a.num_topk;
    bytes = (weights + 4 * a.num_topk + 15) / 16 * 16;
  }
};

// Warp-wide: one token's row, scales, top-k (as this rank's local ids) and source index into output row `row`.
// src_* point at the token's parts (the input itself, or a record in the data area).
PORTEP_DEVICE void write_output_row(const HTDispatchArgs& a, int64_t row, int src_token, const uint8_t* src_x,
                                    const float* src_scales, const int64_t* src_idx, const float* src_w) {
  if (row >= a.max_recv) return;  // num_worst_tokens too small: the notify kernel reported it
  warp_copy16(reinterpret_cast<uint4*>(a.recv_x + row * a.row_bytes), reinterpret_cast<const uint4*>(src_x),
              a.row_bytes / 16);
  const int lane = lane_id();
  for (int j = lane; j < a.num_scales; j += kWarpSize) a.recv_scales[row * a.num_scales + j] = src_scales[j];
  if (a.recv_topk_idx) {
    const int64_t first = int64_t(a.c.rank) * a.num_local_experts;
    for (int k = lane; k < a.num_topk; k += kWarpSize) {
      const int64_t e = src_idx[k];
      const bool mine = e >= first && e < first + a.num_local_experts;
      a.recv_topk_idx[row * a.num_topk + k] = mine ? e - first : -1;
      a.recv_topk_weights[row * a.num_topk + k] = mine ? src_w[k] : 0.0f;
    }
  }
  if (a.recv_src_idx && lane == 0) a.recv_src_idx[row] = src_token;
}

// Warp-wide: token t's record at `dst` (a peer's data area).
PORTEP_DEVICE void write_record(const HTDispatchArgs& a, const Record& rec, uint8_t* dst, int t) {
  const int lane = lane_id();
  if (lane < 4) reinterpret_cast<int32_t*>(dst)[lane] = lane == 0 ? t : 0;
  warp_copy16(reinterpret_cast<uint4*>(dst + 16), reinterpret_cast<const uint4*>(a.x + int64_t(t) * a.row_bytes),
              a.row_bytes / 16);
  float* scales = reinterpret_cast<float*>(dst + rec.scales);
  for (int j = lane; j < a.num_scales; j += kWarpSize) scales[j] = a.scales[int64_t(t) * a.num_scales + j];
  if (a.topk_idx) {
    int64_t* idx = reinterpret_cast<int64_t*>(dst + rec.topk);
    float* w = reinterpret_cast<float*>(dst + rec.weights);
    for (int k = lane; k < a.num_topk; k += kWarpSize) {
      idx[k] = a.topk_idx[int64_t(t) * a.num_topk + k];
      w[k] = a.topk_weights[int64_t(t) * a.num_topk + k];
    }
  }
}

struct SendState {
  uint32_t masks[kHTWarps];        // batch: each warp's token's destination ranks
  uint32_t sent[kHTMaxRanks];      // rows of this channel stored per destination so far
  int64_t first_row[kHTMaxRanks];  // destination's row of this channel's first token to it (its whole block)
  bool fits[kHTMaxRanks];
  uint64_t epoch;
};

PORTEP_DEVICE void send_token(const HTDispatchArgs& a, const Record& rec, SendState& st, int t, int warp) {
  const HTCommon& c = a.c;
  const int R = c.num_ranks, lane = lane_id();
  const uint32_t mask = st.masks[warp];
  if (a.send_head && lane < R) {
    int pos = -1;
    if (mask >> lane & 1) {
      pos = int(st.sent[lane]);
      for (int j = 0; j < warp; ++j) pos += int(st.masks[j] >> lane & 1);
      pos += int(st.first_row[lane] - rows_before(a.rank_prefix, R, c.rank, lane));
    }
    a.send_head[int64_t(t) * R + lane] = pos;
  }
  for (int d = 0; d < R; ++d) {
    if (!(mask >> d & 1)) continue;
    int64_t row = st.first_row[d] + st.sent[d];
    for (int j = 0; j < warp; ++j) row += st.masks[j] >> d & 1;
    if (d == c.rank) {
      const int64_t* idx = a.topk_idx ? a.topk_idx + int64_t(t) * a.num_topk : nullptr;
      const float* w = a.topk_weights ? a.topk_weights + int64_t(t) * a.num_topk : nullptr;
      write_output_row(a, row, t, a.x + int64_t(t) * a.row_bytes, a.scales + int64_t(t) * a.num_scales, idx, w);
    } else if (st.fits[d]) {
      write_record(a, rec, c.peers[d] + c.data_off + uint64_t(row) * rec.bytes, t);
    }
  }
}

PORTEP_DEVICE void send_channel(const HTDispatchArgs& a, int ch) {
  __shared__ SendState st;
  const HTCommon& c = a.c;
  const int R = c.num_ranks, C = c.num_channels, warp = threadIdx.x / kWarpSize, lane = lane_id();
  const Record rec(a);
  if (int(threadIdx.x) < R) {
    const int d = threadIdx.x;
    st.sent[d] = 0;
    st.first_row[d] = rows_before(a.rank_prefix, R, c.rank, d) + (ch > 0 ? a.channel_prefix[d * C + ch - 1] : 0);
    st.fits[d] = uint64_t(a.rank_prefix[(R - 1) * R + d]) * rec.bytes <= c.data_bytes;
    if (!st.fits[d] && d != c.rank) report_error(c.error, kErrBufferTooSmall, uint32_t(c.rank), uint32_t(d), 0);
    if (d == 0) st.epoch = *c.epoch;
  }
  const int t0 = channel_begin(a.num_tokens, C, ch), t1 = channel_begin(a.num_tokens, C, ch + 1);
  for (int b = t0; b < t1; b += kHTWarps) {
    const int t = b + warp;
    const bool in = lane < R && t < t1 && a.is_token_in_rank[int64_t(t) * R + lane];
    const uint32_t mask = __ballot_sync(0xffffffffu, in);
    __syncthreads();  // the previous batch's bookkeeping is done
    if (lane == 0) st.masks[warp] = mask;
    __syncthreads();
    if (t < t1) send_token(a, rec, st, t, warp);
    __syncthreads();
    if (int(threadIdx.x) < R) {
      const int d = threadIdx.x;
      uint32_t n = 0;
      for (int j = 0; j < kHTWarps; ++j) n += st.masks[j] >> d & 1;
      st.sent[d] += n;
      if (n && d != c.rank && st.fits[d])
        publish_tail(tail_word(c, c.peers[d], false, c.rank, ch), st.epoch, st.sent[d]);
    }
  }
}

// Rows from source s in channel ch: copy them out of the data area as their tail announces them.
PORTEP_DEVICE bool receive_from(const HTDispatchArgs& a, const Record& rec, int ch, int s, uint64_t epoch,
                                uint32_t* avail) {
  const HTCommon& c = a.c;
  const int R = c.num_ranks, C = c.num_channels, me = c.rank, warp = threadIdx.x / kWarpSize;
  const int from_s = rows_from(a.rank_prefix, R, s, me);
  const int begin = a.recv_channel_prefix[s * C + ch];
  const int end = ch + 1 < C ? a.recv_channel_prefix[s * C + ch + 1] : from_s;
  const int64_t first = rows_before(a.rank_prefix, R, s, me) + begin;
  if (uint64_t(a.rank_prefix[(R - 1) * R + me]) * rec.bytes > c.data_bytes) {  // senders stored nothing
    if (threadIdx.x == 0) report_error(c.error, kErrBufferTooSmall, uint32_t(me), uint32_t(me), 0);
    return false;
  }
  const uint64_t* word = tail_word(c, c.local, false, s, ch);
  for (uint32_t done = 0; done < uint32_t(end - begin);) {
    if (threadIdx.x == 0) {
      uint64_t v = 0, waited = 0;
      const uint64_t want = tail_value(epoch, done + 1);
      *avail = wait_until([&] { return ld_acquire_sys_u64(word); }, [&](uint64_t x) { return x >= want; },
                          c.timeout_ns, &v, &waited)
                   ? min(uint32_t(v), uint32_t(end - begin))
                   : 0;
      if (!*avail) report_error(c.error, kErrWaitTimeout, uint32_t(me), uint32_t(s), uint32_t(ch));
    }
    __syncthreads();
    const uint32_t n = *avail;
    if (!n) return false;
    for (uint32_t r = done + warp; r < n; r += kHTWarps) {
      const uint8_t* src = c.local + c.data_off + uint64_t(first + r) * rec.bytes;
      write_output_row(a, first + r, *reinterpret_cast<const int32_t*>(src), src + 16,
                       reinterpret_cast<const float*>(src + rec.scales),
                       reinterpret_cast<const int64_t*>(src + rec.topk),
                       reinterpret_cast<const float*>(src + rec.weights));
    }
    done = n;
    __syncthreads();
  }
  return true;
}

PORTEP_DEVICE void receive_channel(const HTDispatchArgs& a, int ch) {
  __shared__ uint32_t avail;
  const Record rec(a);
  const uint64_t epoch = *a.c.epoch;
  for (int s = 0; s < a.c.num_ranks; ++s)
    if (s != a.c.rank && !receive_from(a, rec, ch, s, epoch, &avail)) return;
}

__global__ void __launch_bounds__(kHTThreads, 1) ht_dispatch_kernel(HTDispatchArgs a) {
  if (blockIdx.x % 2 == 0)
    send_channel(a, blockIdx.x / 2);
  else
    receive_channel(a, blockIdx.x / 2);
}

}  // namespace

int ht_dispatch(const HTDispatchArgs& a) {
  ht_dispatch_kernel<<<2 * a.c.num_channels, kHTThreads, 0, static_cast<cudaStream_t>(a.c.stream)>>>(a);
  return int(cudaGetLastError());
}

}  // namespace portep::cuda
