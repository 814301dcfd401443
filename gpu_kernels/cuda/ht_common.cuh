// Device helpers shared by the normal-mode (HT) kernels (protocol in ht_api.h, every offset and size in
// ht_layout.h).
#pragma once

#include <stdint.h>

#include "gpu_kernels/cuda/ht_api.h"
#include "gpu_kernels/cuda/ll_common.cuh"

namespace portep::cuda {

constexpr int kHTThreads = 1024;                  // per data block
constexpr int kHTWarps = kHTThreads / kWarpSize;  // one token (or row) per warp per batch: 32 on CUDA, 16 on CDNA
// A proxy reader credits whole chunks only, so a sender always regains room for kHTChunkRows more rows than it
// flushed whole chunks of, in a ring of kHTMinRingRows = 2 chunks: a batch must not need more.
static_assert(kHTWarps <= kHTChunkRows, "a batch of rows fits the room a ring of two chunks always regains");
constexpr uint32_t kProxyPollNs = 200;

// DeepEP's split of tokens into channels: contiguous ranges of ceil(N / C) tokens.
PORTEP_DEVICE int channel_tokens(int num_tokens, int num_channels) {
  return num_tokens > 0 ? (num_tokens + num_channels - 1) / num_channels : 1;
}
PORTEP_DEVICE int channel_begin(int num_tokens, int num_channels, int ch) {
  return min(num_tokens, ch * channel_tokens(num_tokens, num_channels));
}

// ---- control area ----
// Slots alternate by the parity of the op's epoch: a rank may start op e + 1 while a peer that sends it nothing
// still reads its slot of op e, but it starts op e + 2 only after that peer finished op e's notify.
PORTEP_DEVICE uint8_t* notify_slot(const HTCommon& c, uint8_t* region, int src, uint64_t epoch) {
  return region + c.ctrl_off + ht_slot_off(c.ctrl, epoch, src);
}
PORTEP_DEVICE uint8_t* outgoing_slot(const HTCommon& c, int dst, uint64_t epoch) {
  return c.local + c.ctrl_off + ht_outgoing_off(c.ctrl, epoch, dst);
}
PORTEP_DEVICE uint64_t* slot_flag(uint8_t* slot) { return reinterpret_cast<uint64_t*>(slot + kHTSlotFlagOff); }
PORTEP_DEVICE int32_t* slot_counts(uint8_t* slot) { return reinterpret_cast<int32_t*>(slot + kHTSlotCountsOff); }
PORTEP_DEVICE int32_t* slot_channels(uint8_t* slot) { return reinterpret_cast<int32_t*>(slot + kHTSlotChannelsOff); }
PORTEP_DEVICE int32_t* slot_node_channels(uint8_t* slot) {
  return reinterpret_cast<int32_t*>(slot + kHTSlotNodeChannelsOff);
}
PORTEP_DEVICE int32_t* slot_experts(uint8_t* slot) { return reinterpret_cast<int32_t*>(slot + kHTSlotExpertsOff); }

// ---- peers (ht_layout.h) ----
PORTEP_DEVICE int node_of(const HTCommon& c, int r) { return r / c.ranks_per_node; }
PORTEP_DEVICE int local_of(const HTCommon& c, int r) { return r % c.ranks_per_node; }
PORTEP_DEVICE int num_nodes(const HTCommon& c) { return c.num_ranks / c.ranks_per_node; }
// The peer index of rank r in the tables of `viewer` (a rank of the same node as this one, or this rank).
PORTEP_DEVICE int peer_slot(const HTCommon& c, int viewer, int r) {
  return ht_peer_slot(c.ranks_per_node, node_of(c, viewer), r);
}
PORTEP_DEVICE int peer_rank(const HTCommon& c, int p) { return ht_peer_rank(c.ranks_per_node, c.rank, p); }
PORTEP_DEVICE bool peer_is_self(const HTCommon& c, int p) { return ht_peer_is_self(c.ranks_per_node, c.rank, p); }

// A word of one of the control area's tables in `region`: tails and heads by peer index, forward tails and heads
// by local index.
PORTEP_DEVICE uint64_t* control_word(const HTCommon& c, uint8_t* region, uint64_t table, uint64_t half_bytes,
                                     bool combine, int index, int ch) {
  return ht_word(region + c.ctrl_off + ht_word_half(table, half_bytes, combine), index, ch);
}
// In `region`'s control area (its owner on this rank's node): rows arrived from src (tail), and rows of the owner's
// ring the reader consumed (head).
PORTEP_DEVICE uint64_t* tail_word(const HTCommon& c, uint8_t* region, bool combine, int src, int ch) {
  return control_word(c, region, c.ctrl.tails, c.ctrl.word_half_bytes, combine, peer_slot(c, c.rank, src), ch);
}
PORTEP_DEVICE uint64_t* head_word(const HTCommon& c, uint8_t* region, bool combine, int reader, int ch) {
  return control_word(c, region, c.ctrl.heads, c.ctrl.word_half_bytes, combine, peer_slot(c, c.rank, reader), ch);
}
// Rows a tail or head word says for this epoch (0 while it still holds an earlier op's).
PORTEP_DEVICE uint32_t rows_of(uint64_t word, uint64_t epoch) {
  return word >= ht_word_value(epoch, 0) ? uint32_t(word) : 0;
}

// ---- token masks ----
// A batch gives each warp one token (or row). Its peers (a bit per peer index, kHTPeerWords words) say where its
// rows go from this rank or come from: its destinations on this node, and for every other node with any
// destination that node's peer (its rank with this rank's local index), the destinations themselves without
// forwarding. Its node masks (a bit per local rank of each node) say which ranks of each node it goes to.
constexpr int kHTPeerWords = (kHTMaxPeers + 31) / 32;
struct TokenPeers {
  uint32_t words[kHTWarps][kHTPeerWords];
  uint8_t node_bits[kHTWarps][kHTMaxNodes];
};
PORTEP_DEVICE bool has_peer(const TokenPeers& tp, int warp, int p) { return tp.words[warp][p >> 5] >> (p & 31) & 1; }
// How many of the batch's first n tokens have peer p: n = warp, the rows to (or from) p ahead of this warp's;
// n = kHTWarps, the batch's.
PORTEP_DEVICE uint32_t rows_with_peer(const TokenPeers& tp, int n, int p) {
  uint32_t k = 0;
  for (int w = 0; w < n; ++w) k += has_peer(tp, w, p);
  return k;
}
// Warp-wide: token t's node masks and peers from is_token_in_rank [N][R] (t < 0: no token, nothing set); the
// caller syncs the block before anyone reads them. Lanes take 32 nodes at a time (lane n % 32 loads node n's L
// flags) and one ballot gives the peer bits of those nodes, so a token costs one round per 32 nodes: no loop over
// peer indices, and up to 32 ranks (one round) its flags load in parallel as one byte per lane.
PORTEP_DEVICE void load_token_peers(const HTCommon& c, const bool* is_token_in_rank, int t, int warp, TokenPeers& tp) {
  const int L = c.ranks_per_node, Nn = num_nodes(c), me = node_of(c, c.rank), lane = lane_id();
  const bool* row = is_token_in_rank + int64_t(t) * c.num_ranks;
  uint32_t* words = tp.words[warp];
  if (lane < kHTPeerWords) words[lane] = 0;
  if (c.num_ranks <= 32) {  // one round: a rank per lane
    const uint32_t ranks = uint32_t(warp_ballot(t >= 0 && lane < c.num_ranks && row[lane]));
    const uint32_t bits = lane < Nn ? ranks >> (lane * L) & ((1u << L) - 1) : 0;
    const uint32_t nodes = uint32_t(warp_ballot(lane < Nn && lane != me && bits != 0));
    if (lane < Nn) tp.node_bits[warp][lane] = uint8_t(bits);
    warp_sync();
    if (lane == 0) {
      words[0] = (ranks >> (me * L) & ((1u << L) - 1)) | nodes << L;
      words[1] = nodes >> (32 - L);  // (L >= 1)
    }
    return;
  }
  for (int k = 0; k * 32 < Nn; ++k) {
    const int n = k * 32 + lane;
    uint32_t bits = 0;
    if (t >= 0 && lane < 32 && n < Nn)
      for (int l = 0; l < L; ++l) bits |= uint32_t(row[n * L + l]) << l;
    if (lane < 32 && n < Nn) tp.node_bits[warp][n] = uint8_t(bits);
    const uint32_t nodes = uint32_t(warp_ballot(lane < 32 && n < Nn && n != me && bits != 0));
    warp_sync();
    if (lane == 0) {  // peers L + 32k .. L + 32k + 31
      const int p = L + k * 32;
      words[p / 32] |= nodes << (p % 32);
      if (p % 32) words[p / 32 + 1] |= nodes >> (32 - p % 32);
    }
  }
  warp_sync();
  if (lane == 0) words[0] |= tp.node_bits[warp][me];  // this node's ranks: peers 0 .. L - 1
}
// The node of the rank at peer index p (its rows' node mask is that node's).
PORTEP_DEVICE int peer_node(const HTCommon& c, int p) {
  return p < c.ranks_per_node ? node_of(c, c.rank) : p - c.ranks_per_node;
}

// ---- forwarding (ht_api.h) ----
// Of a forwarder's batch masks (a bit per local rank), how many of the first n have bit `bit` set.
PORTEP_DEVICE uint32_t rows_with_bit(const uint32_t* masks, int n, int bit) {
  uint32_t k = 0;
  for (int w = 0; w < n; ++w) k += masks[w] >> bit & 1;
  return k;
}
// Forward tail (writer) and head (reader) words, as tail_word / head_word, by local index.
PORTEP_DEVICE uint64_t* fwd_tail_word(const HTCommon& c, uint8_t* region, bool combine, int writer, int ch) {
  return control_word(c, region, c.ctrl.fwd_tails, c.ctrl.fwd_half_bytes, combine, local_of(c, writer), ch);
}
PORTEP_DEVICE uint64_t* fwd_head_word(const HTCommon& c, uint8_t* region, bool combine, int reader, int ch) {
  return control_word(c, region, c.ctrl.fwd_heads, c.ctrl.fwd_half_bytes, combine, local_of(c, reader), ch);
}
// Rows from node n's served source (fwd prefixes of a handle) in channel ch, and where the first sits among the
// rows this rank forwards (those of other nodes, nodes ascending, channels ascending).
PORTEP_DEVICE uint32_t served_rows(const HTCommon& c, const int32_t* fwd_channel_prefix, const int32_t* fwd_rank_prefix,
                                   int n, int ch) {
  const int C = c.num_channels;
  const int32_t total = fwd_rank_prefix[n] - (n > 0 ? fwd_rank_prefix[n - 1] : 0);
  const int32_t end = ch + 1 < C ? fwd_channel_prefix[n * C + ch + 1] : total;
  return uint32_t(end - fwd_channel_prefix[n * C + ch]);
}
PORTEP_DEVICE int64_t served_row0(const HTCommon& c, const int32_t* fwd_channel_prefix, const int32_t* fwd_rank_prefix,
                                  int n, int ch) {
  const int me = node_of(c, c.rank);
  const int64_t own = fwd_rank_prefix[me] - (me > 0 ? fwd_rank_prefix[me - 1] : 0);
  return (n > 0 ? fwd_rank_prefix[n - 1] : 0) - (me < n ? own : 0) + fwd_channel_prefix[n * c.num_channels + ch];
}

// ---- prefix sums of a handle ----
// recv_prefix[s * stride]: rows from sources 0..s to this rank (inclusive).
PORTEP_DEVICE int64_t rows_before(const int32_t* recv_prefix, int stride, int s) {
  return s > 0 ? recv_prefix[(s - 1) * stride] : 0;
}
PORTEP_DEVICE int64_t rows_from(const int32_t* recv_prefix, int stride, int s) {
  return recv_prefix[s * stride] - rows_before(recv_prefix, stride, s);
}
// channel_prefix [R][C] inclusive over channels: this rank's tokens to d before channel ch.
PORTEP_DEVICE int64_t sent_before_channel(const int32_t* channel_prefix, int C, int d, int ch) {
  return ch > 0 ? channel_prefix[d * C + ch - 1] : 0;
}
// recv_channel_prefix [R][C] exclusive over channels: where source s's rows of channel ch end in its block (they
// begin at recv_channel_prefix[s * C + ch]).
PORTEP_DEVICE int64_t received_end(const int32_t* recv_channel_prefix, const int32_t* recv_prefix, int stride, int C,
                                   int s, int ch) {
  return ch + 1 < C ? recv_channel_prefix[s * C + ch + 1] : rows_from(recv_prefix, stride, s);
}
// Rows of source s in channel ch to this rank (a: the op's HTDispatchArgs or HTCombineArgs).
template <class Args>
PORTEP_DEVICE uint32_t rows_from_source(const Args& a, int s, int ch) {
  const int C = a.c.num_channels;
  const int64_t end = received_end(a.recv_channel_prefix, a.recv_prefix, a.recv_prefix_stride, C, s, ch);
  return uint32_t(end - a.recv_channel_prefix[s * C + ch]);
}

// ---- waits ----
// The peer watch says src will not answer (peer_status.h).
PORTEP_DEVICE bool peer_down(const HTCommon& c, int src) {
  return c.peer_status && *reinterpret_cast<const volatile uint32_t*>(c.peer_status + src) != 0;
}

// A wait on src ended short (end): the op fails (the normal mode has no shrink mode). kWaitCallFailed: a failure
// reported elsewhere, already recorded.
PORTEP_DEVICE void report_lost(const HTCommon& c, int src, uint32_t end, uint32_t index) {
  if (end == kWaitPeerDown)
    report_error(c, kErrPeerDown, uint32_t(c.rank), uint32_t(src),
                 *reinterpret_cast<const volatile uint32_t*>(c.peer_status + src));  // (set: peer_down said so)
  else if (end == kWaitTimedOut)
    report_error(c, kErrWaitTimeout, uint32_t(c.rank), uint32_t(src), index);
}

// For a block that serves several rings and has gone idle_ns without progress, src the peer its first open ring
// waits on: kWaitDone while it may go on waiting, else why the op ends (for report_lost), as wait_until decides.
PORTEP_DEVICE uint32_t idle_wait_end(const HTCommon& c, uint64_t idle_ns, int src) {
  if (idle_ns > c.timeout_ns) return kWaitTimedOut;
  if (reported_error(c)) return kWaitCallFailed;
  if (idle_ns > kPeerGraceNs && peer_down(c, src)) return kWaitPeerDown;
  return kWaitDone;
}

// Waits until a word a direct peer stores (a notify flag, a tail) reaches `want`; false when the wait ended short
// (reported as a wait on src, with index).
PORTEP_DEVICE bool await_word(const HTCommon& c, const uint64_t* word, uint64_t want, int src, uint32_t index) {
  uint64_t v = 0, waited = 0;
  const uint32_t end = wait_until([&] { return ld_acquire_sys_u64(word); }, [&](uint64_t x) { return x >= want; },
                                  limits_for(c, src), &v, &waited);
  if (end != kWaitDone) report_lost(c, src, end, index);
  return end == kWaitDone;
}
// The tail word reaches (epoch, rows).
PORTEP_DEVICE bool await_tail(const HTCommon& c, const uint64_t* word, uint64_t epoch, uint32_t rows, int src, int ch) {
  return await_word(c, word, ht_word_value(epoch, rows), src, uint32_t(ch));
}

// Publishes `rows` stores of this block to dst's tail word: the block's stores before the barrier are visible
// system-wide before the tail (fence after the barrier, then a plain store). Called by one thread.
PORTEP_DEVICE void publish_tail(uint64_t* word, uint64_t epoch, uint32_t rows) {
  fence_sys();
  st_relaxed_sys_u64(word, ht_word_value(epoch, rows));
}

// A kernel failed earlier (this op's notify included): the Buffer's results are invalid and the offsets this op
// would store at may be garbage, so data kernels do nothing; the host raises the failure at the next call. Notices
// (more rows than num_worst_tokens) do not stop them: the counts are sound, the rows past the outputs are dropped,
// and the data kernel still runs so that its peers' rings drain (else they would wait out their timeouts).
// The notify kernel, first in every op, decides once at its end and leaves the verdict in c.epoch[1] for the data
// kernel, whose every thread reads it (device memory: each warp reading the host-mapped error code instead cost
// about 0.6 us per warp, served one at a time across PCIe: 2 ms per op at 64 SMs, seen with
// python -m portep_bench gpu-ht-loopback).
// A failure that a kernel on another stream reports after that verdict makes this op's waits give up (wait_until):
// the Buffer is failed, and its next call raises on this rank.
PORTEP_DEVICE bool error_stops_data(const HTCommon& c) { return reported_error(c) != 0; }
PORTEP_DEVICE bool failed_before(const HTCommon& c) { return c.epoch[1] != 0; }

// Block-wide: rows [first, end) of a [rows][row_bytes] output (row_bytes a multiple of 4; of 16 for 16-byte stores),
// clamped to [0, rows), poisoned (ll_common.cuh: a failed op's outputs are NaN where it could not complete them,
// docs/design.md §7).
PORTEP_DEVICE void poison_rows(void* base, int64_t first, int64_t end, int64_t rows, int64_t row_bytes) {
  first = first < 0 ? 0 : first;
  end = end > rows ? rows : end;
  if (first >= end) return;
  uint8_t* at = static_cast<uint8_t*>(base) + first * row_bytes;
  const uint64_t bytes = uint64_t(end - first) * uint64_t(row_bytes);
  if (row_bytes % 16 == 0)
    block_poison16(at, bytes / 16);
  else
    block_poison4(at, bytes / 4);
}

// ---- the proxy path ----

// The FIFO side of LLCommon, so the HT kernels push commands as the LL kernels do.
PORTEP_DEVICE LLCommon fifo_side(const HTCommon& c) {
  LLCommon f{};
  f.rank = c.rank;
  f.place = c.place;
  f.fifos = c.fifos;
  f.fifo_tails = c.fifo_tails;
  f.num_fifos = c.num_fifos;
  f.error = c.error;
  f.failed = c.failed;
  f.timeout_ns = c.timeout_ns;
  return f;
}

// Units (WRITEs) of src's stream in place since this rank last consumed them, waiting until there are at least
// `need`; -1 after the timeout (reported). One thread.
PORTEP_DEVICE int64_t await_units(const HTCommon& c, int src, uint32_t stream, uint32_t need) {
  const uint64_t i = uint64_t(src) * c.num_streams + stream;
  const uint32_t seen = uint32_t(c.signal_seen[i]);
  uint64_t v = 0, waited = 0;
  const uint32_t end =
      wait_until([&] { return ld_acquire_sys_u64(c.host_signals + i); },
                 [&](uint64_t x) { return uint32_t(x) - seen >= need; }, limits_for(c, src), &v, &waited, kProxyPollNs);
  if (end == kWaitDone) return uint32_t(v) - seen;
  report_lost(c, src, end, stream);
  return -1;
}
// This op consumed n units of src's stream. One thread, after the last await_units of the op on that stream. Nothing
// for n = 0: a block that took no units of a stream must not touch its word, which another block of the op may be
// adding to (the add is a plain read-modify-write: even an add of 0 could store back a value read before the other's).
PORTEP_DEVICE void consume_units(const HTCommon& c, int src, uint32_t stream, uint32_t n) {
  if (n) c.signal_seen[uint64_t(src) * c.num_streams + stream] += n;
}
PORTEP_DEVICE uint32_t chunks(int64_t rows) { return uint32_t((rows + kHTChunkRows - 1) / kHTChunkRows); }

// Where row slot `slot` of this rank's ring at proxy peer d is stored: in d's receive area when placed (c.place[d]),
// else in this rank's staging ring for d. stage_ring / remote_ring: the ring's offsets in the staging and receive
// areas.
PORTEP_DEVICE uint8_t* proxy_ring_slot(const HTCommon& c, int d, uint64_t stage_ring, uint64_t remote_ring,
                                       uint64_t slot) {
  return c.place[d] ? c.place[d] + c.recv_off + remote_ring + slot : c.local + c.stage_off + stage_ring + slot;
}

// Rows [*flushed, ready) staged for proxy peer d go out as WRITEs of kHTChunkRows rows (with last: the short rest
// too), then one SIGNAL if any WRITE went. stage_ring / remote_ring: the ring's offsets in this rank's staging
// area and in d's receive area. The caller fenced at system scope after the rows were staged. One thread.
// false: a push failed (reported).
PORTEP_DEVICE bool flush_rows(const HTCommon& c, int d, uint32_t stream, uint64_t stage_ring, uint64_t remote_ring,
                              uint32_t row_bytes, uint32_t ring_rows, uint32_t* flushed, uint32_t ready, bool last) {
  const LLCommon f = fifo_side(c);
  bool pushed = false;
  while (*flushed < ready && (ready - *flushed >= uint32_t(kHTChunkRows) || last)) {
    const uint32_t n = min(ready - *flushed, uint32_t(kHTChunkRows));
    const uint64_t slot = ht_ring_slot(*flushed, ring_rows, row_bytes);  // n rows from here never wrap
    const uint64_t remote = c.recv_off + remote_ring + slot, local = c.stage_off + stage_ring + slot;
    if (!push_cmd(f, CmdFields{kOpWrite, write_flags(f, d), uint32_t(d), n * row_bytes, stream, remote, local}))
      return false;
    *flushed += n;
    pushed = true;
  }
  return !pushed || push_cmd(f, CmdFields{kOpSignal, 0, uint32_t(d), 0, stream, 0, 0});
}

// ---- ring flow control ----
// Waits until reader d consumed enough of this rank's ring (d, ch) for rows up to `end` (exclusive) to fit;
// false after the timeout (reported). One thread.
PORTEP_DEVICE bool await_room(const HTCommon& c, bool combine, int d, int ch, uint64_t epoch, uint32_t end,
                              uint32_t ring_rows) {
  if (end <= ring_rows) return true;
  const uint32_t need = end - ring_rows;
  if (c.peers[d]) return await_word(c, head_word(c, c.local, combine, d, ch), ht_word_value(epoch, need), d, ch);
  return await_units(c, d, ht_credit_stream(c, combine, ch), chunks(need)) >= 0;
}

// The same for forward ring (d, ch) of this rank (a writer into d's forward rings).
PORTEP_DEVICE bool await_fwd_room(const HTCommon& c, bool combine, int d, int ch, uint64_t epoch, uint32_t end,
                                  uint32_t ring_rows) {
  if (end <= ring_rows) return true;
  return await_word(c, fwd_head_word(c, c.local, combine, d, ch), ht_word_value(epoch, end - ring_rows), d, ch);
}

// The reader tells source s it consumed `consumed` rows of ring (s, ch): a head word stored into s's control area
// (direct), or the credits for the whole chunks consumed since *credited (proxy). One thread, after the block's
// loads of those rows completed (a barrier after the loads' values were used).
PORTEP_DEVICE void return_rows(const HTCommon& c, bool combine, int s, int ch, uint64_t epoch, uint32_t consumed,
                               uint32_t* credited) {
  if (c.peers[s]) {
    st_relaxed_sys_u64(head_word(c, c.peers[s], combine, c.rank, ch), ht_word_value(epoch, consumed));
    return;
  }
  const uint32_t due = consumed / kHTChunkRows;
  if (due == *credited) return;
  const LLCommon f = fifo_side(c);
  const uint32_t stream = ht_credit_stream(c, combine, ch);
  const uint64_t scratch = c.ctrl_off + c.ctrl.scratch;
  for (; *credited < due; ++*credited)
    if (!push_cmd(f, CmdFields{kOpWrite, write_flags(f, s), uint32_t(s), uint32_t(kHTScratchBytes), stream, scratch,
                               scratch}))
      return;
  push_cmd(f, CmdFields{kOpSignal, 0, uint32_t(s), 0, stream, 0, 0});
}

// At the end of a sender's op: proxy reader d credits every whole chunk of the `rows` it was sent; they are
// consumed here, so the next op starts from zero. One thread.
PORTEP_DEVICE void collect_credits(const HTCommon& c, bool combine, int d, int ch, uint32_t rows) {
  const uint32_t n = rows / kHTChunkRows;
  if (c.peers[d] || d == c.rank || n == 0) return;
  if (await_units(c, d, ht_credit_stream(c, combine, ch), n) >= 0)
    consume_units(c, d, ht_credit_stream(c, combine, ch), n);
}

}  // namespace portep::cuda
