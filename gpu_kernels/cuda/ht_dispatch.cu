// The HT dispatch data kernel (ht_api.h): per channel one sending and one receiving block.
#include <cuda_runtime.h>

#include "ht_common.cuh"

namespace portep::cuda {
namespace {

struct Record {  // byte offsets inside one record (layout in ht_api.h)
  int scales, topk, weights, bytes;
  PORTEP_DEVICE explicit Record(const HTDispatchArgs& a) {
    scales = 16 + a.row_bytes;
    topk = (scales + 4 * a.num_scales + 7) / 8 * 8;  // int64 ids: 8-byte aligned whatever the scale count
    weights = topk + 8 * a.num_topk;
    bytes = (weights + 4 * a.num_topk + 15) / 16 * 16;
  }
};

// Warp-wide: one token's row, scales, top-k (as this rank's local ids) and source index into output row `row`.
// src_* point at the token's parts (the input itself, or a record in the receive area).
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

// Warp-wide: token t's record at `dst` (a direct peer's receive area or this rank's staging area).
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
  uint32_t masks[kHTWarps];         // batch: each warp's token's destination ranks
  uint32_t sent[kHTMaxRanks];       // rows of this channel stored per destination so far
  uint32_t flushed[kHTMaxRanks];    // proxy destinations: rows of this channel handed to WRITEs
  uint32_t chan_start[kHTMaxRanks];  // position of this channel's first row in this rank's block at d
  uint64_t remote_row0[kHTMaxRanks];  // its row in d's receive area
  uint64_t stage_row0[kHTMaxRanks];   // its row in this rank's staging area (proxy destinations)
  bool fits[kHTMaxRanks];
  uint64_t epoch;
};

PORTEP_DEVICE void init_send_state(const HTDispatchArgs& a, const Record& rec, SendState& st, int ch) {
  const HTCommon& c = a.c;
  const int R = c.num_ranks, C = c.num_channels, d = threadIdx.x;
  if (d >= R) return;
  st.sent[d] = st.flushed[d] = 0;
  st.chan_start[d] = uint32_t(sent_before_channel(a.channel_prefix, C, d, ch));
  st.remote_row0[d] = uint64_t(c.dest_first[d]) + st.chan_start[d];
  st.stage_row0[d] = uint64_t(sent_to_ranks_before(a.channel_prefix, C, d)) + st.chan_start[d];
  const bool recv_fits = uint64_t(c.dest_rows[d]) * rec.bytes <= c.recv_bytes;
  const uint64_t staged = uint64_t(sent_to_ranks_before(a.channel_prefix, C, R)) * rec.bytes;
  const bool stage_fits = c.peers[d] || staged <= c.stage_bytes;
  st.fits[d] = d == c.rank || (recv_fits && stage_fits);
  if (!st.fits[d]) report_error(c.error, kErrBufferTooSmall, uint32_t(c.rank), uint32_t(d), 0);
  if (d == 0) st.epoch = *c.epoch;
}

PORTEP_DEVICE void send_token(const HTDispatchArgs& a, const Record& rec, SendState& st, int t, int warp) {
  const HTCommon& c = a.c;
  const int R = c.num_ranks, lane = lane_id();
  const uint32_t mask = st.masks[warp];
  if (a.send_head && lane < R) {
    int pos = -1;
    if (mask >> lane & 1) {
      pos = int(st.chan_start[lane] + st.sent[lane]);
      for (int j = 0; j < warp; ++j) pos += int(st.masks[j] >> lane & 1);
    }
    a.send_head[int64_t(t) * R + lane] = pos;
  }
  for (int d = 0; d < R; ++d) {
    if (!(mask >> d & 1) || !st.fits[d]) continue;
    uint64_t i = st.sent[d];  // the row's index among this channel's rows to d
    for (int j = 0; j < warp; ++j) i += st.masks[j] >> d & 1;
    if (d == c.rank) {
      const int64_t* idx = a.topk_idx ? a.topk_idx + int64_t(t) * a.num_topk : nullptr;
      const float* w = a.topk_weights ? a.topk_weights + int64_t(t) * a.num_topk : nullptr;
      write_output_row(a, int64_t(st.remote_row0[d] + i), t, a.x + int64_t(t) * a.row_bytes,
                       a.scales + int64_t(t) * a.num_scales, idx, w);
    } else if (c.peers[d]) {
      write_record(a, rec, c.peers[d] + c.recv_off + (st.remote_row0[d] + i) * rec.bytes, t);
    } else {
      write_record(a, rec, c.local + c.stage_off + (st.stage_row0[d] + i) * rec.bytes, t);
    }
  }
}

// Thread d < R, after a batch: announce destination d's rows of this channel so far (last: the channel is done).
PORTEP_DEVICE void announce(const HTDispatchArgs& a, const Record& rec, SendState& st, int ch, uint32_t added,
                            bool last) {
  const HTCommon& c = a.c;
  const int d = threadIdx.x;
  if (d >= c.num_ranks || d == c.rank || !st.fits[d]) return;
  if (c.peers[d]) {
    if (added) publish_tail(tail_word(c, c.peers[d], false, c.rank, ch), st.epoch, st.sent[d]);
    return;
  }
  if (added) fence_sys();  // the staged rows before the WRITEs that copy them
  flush_rows(c, d, data_stream(c, false, ch), st.stage_row0[d], st.remote_row0[d], uint32_t(rec.bytes),
             &st.flushed[d], st.sent[d], last);
}

PORTEP_DEVICE void send_channel(const HTDispatchArgs& a, int ch) {
  __shared__ SendState st;
  const HTCommon& c = a.c;
  const int R = c.num_ranks, C = c.num_channels, warp = threadIdx.x / kWarpSize, lane = lane_id();
  const Record rec(a);
  init_send_state(a, rec, st, ch);
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
      uint32_t n = 0;
      for (int j = 0; j < kHTWarps; ++j) n += st.masks[j] >> threadIdx.x & 1;
      st.sent[threadIdx.x] += n;
      announce(a, rec, st, ch, n, b + kHTWarps >= t1);
    }
  }
}

// Rows from source s in channel ch: copy them out of the receive area as they are announced.
PORTEP_DEVICE bool receive_from(const HTDispatchArgs& a, const Record& rec, int ch, int s, uint64_t epoch,
                                uint32_t* avail) {
  const HTCommon& c = a.c;
  const int R = c.num_ranks, C = c.num_channels, warp = threadIdx.x / kWarpSize, stride = a.recv_prefix_stride;
  const int64_t from_s = rows_from(a.recv_prefix, stride, s);
  const int64_t begin = a.recv_channel_prefix[s * C + ch];
  const uint32_t n = uint32_t((ch + 1 < C ? a.recv_channel_prefix[s * C + ch + 1] : from_s) - begin);
  const int64_t first = rows_before(a.recv_prefix, stride, s) + begin;
  if (uint64_t(a.recv_prefix[(R - 1) * stride]) * rec.bytes > c.recv_bytes) {  // senders stored nothing
    if (threadIdx.x == 0) report_error(c.error, kErrBufferTooSmall, uint32_t(c.rank), uint32_t(c.rank), 0);
    return false;
  }
  const uint32_t stream = data_stream(c, false, ch);
  for (uint32_t done = 0; done < n;) {
    if (threadIdx.x == 0) {
      if (c.peers[s]) {
        const uint64_t* word = tail_word(c, c.local, false, s, ch);
        *avail = await_tail(c, word, epoch, done + 1, s, ch) ? min(uint32_t(ld_acquire_sys_u64(word)), n) : 0;
      } else {
        const int64_t units = await_units(c, s, stream, done / kHTChunkRows + 1);
        *avail = units < 0 ? 0 : uint32_t(min(int64_t(n), units * kHTChunkRows));
      }
    }
    __syncthreads();
    const uint32_t ready = *avail;
    if (!ready) return false;
    for (uint32_t r = done + warp; r < ready; r += kHTWarps) {
      const uint8_t* src = c.local + c.recv_off + uint64_t(first + r) * rec.bytes;
      write_output_row(a, first + r, *reinterpret_cast<const int32_t*>(src), src + 16,
                       reinterpret_cast<const float*>(src + rec.scales),
                       reinterpret_cast<const int64_t*>(src + rec.topk),
                       reinterpret_cast<const float*>(src + rec.weights));
    }
    done = ready;
    __syncthreads();
  }
  if (threadIdx.x == 0 && !c.peers[s]) consume_units(c, s, stream, chunks(n));
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
  if (failed_before(a.c)) return;
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
