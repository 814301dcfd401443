// The HT dispatch data kernel (ht_api.h): per channel one sending and one receiving block, and with forwarding
// a forwarding block.
#include "gpu_kernels/cuda/gpu_runtime.h"

#include "gpu_kernels/cuda/ht_common.cuh"

namespace portep::cuda {
namespace {

using Record = HTDispatchRow;  // one ring row (a record) of the op (ht_layout.h)

// A token's scales and top-k as a warp's lanes hold them: lane l has scales l and l + kWarpSize and top-k entry l.
// Loaded before the token's row is copied and stored after it, so that these small loads add no round trip of their
// own (FP8 dispatch spent three per destination on them). Entries past those (more than 2 x kWarpSize scales or
// kWarpSize top-k) are read from the source when stored.
struct TokenMeta {
  const float* scales;
  const int64_t* idx;  // null: no top-k
  const float* w;
  float scale[2];
  int64_t id;
  float weight;
};

PORTEP_DEVICE TokenMeta load_meta(const HTDispatchArgs& a, const float* scales, const int64_t* idx, const float* w) {
  const int lane = lane_id();
  TokenMeta m{scales, idx, w, {0.0f, 0.0f}, 0, 0.0f};
  if (lane < a.num_scales) m.scale[0] = scales[lane];
  if (lane + kWarpSize < a.num_scales) m.scale[1] = scales[lane + kWarpSize];
  if (idx && lane < a.num_topk) m.id = idx[lane], m.weight = w[lane];
  return m;
}

// Warp-wide: the token's scales at dst.
PORTEP_DEVICE void store_scales(const HTDispatchArgs& a, const TokenMeta& m, float* dst) {
  const int lane = lane_id();
  if (lane < a.num_scales) dst[lane] = m.scale[0];
  if (lane + kWarpSize < a.num_scales) dst[lane + kWarpSize] = m.scale[1];
  for (int j = lane + 2 * kWarpSize; j < a.num_scales; j += kWarpSize) dst[j] = m.scales[j];
}

// Top-k entry k, for the lane k % kWarpSize.
PORTEP_DEVICE int64_t meta_id(const TokenMeta& m, int k) { return k < kWarpSize ? m.id : m.idx[k]; }
PORTEP_DEVICE float meta_weight(const TokenMeta& m, int k) { return k < kWarpSize ? m.weight : m.w[k]; }

// Warp-wide: one token's scales, top-k (as this rank's local ids) and provenance (source index; with forwarding the
// source node and node mask) into output row `row` (< a.max_recv), all but the row itself.
PORTEP_DEVICE void write_output_meta(const HTDispatchArgs& a, int64_t row, int src_token, const TokenMeta& m,
                                     int src_node, uint32_t node_bits) {
  const int lane = lane_id();
  store_scales(a, m, a.recv_scales + row * a.num_scales);
  if (a.recv_topk_idx) {
    const int64_t first = int64_t(a.c.rank) * a.num_local_experts;
    for (int k = lane; k < a.num_topk; k += kWarpSize) {
      const int64_t e = meta_id(m, k);
      const bool mine = e >= first && e < first + a.num_local_experts;
      a.recv_topk_idx[row * a.num_topk + k] = mine ? e - first : -1;
      a.recv_topk_weights[row * a.num_topk + k] = mine ? meta_weight(m, k) : 0.0f;
    }
  }
  if (a.recv_src_idx && lane == 0) a.recv_src_idx[row] = src_token;
  if (a.recv_src_meta && lane == 0) {
    a.recv_src_meta[2 * row] = src_node;
    a.recv_src_meta[2 * row + 1] = int32_t(node_bits);
  }
}

// Warp-wide: the row (src_x) and write_output_meta. src_* point at the token's parts in a record.
PORTEP_DEVICE void write_output_row(const HTDispatchArgs& a, int64_t row, int src_token, const uint8_t* src_x,
                                    const float* src_scales, const int64_t* src_idx, const float* src_w, int src_node,
                                    uint32_t node_bits) {
  if (row >= a.max_recv) return;  // num_worst_tokens too small: the notify kernel reported it
  const TokenMeta m = load_meta(a, src_scales, src_idx, src_w);
  warp_copy16(reinterpret_cast<uint4*>(a.recv_x + row * a.row_bytes), reinterpret_cast<const uint4*>(src_x),
              a.row_bytes / 16);
  write_output_meta(a, row, src_token, m, src_node, node_bits);
}

// Warp-wide: token t's record at `dst` (a direct peer's receive area or this rank's staging area) but for its row
// (after the header); node_bits: the token's destinations on the receiver's node.
PORTEP_DEVICE void write_record_meta(const HTDispatchArgs& a, const Record& rec, uint8_t* dst, int t,
                                     uint32_t node_bits, const TokenMeta& m) {
  const int lane = lane_id();
  if (lane < kHTRowHeaderBytes / 4)
    reinterpret_cast<int32_t*>(dst)[lane] = lane == kHTRowToken      ? t
                                            : lane == kHTRowNodeMask ? int32_t(node_bits)
                                            : lane == kHTRowSource   ? a.c.rank
                                                                     : 0;
  store_scales(a, m, reinterpret_cast<float*>(dst + rec.scales));
  if (m.idx) {
    int64_t* idx = reinterpret_cast<int64_t*>(dst + rec.topk);
    float* w = reinterpret_cast<float*>(dst + rec.weights);
    for (int k = lane; k < a.num_topk; k += kWarpSize) idx[k] = meta_id(m, k), w[k] = meta_weight(m, k);
  }
}

struct SendState {
  TokenPeers tp;                      // batch: each warp's token's peers and node masks
  uint32_t batch[kHTMaxPeers];        // batch: rows per peer
  uint32_t sent[kHTMaxPeers];         // rows of this channel stored per peer so far
  uint32_t flushed[kHTMaxPeers];      // proxy peers: rows of this channel handed to WRITEs
  uint32_t chan_start[kHTMaxPeers];   // without forwarding: this channel's first row in this rank's block at p
  uint64_t remote_ring[kHTMaxPeers];  // this rank's ring at p (receive area offset)
  uint64_t stage_ring[kHTMaxPeers];   // its staging ring for p (proxy peers)
  uint8_t* row_base[kHTMaxPeers];     // where this rank stores its ring's rows for p (p's receive area, or staging)
  int64_t self_row0;                  // output row of this channel's first row to this rank
  uint64_t epoch;
  int failed;
};

PORTEP_DEVICE void init_send_state(const HTDispatchArgs& a, const Record& rec, SendState& st, int ch) {
  const HTCommon& c = a.c;
  const int C = c.num_channels;
  for (int p = threadIdx.x; p < ht_num_peers(c); p += blockDim.x) {
    const int d = peer_rank(c, p);
    st.sent[p] = st.flushed[p] = 0;
    st.chan_start[p] = uint32_t(sent_before_channel(a.channel_prefix, C, d, ch));
    st.remote_ring[p] = peer_is_self(c, p) ? 0 : ht_ring_offset(c, d, c.rank, ch, a.ring_rows, rec.bytes);
    st.stage_ring[p] = peer_is_self(c, p) ? 0 : ht_ring_offset(c, c.rank, d, ch, a.ring_rows, rec.bytes);
    st.row_base[p] = peer_is_self(c, p) ? nullptr
                     : c.peers[d]       ? c.peers[d] + c.recv_off + st.remote_ring[p]
                                        : proxy_ring_slot(c, d, st.stage_ring[p], st.remote_ring[p], 0);
  }
  if (threadIdx.x == 0) {
    st.self_row0 =
        rows_before(a.recv_prefix, a.recv_prefix_stride, c.rank) + sent_before_channel(a.channel_prefix, C, c.rank, ch);
    st.epoch = *c.epoch;
    st.failed = 0;
  }
}

// Warp-wide: send_head[t] (without forwarding, where every destination is a peer): the token's row index at each
// destination, -1 where it does not go.
PORTEP_DEVICE void write_send_head(const HTDispatchArgs& a, const SendState& st, int t, int warp) {
  const HTCommon& c = a.c;
  for (int d = lane_id(); d < c.num_ranks; d += kWarpSize) {
    const int p = peer_slot(c, c.rank, d);
    int pos = -1;
    if (has_peer(st.tp, warp, p)) pos = int(st.chan_start[p] + st.sent[p] + rows_with_peer(st.tp, warp, p));
    a.send_head[int64_t(t) * c.num_ranks + d] = pos;
  }
}

// Where token t's row goes at peer p (its index i among this channel's rows to p): the output row for this rank,
// else the record's row after its header. null: past the outputs (num_worst_tokens too small: notify reported it).
PORTEP_DEVICE uint4* row_at_peer(const HTDispatchArgs& a, const Record& rec, const SendState& st, int p, uint32_t i,
                                 int64_t* self_row) {
  if (!st.row_base[p]) {  // this rank
    *self_row = st.self_row0 + i;
    return *self_row < a.max_recv ? reinterpret_cast<uint4*>(a.recv_x + *self_row * a.row_bytes) : nullptr;
  }
  return reinterpret_cast<uint4*>(st.row_base[p] + ht_ring_slot(i, a.ring_rows, rec.bytes) + kHTRowHeaderBytes);
}

// Warp-wide: token t to every peer of its mask, kCopyGroup destinations per copy (the row loaded once per group).
constexpr int kCopyGroup = 8;
PORTEP_DEVICE void send_token(const HTDispatchArgs& a, const Record& rec, SendState& st, int t, int warp) {
  const HTCommon& c = a.c;
  if (a.send_head) write_send_head(a, st, t, warp);
  const TokenMeta m =
      load_meta(a, a.scales + int64_t(t) * a.num_scales, a.topk_idx ? a.topk_idx + int64_t(t) * a.num_topk : nullptr,
                a.topk_weights ? a.topk_weights + int64_t(t) * a.num_topk : nullptr);
  const uint4* src = reinterpret_cast<const uint4*>(a.x + int64_t(t) * a.row_bytes);
  uint4* rows[kCopyGroup];
  int to[kCopyGroup], num_rows = 0;
  int64_t self_row = 0;
  auto flush = [&] {
    warp_copy16_to(rows, num_rows, src, a.row_bytes / 16);
    for (int q = 0; q < num_rows; ++q) {
      const uint32_t bits = st.tp.node_bits[warp][peer_node(c, to[q])];
      if (!st.row_base[to[q]])
        write_output_meta(a, self_row, t, m, node_of(c, c.rank), bits);
      else
        write_record_meta(a, rec, reinterpret_cast<uint8_t*>(rows[q]) - kHTRowHeaderBytes, t, bits, m);
    }
    num_rows = 0;
  };
  for (int p = 0; p < ht_num_peers(c); ++p) {
    if (!has_peer(st.tp, warp, p)) continue;
    uint4* row = row_at_peer(a, rec, st, p, st.sent[p] + rows_with_peer(st.tp, warp, p), &self_row);
    if (!row) continue;
    rows[num_rows] = row;
    to[num_rows++] = p;
    if (num_rows == kCopyGroup) flush();  // (self_row: a token goes to this rank once)
  }
  if (num_rows) flush();
}

// Thread p after a batch: announce peer p's rows of this channel so far (last: the channel is done).
PORTEP_DEVICE void announce(const HTDispatchArgs& a, const Record& rec, SendState& st, int p, int ch, uint32_t added,
                            bool last) {
  const HTCommon& c = a.c;
  if (peer_is_self(c, p)) return;
  const int d = peer_rank(c, p);
  if (c.peers[d]) {
    if (added) publish_tail(tail_word(c, c.peers[d], false, c.rank, ch), st.epoch, st.sent[p]);
    return;
  }
  if (added) fence_sys();  // the rows (staged or placed) before the WRITEs that move or announce them
  flush_rows(c, d, ht_data_stream(c, false, ch), st.stage_ring[p], st.remote_ring[p], uint32_t(rec.bytes), a.ring_rows,
             &st.flushed[p], st.sent[p], last);
}

PORTEP_DEVICE void send_channel(const HTDispatchArgs& a, int ch) {
  __shared__ SendState st;
  const HTCommon& c = a.c;
  const int C = c.num_channels, P = ht_num_peers(c), warp = threadIdx.x / kWarpSize;
  const Record rec = ht_dispatch_row(a);
  init_send_state(a, rec, st, ch);
  const int t0 = channel_begin(a.num_tokens, C, ch), t1 = channel_begin(a.num_tokens, C, ch + 1);
  for (int b = t0; b < t1; b += kHTWarps) {
    const int t = b + warp;
    __syncthreads();  // the previous batch's bookkeeping is done
    load_token_peers(c, a.is_token_in_rank, t < t1 ? t : -1, warp, st.tp);
    __syncthreads();
    for (int p = threadIdx.x; p < P; p += blockDim.x) {  // room in p's ring for this batch
      const uint32_t n = rows_with_peer(st.tp, kHTWarps, p);
      st.batch[p] = n;
      if (n && !peer_is_self(c, p) && !await_room(c, false, peer_rank(c, p), ch, st.epoch, st.sent[p] + n, a.ring_rows))
        st.failed = 1;
    }
    __syncthreads();
    if (st.failed) return;
    if (t < t1) send_token(a, rec, st, t, warp);
    __syncthreads();
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
      st.sent[p] += st.batch[p];
      announce(a, rec, st, p, ch, st.batch[p], b + kHTWarps >= t1);
    }
  }
  for (int p = threadIdx.x; p < P; p += blockDim.x)
    if (!peer_is_self(c, p)) collect_credits(c, false, peer_rank(c, p), ch, st.sent[p]);
}

// The receiver's inputs: j < P the ring from peer j (same-node senders; every sender without forwarding), then
// P + l the forward ring from this node's local rank l (forwarding).
constexpr int kHTMaxInputs = kHTMaxPeers + kHTMaxNodeRanks;

struct RecvState {
  uint32_t rows[kHTMaxInputs];      // rows of this channel from each input
  uint32_t done[kHTMaxInputs];      // copied out so far
  uint32_t avail[kHTMaxInputs];     // known to be in the ring
  uint32_t credited[kHTMaxInputs];  // proxy sources: chunks credited back
  int64_t first[kHTMaxPeers];       // output row of the channel's first row from each peer j (not forwarded)
  int all_done, failed;
};

PORTEP_DEVICE int num_inputs(const HTCommon& c) { return ht_num_peers(c) + (ht_forwarding(c) ? c.ranks_per_node : 0); }
// The rank that writes input j.
PORTEP_DEVICE int input_rank(const HTCommon& c, int j) {
  const int P = ht_num_peers(c);
  return j < P ? peer_rank(c, j) : node_of(c, c.rank) * c.ranks_per_node + j - P;
}

// Thread j: rows of input j in this channel known to be in place (non-blocking).
PORTEP_DEVICE uint32_t rows_arrived(const HTDispatchArgs& a, const RecvState& st, int ch, int j, uint64_t epoch) {
  const HTCommon& c = a.c;
  const int s = input_rank(c, j);
  if (j >= ht_num_peers(c))
    return min(st.rows[j], rows_of(ld_acquire_sys_u64(fwd_tail_word(c, c.local, false, s, ch)), epoch));
  if (c.peers[s]) return min(st.rows[j], rows_of(ld_acquire_sys_u64(tail_word(c, c.local, false, s, ch)), epoch));
  const uint64_t i = uint64_t(s) * c.num_streams + ht_data_stream(c, false, ch);
  const uint32_t units = uint32_t(ld_acquire_sys_u64(c.host_signals + i)) - uint32_t(c.signal_seen[i]);
  return uint32_t(min(uint64_t(st.rows[j]), uint64_t(units) * kHTChunkRows));
}

PORTEP_DEVICE void init_recv_state(const HTDispatchArgs& a, RecvState& st, int ch) {
  const HTCommon& c = a.c;
  const int L = c.ranks_per_node, C = c.num_channels, P = ht_num_peers(c), me = node_of(c, c.rank);
  for (int j = threadIdx.x; j < num_inputs(c); j += blockDim.x) {
    if (j < P) {
      const int s = peer_rank(c, j);
      const bool forwarded = ht_forwarding(c) && j >= L;  // its rows come through input P + local_of(s)
      st.rows[j] = peer_is_self(c, j) || forwarded ? 0 : rows_from_source(a, s, ch);
      st.first[j] = rows_before(a.recv_prefix, a.recv_prefix_stride, s) + a.recv_channel_prefix[s * C + ch];
    } else {
      uint32_t rows = 0;  // the sources of other nodes with local index j - P
      for (int n = 0; n < num_nodes(c); ++n)
        if (n != me) rows += rows_from_source(a, n * L + j - P, ch);
      st.rows[j] = rows;
    }
    st.done[j] = st.avail[j] = st.credited[j] = 0;
  }
  if (threadIdx.x == 0) st.failed = 0;
}

// Warp-wide: row r of input j (at src) to its output row.
PORTEP_DEVICE void place_row(const HTDispatchArgs& a, const Record& rec, const RecvState& st, int j, uint32_t r,
                             const uint8_t* src, int ch) {
  const HTCommon& c = a.c;
  const int32_t* h = reinterpret_cast<const int32_t*>(src);
  const int64_t row = j < ht_num_peers(c)
                          ? st.first[j] + r
                          : rows_before(a.recv_prefix, a.recv_prefix_stride, h[kHTRowSource]) +
                                a.recv_channel_prefix[h[kHTRowSource] * c.num_channels + ch] + h[kHTRowIndex];
  write_output_row(a, row, h[kHTRowToken], src + kHTRowHeaderBytes, reinterpret_cast<const float*>(src + rec.scales),
                   reinterpret_cast<const int64_t*>(src + rec.topk), reinterpret_cast<const float*>(src + rec.weights),
                   node_of(c, h[kHTRowSource]), uint32_t(h[kHTRowNodeMask]));
}

// Thread j: input j's rows up to st.done[j] were copied out; their slots go back to the writer.
PORTEP_DEVICE void release_rows(const HTDispatchArgs& a, RecvState& st, int j, int ch, uint64_t epoch) {
  const HTCommon& c = a.c;
  const int s = input_rank(c, j);
  if (j < ht_num_peers(c)) {
    return_rows(c, false, s, ch, epoch, st.done[j], &st.credited[j]);
    return;
  }
  st_relaxed_sys_u64(fwd_head_word(c, c.peers[s], false, c.rank, ch), ht_word_value(epoch, st.done[j]));
}

// Rows [first, end) of the outputs poisoned: recv_x and recv_topk_weights (index outputs keep what they hold, so
// that nothing indexes with a poisoned value).
PORTEP_DEVICE void poison_dispatch_rows(const HTDispatchArgs& a, int64_t first, int64_t end) {
  poison_rows(a.recv_x, first, end, a.max_recv, a.row_bytes);
  if (a.recv_topk_weights) poison_rows(a.recv_topk_weights, first, end, a.max_recv, 4 * int64_t(a.num_topk));
}

// The receiver of channel ch after its op failed: every output row of the channel, from every source (the handle's
// prefixes place them). where_unknown: the Buffer had failed before the op, so the prefixes may be stale; the
// channel's share of all output rows instead.
PORTEP_DEVICE void poison_dispatch_channel(const HTDispatchArgs& a, int ch, bool where_unknown) {
  const HTCommon& c = a.c;
  const int C = c.num_channels;
  if (where_unknown) {
    poison_dispatch_rows(a, a.max_recv * ch / C, a.max_recv * (ch + 1) / C);
    return;
  }
  for (int s = 0; s < c.num_ranks; ++s) {
    const int64_t first = rows_before(a.recv_prefix, a.recv_prefix_stride, s) + a.recv_channel_prefix[s * C + ch];
    poison_dispatch_rows(a, first, first + rows_from_source(a, s, ch));
  }
}

// Serves every input at once (a sender blocked on a full ring to one rank must not stall the others): each
// round copies whatever arrived, then hands the ring slots back.
PORTEP_DEVICE void receive_channel(const HTDispatchArgs& a, int ch) {
  __shared__ RecvState st;
  const HTCommon& c = a.c;
  const int P = ht_num_peers(c), J = num_inputs(c), warp = threadIdx.x / kWarpSize;
  const Record rec = ht_dispatch_row(a);
  const uint64_t epoch = *c.epoch;
  init_recv_state(a, st, ch);
  uint64_t idle_since = globaltimer_ns();  // thread 0's
  for (;;) {
    __syncthreads();  // the previous round's copies and bookkeeping are done
    for (int j = threadIdx.x; j < J; j += blockDim.x)
      if (st.done[j] < st.rows[j]) st.avail[j] = rows_arrived(a, st, ch, j, epoch);
    __syncthreads();
    if (threadIdx.x == 0) {
      bool progress = false, all = true;
      int waiting = -1;
      for (int i = 0; i < J; ++i) {
        progress |= st.avail[i] > st.done[i];
        all &= st.done[i] == st.rows[i];
        if (st.done[i] < st.rows[i] && waiting < 0) waiting = i;
      }
      st.all_done = all;
      const uint64_t now = globaltimer_ns();
      if (progress || all) {
        idle_since = now;
      } else if (now - idle_since > c.timeout_ns || reported_error(c) ||
                 (now - idle_since > kPeerGraceNs && peer_down(c, input_rank(c, waiting)))) {
        // (a failure elsewhere voids the op too; a peer that will not answer fails it)
        report_lost(c, input_rank(c, waiting), idle_wait_end(c, now - idle_since, input_rank(c, waiting)),
                    uint32_t(ch));
        st.failed = 1;
      } else if (waiting < P && !c.peers[input_rank(c, waiting)]) {
        sleep_ns(kProxyPollNs);  // host-memory polls cross PCIe
      }
    }
    __syncthreads();
    if (st.all_done) break;
    if (st.failed) {
      poison_dispatch_channel(a, ch, false);
      break;
    }
    for (int i = 0; i < J; ++i) {
      if (st.avail[i] <= st.done[i]) continue;
      const uint64_t ring = i < P ? ht_ring_offset(c, c.rank, input_rank(c, i), ch, a.ring_rows, rec.bytes)
                                  : ht_fwd_ring_offset(c, i - P, ch, a.ring_rows, rec.bytes);
      for (uint32_t r = st.done[i] + warp; r < st.avail[i]; r += kHTWarps)
        place_row(a, rec, st, i, r, c.local + c.recv_off + ring + ht_ring_slot(r, a.ring_rows, rec.bytes), ch);
    }
    __syncthreads();  // every copy's loads returned before the slots go back
    for (int j = threadIdx.x; j < J; j += blockDim.x)
      if (st.avail[j] > st.done[j]) {
        st.done[j] = st.avail[j];
        release_rows(a, st, j, ch, epoch);
      }
  }
  // With forwarding, a peer of another node sends this rank nothing through its own ring here (st.rows 0), and the
  // forwarder block consumes that same stream word meanwhile: consume_units leaves the word alone for 0 units.
  for (int j = threadIdx.x; j < P; j += blockDim.x) {
    const int s = peer_rank(c, j);
    if (!peer_is_self(c, j) && !c.peers[s]) consume_units(c, s, ht_data_stream(c, false, ch), chunks(st.rows[j]));
  }
}

struct ForwardState {
  uint32_t masks[kHTWarps];                            // batch: each warp's row's local destinations
  uint32_t sent[kHTMaxNodeRanks];                      // rows stored into local rank l's forward ring so far
  uint32_t batch[kHTMaxNodeRanks];                     // batch: rows per local rank
  uint32_t of_source[kHTMaxNodes][kHTMaxNodeRanks];    // of those, node n's served source's
  uint32_t rows[kHTMaxNodes], done[kHTMaxNodes];       // node n's served source: its rows, those forwarded
  uint32_t avail[kHTMaxNodes], credited[kHTMaxNodes];  // its rows known in place; chunks credited back
  int pick, failed;                                    // the source node of this turn (-1: none left)
};

// Warp-wide: the row at src (from node n's served source), as nvl_head row `row`, into each local destination's
// forward ring, its header's index set to the row's index among the source's rows of this channel to that rank
// (the receiver places forwarded rows by source and index, so the sources' rows may interleave in a ring).
PORTEP_DEVICE void forward_row(const HTDispatchArgs& a, const Record& rec, const ForwardState& st, int n,
                               const uint8_t* src, int warp, int64_t row, int ch) {
  const HTCommon& c = a.c;
  const int L = c.ranks_per_node, lane = lane_id(), base = node_of(c, c.rank) * L;
  const uint32_t mask = st.masks[warp];
  const uint64_t ring = ht_fwd_ring_offset(c, local_of(c, c.rank), ch, a.ring_rows, rec.bytes);
  const int32_t* h = reinterpret_cast<const int32_t*>(src);
  int32_t my_index = -1;         // lane l's
  uint4* dsts[kHTMaxNodeRanks];  // the record after its header, at each destination
  int k = 0;
  for (int l = 0; l < L; ++l) {
    if (!(mask >> l & 1)) continue;
    const uint32_t pos = rows_with_bit(st.masks, warp, l);
    const int32_t index = int32_t(st.of_source[n][l] + pos);
    if (lane == l) my_index = index;
    uint8_t* dst = c.peers[base + l] + c.recv_off + ring + ht_ring_slot(st.sent[l] + pos, a.ring_rows, rec.bytes);
    if (lane < kHTRowHeaderBytes / 4) reinterpret_cast<int32_t*>(dst)[lane] = lane == kHTRowIndex ? index : h[lane];
    dsts[k++] = reinterpret_cast<uint4*>(dst + kHTRowHeaderBytes);
  }
  warp_copy16_to(dsts, k, reinterpret_cast<const uint4*>(src + kHTRowHeaderBytes),
                 (rec.bytes - kHTRowHeaderBytes) / 16);
  if (a.nvl_head && row < a.nvl_rows && lane < L) a.nvl_head[row * kHTNvlHeadColumns + lane] = my_index;
}

// Thread 0 of a forwarder that found no rows in place for idle_ns: false (reported) when it waited past the timeout,
// a failure was reported elsewhere, or, past the grace, the rank of a source it still waits for is down (named).
PORTEP_DEVICE bool forwarder_may_wait(const HTCommon& c, const ForwardState& st, uint64_t idle_ns, uint32_t stream) {
  const int Nn = num_nodes(c), me = node_of(c, c.rank), L = c.ranks_per_node;
  int first = -1;
  for (int n = 0; n < Nn; ++n) {
    if (n == me || st.done[n] >= st.rows[n]) continue;
    const int src = n * L + local_of(c, c.rank);
    if (first < 0) first = src;
    if (idle_ns > kPeerGraceNs && peer_down(c, src)) {
      report_lost(c, src, kWaitPeerDown, stream);
      return false;
    }
  }
  const uint32_t end = idle_wait_end(c, idle_ns, first);
  if (end == kWaitDone) return true;
  report_lost(c, first, end, stream);
  return false;
}

// Thread 0: the node whose served source this channel's forwarder serves next, round robin after `last`: the first
// with rows in place beyond those forwarded; -1 when every source is done, -2 when the op failed (reported). It waits
// for whichever source's rows come first, never for one source: a sender stopped for room in its ring here has rows
// in place, so the forwarder never waits on a source while another source's sender waits on it (with ranks of
// other nodes waiting in turn, that could close a cycle).
PORTEP_DEVICE int next_source(const HTCommon& c, ForwardState& st, int ch, int last) {
  constexpr uint32_t kScansPerCheck = 64;  // the limits read device and host words: not on every scan
  const int Nn = num_nodes(c), me = node_of(c, c.rank), L = c.ranks_per_node, stream = ht_data_stream(c, false, ch);
  const uint64_t idle_since = globaltimer_ns();
  for (uint32_t scan = 1;; ++scan) {
    bool open = false;
    for (int k = 1; k <= Nn; ++k) {
      const int n = (last + k) % Nn;
      if (n == me || st.done[n] >= st.rows[n]) continue;
      open = true;
      if (st.avail[n] == st.done[n]) {  // host memory (the proxies' signal counts): read only when needed
        const uint64_t i = uint64_t(n * L + local_of(c, c.rank)) * c.num_streams + stream;
        const uint32_t units = uint32_t(ld_acquire_sys_u64(c.host_signals + i)) - uint32_t(c.signal_seen[i]);
        st.avail[n] = uint32_t(min(uint64_t(st.rows[n]), uint64_t(units) * kHTChunkRows));
      }
      if (st.avail[n] > st.done[n]) return n;
    }
    if (!open) return -1;
    if (scan % kScansPerCheck == 0 && !forwarder_may_wait(c, st, globaltimer_ns() - idle_since, uint32_t(stream)))
      return -2;
    sleep_ns(kProxyPollNs);  // host-memory polls cross PCIe
  }
}

// One turn of the forwarder: up to a chunk of node n's served source's rows in place, batch by batch.
PORTEP_DEVICE bool forward_turn(const HTDispatchArgs& a, const Record& rec, ForwardState& st, int n, int ch,
                                uint64_t epoch) {
  const HTCommon& c = a.c;
  const int L = c.ranks_per_node, l = threadIdx.x, warp = threadIdx.x / kWarpSize, base = node_of(c, c.rank) * L;
  const int s = n * L + local_of(c, c.rank);
  const int64_t row0 = served_row0(c, a.fwd_channel_prefix, a.fwd_rank_prefix, n, ch);
  const uint8_t* ring = c.local + c.recv_off + ht_ring_offset(c, c.rank, s, ch, a.ring_rows, rec.bytes);
  const uint32_t rows = st.rows[n], first = st.done[n], stop = min(st.avail[n], first + uint32_t(kHTChunkRows));
  for (uint32_t b = first; b < stop; b += kHTWarps) {
    const uint32_t end = min(b + kHTWarps, stop), r = b + warp;
    __syncthreads();  // the previous batch's bookkeeping is done (and every thread read this turn's state)
    const uint8_t* src = ring + ht_ring_slot(r, a.ring_rows, rec.bytes);
    if (lane_id() == 0) st.masks[warp] = r < end ? reinterpret_cast<const uint32_t*>(src)[kHTRowNodeMask] : 0;
    __syncthreads();
    if (l < L) {
      const uint32_t k = rows_with_bit(st.masks, kHTWarps, l);
      st.batch[l] = k;
      if (k && !await_fwd_room(c, false, base + l, ch, epoch, st.sent[l] + k, a.ring_rows)) st.failed = 1;
    }
    __syncthreads();
    if (st.failed) return false;
    if (r < end) forward_row(a, rec, st, n, src, warp, row0 + r, ch);
    __syncthreads();  // every copy's loads returned (the ring slots go back) and stores were made (tails)
    if (l < L && st.batch[l]) {
      st.sent[l] += st.batch[l];
      st.of_source[n][l] += st.batch[l];
      publish_tail(fwd_tail_word(c, c.peers[base + l], false, c.rank, ch), epoch, st.sent[l]);
    }
    if (threadIdx.x == 0) {
      return_rows(c, false, s, ch, epoch, end, &st.credited[n]);
      st.done[n] = end;
      if (end == rows) consume_units(c, s, ht_data_stream(c, false, ch), chunks(rows));
    }
  }
  return true;
}

// Serves the sources of other nodes with this rank's local index a chunk at a time each, in turn (next_source).
PORTEP_DEVICE void forward_channel(const HTDispatchArgs& a, int ch) {
  __shared__ ForwardState st;
  const HTCommon& c = a.c;
  const Record rec = ht_dispatch_row(a);
  const uint64_t epoch = *c.epoch;
  const int Nn = num_nodes(c), me = node_of(c, c.rank), L = c.ranks_per_node;
  for (int n = threadIdx.x; n < Nn; n += blockDim.x) {
    st.rows[n] = n == me ? 0 : served_rows(c, a.fwd_channel_prefix, a.fwd_rank_prefix, n, ch);
    st.done[n] = st.avail[n] = st.credited[n] = 0;
    for (int l = 0; l < L; ++l) st.of_source[n][l] = 0;
  }
  if (int(threadIdx.x) < L) st.sent[threadIdx.x] = 0;
  if (threadIdx.x == 0) st.failed = 0, st.pick = me;
  for (;;) {
    __syncthreads();  // the turn's bookkeeping (or the state's start) is done
    if (threadIdx.x == 0) st.pick = next_source(c, st, ch, st.pick < 0 ? me : st.pick);
    __syncthreads();
    const int n = st.pick;
    if (n < 0 || !forward_turn(a, rec, st, n, ch, epoch)) return;
  }
}

__global__ void __launch_bounds__(kHTThreads, 1) ht_dispatch_kernel(HTDispatchArgs a) {
  const int per = ht_forwarding(a.c) ? 3 : 2, role = blockIdx.x % per, ch = blockIdx.x / per;
  if (failed_before(a.c)) {  // nothing moves; the outputs are poisoned
    if (role == 1) poison_dispatch_channel(a, ch, true);
    return;
  }
  if (role == 0)
    send_channel(a, ch);
  else if (role == 1)
    receive_channel(a, ch);
  else
    forward_channel(a, ch);
}

}  // namespace

int ht_dispatch(const HTDispatchArgs& a) {
  const int blocks = ht_blocks_per_channel(a.c) * a.c.num_channels;
  return int(launch_kernel<ht_dispatch_kernel>(blocks, kHTThreads, 0, static_cast<cudaStream_t>(a.c.stream), a));
}

int load_ht_dispatch_kernels() { return int(load_kernel(ht_dispatch_kernel)); }

}  // namespace portep::cuda
