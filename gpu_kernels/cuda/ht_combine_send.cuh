// The HT combine's sender block (ht_combine.cu): this rank's rows back to their sources, each source's through ring
// (source, channel), or with forwarding, for a source of another node, through the forward ring of its forwarder
// here (the rank of this node with the source's local index). It serves every ring at once, each a lane that takes
// what room its ring has.
#pragma once

#include "gpu_kernels/cuda/ht_common.cuh"

namespace portep::cuda {
namespace {

// Row stride of every combine ring (ht_layout.h).
PORTEP_DEVICE uint32_t slot_bytes(const HTCombineArgs& a) { return ht_combine_row_bytes(ht_forwarding(a.c), a); }

// Warp-wide: x's row `row` (and its weights) as one contribution at dst.
PORTEP_DEVICE void write_contribution(const HTCombineArgs& a, uint8_t* dst, int64_t row) {
  warp_copy16(reinterpret_cast<uint4*>(dst), reinterpret_cast<const uint4*>(a.x + row * a.hidden), a.hidden * 2 / 16);
  if (a.topk_weights) {
    float* w = reinterpret_cast<float*>(dst + ht_combine_weights(false, a.hidden));
    for (int k = lane_id(); k < a.num_topk; k += kWarpSize) w[k] = a.topk_weights[row * a.num_topk + k];
  }
}

// Peer p gets its rows from this sender itself: not this rank, and with forwarding not a peer of another node (those
// get theirs from forwarders).
PORTEP_DEVICE bool sends_directly(const HTCommon& c, int p) {
  return !peer_is_self(c, p) && !(ht_forwarding(c) && p >= c.ranks_per_node);
}

// At the end of a sender's op: the credits of every proxy reader it sent rows to (collect_credits). Block-wide.
PORTEP_DEVICE void collect_send_credits(const HTCombineArgs& a, int ch) {
  for (int p = threadIdx.x; p < ht_num_peers(a.c); p += blockDim.x)
    if (sends_directly(a.c, p))
      collect_credits(a.c, true, peer_rank(a.c, p), ch, rows_from_source(a, peer_rank(a.c, p), ch));
}

// Lane j < P (peer index): the ring to peer j's rank, for its own tokens (not self; with forwarding, same-node peers
// only). Lane P + l (forwarding): the forward ring to this node's rank of local index l, which carries the rows of
// the sources of other nodes with local index l, nodes ascending (the order its forwarder reduces them in).
constexpr int kHTMaxSendLanes = kHTMaxPeers + kHTMaxNodeRanks;

struct LaneState {
  uint32_t seg[kHTMaxSendLanes];       // forward lanes: the node of the source served now (Nn: all served)
  uint32_t done[kHTMaxSendLanes];      // rows of the current source stored
  uint32_t pos[kHTMaxSendLanes];       // ring index of the lane's next row (a forward ring carries several sources)
  uint32_t room_end[kHTMaxSendLanes];  // ring index up to which the reader had room when last read
  uint32_t flushed[kHTMaxSendLanes];   // proxy lanes: rows handed to the proxies
  uint32_t take[kHTMaxSendLanes];      // this round's rows
  uint32_t first[kHTMaxSendLanes];     // this round's rows of the lanes before (warps share the rows out by it)
  uint8_t open[kHTMaxSendLanes];       // rows left
  int progress, all_done, failed;
};

PORTEP_DEVICE int num_send_lanes(const HTCommon& c) {
  return ht_num_peers(c) + (ht_forwarding(c) ? c.ranks_per_node : 0);
}
PORTEP_DEVICE bool is_forward_lane(const HTCommon& c, int j) { return j >= ht_num_peers(c); }
PORTEP_DEVICE bool lane_exists(const HTCommon& c, int j) { return is_forward_lane(c, j) || sends_directly(c, j); }
// The source lane j serves now, and the rank its ring belongs to.
PORTEP_DEVICE int lane_source(const HTCommon& c, const LaneState& st, int j) {
  return is_forward_lane(c, j) ? int(st.seg[j]) * c.ranks_per_node + (j - ht_num_peers(c)) : peer_rank(c, j);
}
PORTEP_DEVICE int lane_reader(const HTCommon& c, int j) {
  return is_forward_lane(c, j) ? node_of(c, c.rank) * c.ranks_per_node + (j - ht_num_peers(c)) : peer_rank(c, j);
}

// The ring index up to which lane j's reader has room (rows before it fit): the ring plus what the reader consumed.
// Reads without waiting.
PORTEP_DEVICE uint32_t lane_room_end(const HTCommon& c, int j, int ch, uint64_t epoch, uint32_t ring_rows) {
  const int d = lane_reader(c, j);
  if (is_forward_lane(c, j))
    return ring_rows + rows_of(ld_acquire_sys_u64(fwd_head_word(c, c.local, true, d, ch)), epoch);
  if (c.peers[d]) return ring_rows + rows_of(ld_acquire_sys_u64(head_word(c, c.local, true, d, ch)), epoch);
  const uint64_t i = uint64_t(d) * c.num_streams + ht_credit_stream(c, true, ch);  // credits: whole chunks
  return ring_rows + (uint32_t(ld_acquire_sys_u64(c.host_signals + i)) - uint32_t(c.signal_seen[i])) * kHTChunkRows;
}

// Thread of lane j: moves a forward lane past served (and empty) sources, then sets the rows this round stores.
PORTEP_DEVICE void plan_lane(const HTCombineArgs& a, LaneState& st, int j, int ch, uint64_t epoch) {
  const HTCommon& c = a.c;
  st.take[j] = 0;
  st.open[j] = 0;
  if (!lane_exists(c, j)) return;
  if (is_forward_lane(c, j)) {
    const uint32_t Nn = uint32_t(num_nodes(c)), me = uint32_t(node_of(c, c.rank));
    while (st.seg[j] < Nn && (st.seg[j] == me || st.done[j] == rows_from_source(a, lane_source(c, st, j), ch))) {
      ++st.seg[j];
      st.done[j] = 0;
    }
    if (st.seg[j] == Nn) return;
  }
  const uint32_t left = rows_from_source(a, lane_source(c, st, j), ch) - st.done[j];
  if (left == 0) return;
  st.open[j] = 1;
  const uint32_t want = min(left, uint32_t(kHTWarps));
  if (st.pos[j] + want > st.room_end[j])  // the room last read is short: read again (a proxy's crosses PCIe)
    st.room_end[j] = lane_room_end(c, j, ch, epoch, a.ring_rows);
  st.take[j] = st.room_end[j] > st.pos[j] ? min(want, st.room_end[j] - st.pos[j]) : 0;
}

// Thread 0, after a round without rows stored: fails the op (reported) when the lane waited on has waited past the
// timeout, its reader will not answer, or a failure was reported elsewhere; else, with a proxy lane among the
// waiting ones, waits a little before the next round. false: the op failed.
PORTEP_DEVICE bool lanes_may_wait(const HTCombineArgs& a, const LaneState& st, int ch, uint64_t idle_ns) {
  const HTCommon& c = a.c;
  int waiting = 0;
  while (!st.open[waiting]) ++waiting;
  const int d = lane_reader(c, waiting);
  const uint32_t end = idle_wait_end(c, idle_ns, d);
  if (end != kWaitDone) {
    report_lost(c, d, end, uint32_t(ch));
    return false;
  }
  for (int j = waiting; j < num_send_lanes(c); ++j)
    if (st.open[j] && !is_forward_lane(c, j) && !c.peers[lane_reader(c, j)]) {
      sleep_ns(kProxyPollNs);  // host-memory polls cross PCIe
      break;
    }
  return true;
}

// Thread 0, after the round's rows were stored (a barrier after the stores): announces them, the tails of direct
// readers and forwarders, the WRITEs of proxy readers. false: a push failed (reported).
PORTEP_DEVICE bool publish_lanes(const HTCombineArgs& a, LaneState& st, int ch, uint64_t epoch) {
  const HTCommon& c = a.c;
  const uint32_t bytes = slot_bytes(a);
  fence_sys();  // the rows (placed, staged or stored at a peer) before the tails and WRITEs that announce them
  for (int j = 0; j < num_send_lanes(c); ++j) {
    if (!st.take[j]) continue;
    const int s = lane_source(c, st, j), d = lane_reader(c, j);
    st.done[j] += st.take[j];
    st.pos[j] += st.take[j];
    if (is_forward_lane(c, j)) {
      st_relaxed_sys_u64(fwd_tail_word(c, c.peers[d], true, c.rank, ch), ht_word_value(epoch, st.pos[j]));
    } else if (c.peers[d]) {
      st_relaxed_sys_u64(tail_word(c, c.peers[d], true, c.rank, ch), ht_word_value(epoch, st.done[j]));
    } else if (!flush_rows(c, d, ht_data_stream(c, true, ch), ht_ring_offset(c, c.rank, s, ch, a.ring_rows, bytes),
                           ht_ring_offset(c, s, c.rank, ch, a.ring_rows, bytes), bytes, a.ring_rows, &st.flushed[j],
                           st.done[j], st.done[j] == rows_from_source(a, s, ch))) {
      return false;
    }
  }
  return true;
}

// Warp-wide: this warp's share of this round's rows of lane j (the round's rows of all lanes, in lane order, go to
// the warps in turn).
PORTEP_DEVICE void store_lane_rows(const HTCombineArgs& a, const LaneState& st, int j, int ch) {
  const HTCommon& c = a.c;
  const int s = lane_source(c, st, j), d = lane_reader(c, j), warp = threadIdx.x / kWarpSize;
  const uint32_t bytes = slot_bytes(a), Q = a.ring_rows;
  const uint64_t remote_ring = is_forward_lane(c, j) ? ht_fwd_ring_offset(c, local_of(c, c.rank), ch, Q, bytes)
                                                     : ht_ring_offset(c, s, c.rank, ch, Q, bytes);
  const uint64_t stage_ring = ht_ring_offset(c, c.rank, s, ch, Q, bytes);
  const int64_t row0 =
      rows_before(a.recv_prefix, a.recv_prefix_stride, s) + a.recv_channel_prefix[s * c.num_channels + ch];
  const uint32_t r0 = (uint32_t(warp) + kHTWarps - st.first[j] % kHTWarps) % kHTWarps;
  for (uint32_t r = r0; r < st.take[j]; r += kHTWarps) {
    const uint64_t slot = ht_ring_slot(st.pos[j] + r, Q, bytes);
    uint8_t* to = c.peers[d] ? c.peers[d] + c.recv_off + remote_ring + slot
                             : proxy_ring_slot(c, d, stage_ring, remote_ring, slot);
    write_contribution(a, to, row0 + st.done[j] + r);
  }
}

// Serves every lane at once, round by round: each lane stores what room its ring has (at most a row per warp), so a
// reader that is slow, or busy with another sender's rows, holds up only its own lane (a sender that served the
// sources one after another made every rank's reducers work in turn: twice the combine's time between nodes).
PORTEP_DEVICE void send_channel(const HTCombineArgs& a, int ch) {
  __shared__ LaneState st;
  const HTCommon& c = a.c;
  const int J = num_send_lanes(c);
  const uint64_t epoch = *c.epoch;
  for (int j = threadIdx.x; j < J; j += blockDim.x) {
    st.seg[j] = st.done[j] = st.pos[j] = st.flushed[j] = 0;
    st.room_end[j] = a.ring_rows;  // this op's rows start in an empty ring
  }
  if (threadIdx.x == 0) st.failed = 0;
  uint64_t idle_since = globaltimer_ns();  // thread 0's
  for (;;) {
    __syncthreads();  // the previous round's stores and bookkeeping are done
    for (int j = threadIdx.x; j < J; j += blockDim.x) plan_lane(a, st, j, ch, epoch);
    __syncthreads();
    if (threadIdx.x == 0 && !st.failed) {
      uint32_t rows = 0;
      bool all = true;
      for (int j = 0; j < J; ++j) {
        st.first[j] = rows;
        rows += st.take[j];
        all &= !st.open[j];
      }
      st.progress = rows != 0;
      st.all_done = all;
      const uint64_t now = globaltimer_ns();
      if (rows || all)
        idle_since = now;
      else if (!lanes_may_wait(a, st, ch, now - idle_since))
        st.failed = 1;
    }
    __syncthreads();
    if (st.all_done || st.failed) break;
    if (!st.progress) continue;  // (every thread alike: the flags are the block's)
    for (int j = 0; j < J; ++j)
      if (st.take[j]) store_lane_rows(a, st, j, ch);
    __syncthreads();  // every row stored before thread 0 announces them
    if (threadIdx.x == 0 && !publish_lanes(a, st, ch, epoch)) st.failed = 1;
  }
  if (st.failed) return;
  collect_send_credits(a, ch);
}

}  // namespace
}  // namespace portep::cuda
