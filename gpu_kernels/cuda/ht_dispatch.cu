// The HT dispatch data kernel (ht_api.h): per channel one sending and one receiving block.
#include "gpu_runtime.h"

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
  uint32_t masks[kHTWarps];          // batch: each warp's token's destination ranks
  uint32_t batch[kHTMaxRanks];       // batch: rows per destination
  uint32_t sent[kHTMaxRanks];        // rows of this channel stored per destination so far
  uint32_t flushed[kHTMaxRanks];     // proxy destinations: rows of this channel handed to WRITEs
  uint32_t chan_start[kHTMaxRanks];  // position of this channel's first row in this rank's block at d
  uint64_t remote_ring[kHTMaxRanks];  // this rank's ring at d (receive area offset)
  uint64_t stage_ring[kHTMaxRanks];   // its staging ring for d (proxy destinations)
  int64_t self_row0;                 // output row of this channel's first row to this rank
  uint64_t epoch;
  int failed;
};

PORTEP_DEVICE void init_send_state(const HTDispatchArgs& a, const Record& rec, SendState& st, int ch) {
  const HTCommon& c = a.c;
  const int R = c.num_ranks, C = c.num_channels, d = threadIdx.x;
  if (d >= R) return;
  st.sent[d] = st.flushed[d] = 0;
  st.chan_start[d] = uint32_t(sent_before_channel(a.channel_prefix, C, d, ch));
  st.remote_ring[d] = ring_offset(c, d, c.rank, ch, a.ring_rows, rec.bytes);
  st.stage_ring[d] = ring_offset(c, c.rank, d, ch, a.ring_rows, rec.bytes);
  if (d == 0) {  // (not st.chan_start[rank]: thread rank writes it, and no barrier lies between)
    st.self_row0 = rows_before(a.recv_prefix, a.recv_prefix_stride, c.rank) +
                   sent_before_channel(a.channel_prefix, C, c.rank, ch);
    st.epoch = *c.epoch;
    st.failed = 0;
  }
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
    if (!(mask >> d & 1)) continue;
    uint32_t i = st.sent[d];  // the row's index among this channel's rows to d
    for (int j = 0; j < warp; ++j) i += st.masks[j] >> d & 1;
    const uint64_t slot = ring_slot(i, a.ring_rows, rec.bytes);
    if (d == c.rank) {
      const int64_t* idx = a.topk_idx ? a.topk_idx + int64_t(t) * a.num_topk : nullptr;
      const float* w = a.topk_weights ? a.topk_weights + int64_t(t) * a.num_topk : nullptr;
      write_output_row(a, st.self_row0 + i, t, a.x + int64_t(t) * a.row_bytes, a.scales + int64_t(t) * a.num_scales,
                       idx, w);
    } else if (c.peers[d]) {
      write_record(a, rec, c.peers[d] + c.recv_off + st.remote_ring[d] + slot, t);
    } else {
      write_record(a, rec, c.local + c.stage_off + st.stage_ring[d] + slot, t);
    }
  }
}

// Thread d < R, after a batch: announce destination d's rows of this channel so far (last: the channel is done).
PORTEP_DEVICE void announce(const HTDispatchArgs& a, const Record& rec, SendState& st, int ch, uint32_t added,
                            bool last) {
  const HTCommon& c = a.c;
  const int d = threadIdx.x;
  if (d >= c.num_ranks || d == c.rank) return;
  if (c.peers[d]) {
    if (added) publish_tail(tail_word(c, c.peers[d], false, c.rank, ch), st.epoch, st.sent[d]);
    return;
  }
  if (added) fence_sys();  // the staged rows before the WRITEs that copy them
  flush_rows(c, d, data_stream(c, false, ch), st.stage_ring[d], st.remote_ring[d], uint32_t(rec.bytes), a.ring_rows,
             &st.flushed[d], st.sent[d], last);
}

PORTEP_DEVICE void send_channel(const HTDispatchArgs& a, int ch) {
  __shared__ SendState st;
  const HTCommon& c = a.c;
  const int R = c.num_ranks, C = c.num_channels, warp = threadIdx.x / kWarpSize, lane = lane_id();
  const int d = threadIdx.x;  // the destination threads d < R keep
  const Record rec(a);
  init_send_state(a, rec, st, ch);
  const int t0 = channel_begin(a.num_tokens, C, ch), t1 = channel_begin(a.num_tokens, C, ch + 1);
  for (int b = t0; b < t1; b += kHTWarps) {
    const int t = b + warp;
    const bool in = lane < R && t < t1 && a.is_token_in_rank[int64_t(t) * R + lane];
    const uint32_t mask = uint32_t(warp_ballot(in));  // lanes < R <= kHTMaxRanks
    __syncthreads();  // the previous batch's bookkeeping is done
    if (lane == 0) st.masks[warp] = mask;
    __syncthreads();
    if (d < R) {  // room in d's ring for this batch
      uint32_t n = 0;
      for (int j = 0; j < kHTWarps; ++j) n += st.masks[j] >> d & 1;
      st.batch[d] = n;
      if (n && d != c.rank && !await_room(c, false, d, ch, st.epoch, st.sent[d] + n, a.ring_rows)) st.failed = 1;
    }
    __syncthreads();
    if (st.failed) return;
    if (t < t1) send_token(a, rec, st, t, warp);
    __syncthreads();
    if (d < R) {
      st.sent[d] += st.batch[d];
      announce(a, rec, st, ch, st.batch[d], b + kHTWarps >= t1);
    }
  }
  if (d < R) collect_credits(c, false, d, ch, st.sent[d]);
}

struct RecvState {
  uint32_t rows[kHTMaxRanks];      // rows of this channel from each source
  uint32_t done[kHTMaxRanks];      // copied out so far
  uint32_t avail[kHTMaxRanks];     // known to be in the ring
  uint32_t credited[kHTMaxRanks];  // proxy sources: chunks credited back
  int64_t first[kHTMaxRanks];      // output row of the channel's first row from each source
  int all_done, failed;
};

// Thread s: rows from source s in this channel known to be in place (non-blocking).
PORTEP_DEVICE uint32_t rows_arrived(const HTDispatchArgs& a, const RecvState& st, int ch, int s, uint64_t epoch) {
  const HTCommon& c = a.c;
  if (c.peers[s]) return min(st.rows[s], rows_of(ld_acquire_sys_u64(tail_word(c, c.local, false, s, ch)), epoch));
  const uint64_t i = uint64_t(s) * c.num_streams + data_stream(c, false, ch);
  const uint32_t units = uint32_t(ld_acquire_sys_u64(c.host_signals + i)) - uint32_t(c.signal_seen[i]);
  return uint32_t(min(uint64_t(st.rows[s]), uint64_t(units) * kHTChunkRows));
}

PORTEP_DEVICE void init_recv_state(const HTDispatchArgs& a, RecvState& st, int ch) {
  const HTCommon& c = a.c;
  const int C = c.num_channels, s = threadIdx.x, stride = a.recv_prefix_stride;
  if (s < c.num_ranks) {
    const int64_t begin = a.recv_channel_prefix[s * C + ch];
    const int64_t end = received_end(a.recv_channel_prefix, a.recv_prefix, stride, C, s, ch);
    st.rows[s] = s == c.rank ? 0 : uint32_t(end - begin);
    st.done[s] = st.avail[s] = st.credited[s] = 0;
    st.first[s] = rows_before(a.recv_prefix, stride, s) + begin;
  }
  if (s == 0) st.failed = 0;
}

// Serves every source at once (a sender blocked on a full ring to one rank must not stall the others): each
// round copies whatever arrived, then hands the ring slots back.
PORTEP_DEVICE void receive_channel(const HTDispatchArgs& a, int ch) {
  __shared__ RecvState st;
  const HTCommon& c = a.c;
  const int R = c.num_ranks, warp = threadIdx.x / kWarpSize, s = threadIdx.x;
  const Record rec(a);
  const uint64_t epoch = *c.epoch;
  init_recv_state(a, st, ch);
  uint64_t idle_since = globaltimer_ns();  // thread 0's
  for (;;) {
    __syncthreads();  // the previous round's copies and bookkeeping are done
    if (s < R && st.done[s] < st.rows[s]) st.avail[s] = rows_arrived(a, st, ch, s, epoch);
    __syncthreads();
    if (threadIdx.x == 0) {
      bool progress = false, all = true;
      int waiting = -1;
      for (int j = 0; j < R; ++j) {
        progress |= st.avail[j] > st.done[j];
        all &= st.done[j] == st.rows[j];
        if (st.done[j] < st.rows[j] && waiting < 0) waiting = j;
      }
      st.all_done = all;
      const uint64_t now = globaltimer_ns();
      if (progress || all) {
        idle_since = now;
      } else if (now - idle_since > c.timeout_ns) {
        report_error(c, kErrWaitTimeout, uint32_t(c.rank), uint32_t(waiting), uint32_t(ch));
        st.failed = 1;
      } else if (!c.peers[waiting]) {
        sleep_ns(kProxyPollNs);  // host-memory polls cross PCIe
      }
    }
    __syncthreads();
    if (st.all_done || st.failed) break;
    for (int j = 0; j < R; ++j) {
      const uint8_t* ring = c.local + c.recv_off + ring_offset(c, c.rank, j, ch, a.ring_rows, rec.bytes);
      for (uint32_t r = st.done[j] + warp; r < st.avail[j]; r += kHTWarps) {
        const uint8_t* src = ring + ring_slot(r, a.ring_rows, rec.bytes);
        write_output_row(a, st.first[j] + r, *reinterpret_cast<const int32_t*>(src), src + 16,
                         reinterpret_cast<const float*>(src + rec.scales),
                         reinterpret_cast<const int64_t*>(src + rec.topk),
                         reinterpret_cast<const float*>(src + rec.weights));
      }
    }
    __syncthreads();  // every copy's loads returned before the slots go back
    if (s < R && st.avail[s] > st.done[s]) {
      st.done[s] = st.avail[s];
      return_rows(c, false, s, ch, epoch, st.done[s], &st.credited[s]);
    }
  }
  if (s < R && s != c.rank && !c.peers[s]) consume_units(c, s, data_stream(c, false, ch), chunks(st.rows[s]));
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

int load_ht_dispatch_kernels() {
  return int(load_kernel(ht_dispatch_kernel));
}

}  // namespace portep::cuda
