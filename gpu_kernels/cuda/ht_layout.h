// The byte layout of the normal-mode (HT) kernels' memory: every offset and size that the kernels (ht_common.cuh,
// ht_*.cu) and the host (bind_cuda_ht.cpp, and through its HTLayout backends/cuda/ht.py) use is computed here and
// nowhere else. What the protocol puts in these places, and when: ht_api.h. Plain C++, host and device.
//
// One rank's data region (offsets the same on every rank):
//   [ctrl_off, + ht_ctrl(R, L).bytes)  control area (table below), its size a function of the ranks R and the ranks
//                                      per node L
//   [area_off, + area_bytes)           the normal-mode area: all of it the receive area when every peer is direct;
//                                      with some peer reached through the proxies the receive area is its first half
//                                      (rounded down to kHTAlign) and the staging area the rest (ht_areas)
//
// Peers. A rank exchanges rows with the ranks of its node (direct stores, or the proxies between simulated nodes)
// and with the rank of its own local index on every other node (through the proxies); nothing else. Seen from a
// rank of node m, rank r has the peer index ht_peer_slot: local_of(r) on node m, else L + node_of(r); so a rank
// has L + Nn peer indices (Nn = R / L nodes), itself at two of them (its local index, and L + m). With L = 1 (one
// GPU per node) every rank is a peer through the second kind, with Nn = 1 (one node) through the first, and with
// several nodes of several GPUs each (forwarding, ht_api.h) rows of other nodes travel through those peers only.
// Every per-peer table below has L + Nn entries: at most kHTMaxPeers, never R.
//
// Control area, offsets from ctrl_off (HTCtrl, from ht_ctrl(R, L)):
//   slots      notify slots [2 epoch parities][R source] x kHTSlotBytes (what each source sent here)
//   tails      tails [2: dispatch, combine][L + Nn source peer][kHTMaxChannels] uint64: rows arrived
//   outgoing   outgoing slots [2 epoch parities][R destination] x kHTSlotBytes (what a proxy WRITE carries to that
//              destination's slot)
//   heads      heads [2][L + Nn reader peer][kHTMaxChannels] uint64: rows of this rank's ring at the reader consumed
//   fwd_tails  forward tails [2][L writer local index][kHTMaxChannels] uint64
//   fwd_heads  forward heads [2][L reader local index][kHTMaxChannels] uint64
//   scratch    16 bytes: source and target of the credit WRITEs
//   bytes      the end
// A tail or head word is epoch << 32 | rows (ht_word_value).
//
// Notify slot, offsets from the slot (kHTSlotBytes, a multiple of kHTAlign):
//   kHTSlotFlagOff          uint64 flag: the op's epoch
//   kHTSlotCountsOff        int32 [kHTMaxNodeRanks]: one node only (R <= kHTMaxNodeRanks): the source's tokens per
//                           destination rank (DeepEP's intranode handle holds the whole [R][R] matrix)
//   kHTSlotChannelsOff      int32 [kHTMaxChannels]: its tokens per channel for this rank
//   kHTSlotNodeChannelsOff  int32 [kHTMaxChannels]: its tokens per channel for this rank's node
//   kHTSlotExpertsOff       int32 [kHTMaxLocalExperts]: its selections of this rank's experts
//
// Receive area, offsets from recv_off, for an op of C channels whose ring rows are row_bytes each:
//   rings [L - 1 + Nn - 1: the holder's peers, ht_ring_index][C] x ring_rows rows (ht_ring_offset), then with
//   forwarding forward rings [L: the other party's local index][C] x ring_rows rows (ht_fwd_ring_offset);
//   ring_rows: the whole chunks of kHTChunkRows rows that each of the ht_num_rings rings gets (ht_rows_per_ring).
// Staging area, offsets from stage_off: the same rings, one per destination (proxy peers only).
// Memory of one rank for C channels, rows of B bytes, Q rows per ring: ht_ctrl(R, L).bytes +
// (L - 1 + Nn - 1 + (forwarding ? L : 0)) * C * Q * B * (proxy peers ? 2 : 1) (docs/api.md, "Memory").
//
// Dispatch row (ht_dispatch_row), offsets from the row:
//   0                  int32 [4] header: kHTRowToken (source token), kHTRowNodeMask (its destinations on the
//                      receiver's node, a bit per local rank), kHTRowSource (source rank), kHTRowIndex (forwarded
//                      rows: the index among the source's rows of the channel to the receiver)
//   kHTRowHeaderBytes  x: row_bytes
//   scales             float32 [S] (4-byte scales)
//   topk               int64 [K] top-k ids, from an 8-byte boundary
//   weights            float32 [K] top-k weights
//   bytes              the end, rounded up to kHTAlign
// Combine row (ht_combine_row_bytes): a contribution [BF16 H][f32 K] rounded up to kHTAlign; with forwarding a
//   partial [f32 H][f32 K] rounded up to kHTAlign, and every combine ring row has the partial's size (BF16 rows
//   use its start).
//
// Signal streams (proxy path), from stream_base: notify at 0; dispatch data of channel c at 1 + c; combine data
// at 1 + kHTMaxChannels + c; dispatch credits at 1 + 2 * kHTMaxChannels + c; combine credits at
// 1 + 3 * kHTMaxChannels + c; kHTNumStreams in all.
#pragma once

#include <stdint.h>

#include "proxy/transfer_cmd.h"  // PORTEP_HD, kMaxCmdBytes

namespace portep::cuda {

constexpr int kHTMaxNodeRanks = 8;  // ranks per node (L): one NVLink domain
constexpr int kHTMaxNodes = 128;    // nodes (Nn = R / L)
constexpr int kHTMaxRanks = kHTMaxNodeRanks * kHTMaxNodes;
constexpr int kHTMaxPeers = kHTMaxNodeRanks + kHTMaxNodes;  // peer indices of a rank: L + Nn
constexpr int kHTMaxChannels = 64;
constexpr int kHTMaxLocalExperts = 1024;
constexpr int kHTChunkRows = 32;                  // rows per proxy WRITE
constexpr int kHTMinRingRows = 2 * kHTChunkRows;  // a proxy reader credits whole chunks only
constexpr uint32_t kHTMaxRingRows = 1u << 30;     // rows counts are 32-bit words in the kernels
constexpr int kHTNvlHeadColumns = 8;              // of HTDispatchArgs::nvl_head (DeepEP's send_nvl_head width)
constexpr uint64_t kHTAlign = 16;  // every area, slot and row: proxy commands carry offsets / 16, kernels copy 16 B

// ---- notify slot ----
constexpr uint64_t kHTSlotFlagOff = 0;
constexpr uint64_t kHTSlotCountsOff = kHTSlotFlagOff + 8;
constexpr uint64_t kHTSlotChannelsOff = kHTSlotCountsOff + 4 * kHTMaxNodeRanks;
constexpr uint64_t kHTSlotNodeChannelsOff = kHTSlotChannelsOff + 4 * kHTMaxChannels;
constexpr uint64_t kHTSlotExpertsOff = kHTSlotNodeChannelsOff + 4 * kHTMaxChannels;
constexpr uint64_t kHTSlotBytes = (kHTSlotExpertsOff + 4 * kHTMaxLocalExperts + kHTAlign - 1) / kHTAlign * kHTAlign;

// ---- peers (the table at the top) ----
// The peer index of rank r seen from a rank of node `viewer_node`.
PORTEP_HD constexpr int ht_peer_slot(int ranks_per_node, int viewer_node, int r) {
  return r / ranks_per_node == viewer_node ? r % ranks_per_node : ranks_per_node + r / ranks_per_node;
}
// The rank at peer index p of rank `me`.
PORTEP_HD constexpr int ht_peer_rank(int ranks_per_node, int me, int p) {
  return p < ranks_per_node ? me / ranks_per_node * ranks_per_node + p
                            : (p - ranks_per_node) * ranks_per_node + me % ranks_per_node;
}
// Whether peer index p of rank `me` is `me` itself.
PORTEP_HD constexpr bool ht_peer_is_self(int ranks_per_node, int me, int p) {
  return p == me % ranks_per_node || p == ranks_per_node + me / ranks_per_node;
}

// ---- control area ----
struct HTCtrl {  // offsets from ctrl_off
  uint64_t slots, tails, outgoing, heads, fwd_tails, fwd_heads, scratch, bytes;
  uint64_t slot_table_bytes;  // [2 parities][R] slots
  uint64_t word_half_bytes;   // one op's half of tails or heads: [L + Nn][kHTMaxChannels] uint64
  uint64_t fwd_half_bytes;    // one op's half of forward tails or heads: [L][kHTMaxChannels] uint64
  int num_ranks;
};
constexpr uint64_t kHTScratchBytes = 16;  // one credit WRITE
PORTEP_HD constexpr HTCtrl ht_ctrl(int num_ranks, int ranks_per_node) {
  HTCtrl t{};
  t.num_ranks = num_ranks;
  t.slot_table_bytes = 2ull * uint64_t(num_ranks) * kHTSlotBytes;
  t.word_half_bytes = 8ull * uint64_t(ranks_per_node + num_ranks / ranks_per_node) * kHTMaxChannels;
  t.fwd_half_bytes = 8ull * uint64_t(ranks_per_node) * kHTMaxChannels;
  t.slots = 0;
  t.tails = t.slots + t.slot_table_bytes;
  t.outgoing = t.tails + 2 * t.word_half_bytes;
  t.heads = t.outgoing + t.slot_table_bytes;
  t.fwd_tails = t.heads + 2 * t.word_half_bytes;
  t.fwd_heads = t.fwd_tails + 2 * t.fwd_half_bytes;
  t.scratch = t.fwd_heads + 2 * t.fwd_half_bytes;
  t.bytes = t.scratch + kHTScratchBytes;
  return t;
}

// Slots alternate by the parity of the op's epoch (ht_common.cuh says why).
PORTEP_HD constexpr uint64_t ht_slot_off(const HTCtrl& t, uint64_t epoch, int rank) {
  return t.slots + ((epoch & 1) * uint64_t(t.num_ranks) + uint64_t(rank)) * kHTSlotBytes;
}
// The outgoing slot for destination `rank`.
PORTEP_HD constexpr uint64_t ht_outgoing_off(const HTCtrl& t, uint64_t epoch, int rank) {
  return t.outgoing + ((epoch & 1) * uint64_t(t.num_ranks) + uint64_t(rank)) * kHTSlotBytes;
}
// A word table (tails, heads, fwd_tails, fwd_heads): its half for the op, and in that half (at `half` in memory)
// the word of (peer index or local index, ch).
PORTEP_HD constexpr uint64_t ht_word_half(uint64_t table, uint64_t half_bytes, bool combine) {
  return table + (combine ? half_bytes : 0);
}
PORTEP_HD uint64_t* ht_word(uint8_t* half, int index, int ch) {
  return reinterpret_cast<uint64_t*>(half) + index * kHTMaxChannels + ch;
}
PORTEP_HD constexpr uint64_t ht_word_value(uint64_t epoch, uint32_t rows) { return epoch << 32 | rows; }

// ---- functions of an op's geometry ----
// They read it from `g`: HTCommon in the kernels, HTGeometry on the host (the same member names), so the kernels
// and the host compute the same expressions.
struct HTGeometry {
  int num_ranks, ranks_per_node, num_channels;
  uint32_t stream_base;
};
template <class G>
PORTEP_HD constexpr bool ht_forwarding(const G& g) {
  return g.ranks_per_node > 1 && g.ranks_per_node < g.num_ranks;
}
template <class G>
PORTEP_HD constexpr int ht_num_peers(const G& g) {  // peer indices: L + Nn
  return g.ranks_per_node + g.num_ranks / g.ranks_per_node;
}
// Blocks per channel of the data kernels: sender and receiver (or reducer), and a forwarder with forwarding.
template <class G>
PORTEP_HD constexpr int ht_blocks_per_channel(const G& g) {
  return ht_forwarding(g) ? 3 : 2;
}

// ---- receive and staging areas ----
struct HTAreas {
  uint64_t recv_off, recv_bytes, stage_off, stage_bytes;
};
PORTEP_HD constexpr HTAreas ht_areas(uint64_t area_off, uint64_t area_bytes, bool proxy) {
  const uint64_t recv = proxy ? area_bytes / 2 / kHTAlign * kHTAlign : area_bytes;
  return HTAreas{area_off, recv, area_off + recv, area_bytes - recv};
}
// Rings per channel for the holder's peers (all but itself): L - 1 of its node, Nn - 1 of other nodes.
template <class G>
PORTEP_HD constexpr int ht_peer_rings(const G& g) {
  return g.ranks_per_node - 1 + g.num_ranks / g.ranks_per_node - 1;
}
// Which of those rings `holder` keeps for peer `other`: node peers by local index, then other nodes' peers by node.
template <class G>
PORTEP_HD constexpr int ht_ring_index(const G& g, int holder, int other) {
  const int L = g.ranks_per_node, hn = holder / L, on = other / L, hl = holder % L, ol = other % L;
  return on == hn ? (ol < hl ? ol : ol - 1) : L - 1 + (on < hn ? on : on - 1);
}
// The ring `holder` keeps for `other` in channel ch (receive area; staging area: the holder's ring for other).
template <class G>
PORTEP_HD constexpr uint64_t ht_ring_offset(const G& g, int holder, int other, int ch, uint32_t ring_rows,
                                            uint32_t row_bytes) {
  return (uint64_t(ht_ring_index(g, holder, other)) * g.num_channels + ch) * ring_rows * row_bytes;
}
// The forward ring a holder keeps for the other party of local index other_local in channel ch (receive area).
template <class G>
PORTEP_HD constexpr uint64_t ht_fwd_ring_offset(const G& g, int other_local, int ch, uint32_t ring_rows,
                                                uint32_t row_bytes) {
  return (uint64_t(ht_peer_rings(g) + other_local) * g.num_channels + ch) * ring_rows * row_bytes;
}
PORTEP_HD constexpr uint64_t ht_ring_slot(uint32_t i, uint32_t ring_rows, uint32_t row_bytes) {
  return uint64_t(i % ring_rows) * row_bytes;
}
template <class G>
PORTEP_HD constexpr uint64_t ht_num_rings(const G& g) {
  return uint64_t(ht_peer_rings(g) + (ht_forwarding(g) ? g.ranks_per_node : 0)) * g.num_channels;
}
// Rows per ring for rows of row_bytes: whole chunks, as many as recv_bytes holds for each of `rings` rings (one
// rank alone has no rings: the least valid count).
PORTEP_HD constexpr uint32_t ht_rows_per_ring(uint64_t recv_bytes, uint64_t rings, uint32_t row_bytes) {
  if (rings == 0) return kHTMinRingRows;
  const uint64_t rows = recv_bytes / (rings * row_bytes) / kHTChunkRows * kHTChunkRows;
  return rows < kHTMaxRingRows ? uint32_t(rows) : kHTMaxRingRows;
}
PORTEP_HD constexpr bool ht_ring_rows_valid(uint32_t ring_rows) {
  return ring_rows >= uint32_t(kHTMinRingRows) && ring_rows % kHTChunkRows == 0 && ring_rows <= kHTMaxRingRows;
}
// The normal-mode area that gives each of `rings` rings ring_rows rows of row_bytes.
PORTEP_HD constexpr uint64_t ht_area_bytes_for(uint64_t rings, uint32_t ring_rows, uint32_t row_bytes, bool proxy) {
  return rings * ring_rows * row_bytes * (proxy ? 2 : 1);
}

// One rank's normal-mode memory as the host lays it out (bind_cuda_ht.cpp checks it and exports it to Python).
struct HTLayout {
  int num_ranks, ranks_per_node;
  bool proxy;  // some peer is reached through the proxies: the area holds a staging area too
  uint64_t ctrl_off, area_off, area_bytes;

  constexpr HTGeometry geometry(int num_channels) const {
    return HTGeometry{num_ranks, ranks_per_node, num_channels, 0};
  }
  constexpr HTAreas areas() const { return ht_areas(area_off, area_bytes, proxy); }
  constexpr HTCtrl ctrl() const { return ht_ctrl(num_ranks, ranks_per_node); }
  constexpr bool forwarding() const { return ht_forwarding(geometry(0)); }
  constexpr uint64_t rings(int num_channels) const { return ht_num_rings(geometry(num_channels)); }
  constexpr uint32_t rows_per_ring(uint32_t row_bytes, int num_channels) const {
    return ht_rows_per_ring(areas().recv_bytes, rings(num_channels), row_bytes);
  }
  constexpr uint64_t area_bytes_for(uint32_t ring_rows, uint32_t row_bytes, int num_channels) const {
    return ht_area_bytes_for(rings(num_channels), ring_rows, row_bytes, proxy);
  }
};

// ---- ring rows ----
// A dispatch row's shape is read from `s` (HTDispatchArgs in the kernels, HTRowShape on the host): row_bytes (x),
// num_scales (S), num_topk (K); a combine row's from hidden (H) and num_topk.
struct HTRowShape {
  int row_bytes, num_scales, num_topk, hidden;
};
constexpr int kHTRowHeaderBytes = 16;
constexpr int kHTRowToken = 0, kHTRowNodeMask = 1, kHTRowSource = 2, kHTRowIndex = 3;  // int32 words of the header

struct HTDispatchRow {  // byte offsets in one dispatch ring row, and its size
  int scales, topk, weights, bytes;
};
template <class S>
PORTEP_HD constexpr HTDispatchRow ht_dispatch_row(const S& s) {
  HTDispatchRow r{};
  r.scales = kHTRowHeaderBytes + s.row_bytes;
  r.topk = (r.scales + 4 * s.num_scales + 7) / 8 * 8;  // int64 ids: 8-byte aligned whatever the scale count
  r.weights = r.topk + 8 * s.num_topk;
  r.bytes = (r.weights + 4 * s.num_topk + 15) / 16 * 16;
  return r;
}
// A combine row: [values][f32 weights] rounded up to 16 bytes, the values BF16 (a contribution) or FP32 (a partial).
PORTEP_HD constexpr int ht_combine_weights(bool partial, int hidden) { return (partial ? 4 : 2) * hidden; }
template <class S>
PORTEP_HD constexpr int ht_contribution_bytes(const S& s) {
  return (2 * s.hidden + 4 * s.num_topk + 15) / 16 * 16;
}
template <class S>
PORTEP_HD constexpr int ht_partial_bytes(const S& s) {
  return (4 * s.hidden + 4 * s.num_topk + 15) / 16 * 16;
}
// Row stride of every combine ring: with forwarding, partial rows travel in them too.
template <class S>
PORTEP_HD constexpr uint32_t ht_combine_row_bytes(bool forwarding, const S& s) {
  return uint32_t(forwarding ? ht_partial_bytes(s) : ht_contribution_bytes(s));
}
// Bytes of one proxy WRITE of whole chunks (at most kMaxCmdBytes).
PORTEP_HD constexpr uint64_t ht_chunk_bytes(uint32_t row_bytes) { return uint64_t(kHTChunkRows) * row_bytes; }

// ---- signal streams, from g.stream_base ----
constexpr uint32_t kHTNumStreams = 1 + 4 * kHTMaxChannels;
template <class G>
PORTEP_HD constexpr uint32_t ht_notify_stream(const G& g) {
  return g.stream_base;
}
template <class G>
PORTEP_HD constexpr uint32_t ht_data_stream(const G& g, bool combine, int ch) {
  return g.stream_base + 1 + (combine ? kHTMaxChannels : 0) + uint32_t(ch);
}
template <class G>
PORTEP_HD constexpr uint32_t ht_credit_stream(const G& g, bool combine, int ch) {
  return g.stream_base + 1 + (combine ? 3 : 2) * kHTMaxChannels + uint32_t(ch);
}

// ---- invariants ----
static_assert(kHTSlotBytes % kHTAlign == 0 && kHTSlotExpertsOff + 4 * kHTMaxLocalExperts <= kHTSlotBytes,
              "a slot holds its fields and keeps the next slot's flag 8-byte aligned, its WRITE 16-byte aligned");
static_assert(kHTSlotBytes <= kMaxCmdBytes, "a notify slot travels in one proxy WRITE");
constexpr HTCtrl kHTLargestCtrl = ht_ctrl(kHTMaxRanks, kHTMaxNodeRanks);
static_assert(kHTLargestCtrl.tails % kHTAlign == 0 && kHTLargestCtrl.outgoing % kHTAlign == 0 &&
                  kHTLargestCtrl.heads % kHTAlign == 0 && kHTLargestCtrl.fwd_tails % kHTAlign == 0 &&
                  kHTLargestCtrl.fwd_heads % kHTAlign == 0 && kHTLargestCtrl.scratch % kHTAlign == 0 &&
                  kHTLargestCtrl.bytes % kHTAlign == 0 && ht_ctrl(3, 1).bytes % kHTAlign == 0,
              "control words are 8-byte aligned, WRITE offsets 16-byte aligned, the area ends on a WRITE boundary");
static_assert(kHTLargestCtrl.bytes < (64ull << 20), "the largest control area (1024 ranks) stays under 64 MiB");
static_assert(ht_outgoing_off(kHTLargestCtrl, 3, kHTMaxRanks - 1) + kHTSlotBytes ==
                      kHTLargestCtrl.outgoing + kHTLargestCtrl.slot_table_bytes &&
                  ht_slot_off(kHTLargestCtrl, 3, kHTMaxRanks - 1) + kHTSlotBytes == kHTLargestCtrl.tails,
              "each slot table holds [2 parities][R] slots");
static_assert(ht_peer_slot(8, 2, 21) == 5 && ht_peer_slot(8, 2, 9) == 9 && ht_peer_rank(8, 21, 5) == 21 &&
                  ht_peer_rank(8, 21, 9) == 13 && ht_peer_is_self(8, 21, 5) && ht_peer_is_self(8, 21, 10) &&
                  !ht_peer_is_self(8, 21, 9) && ht_peer_slot(1, 3, 7) == 8 && ht_peer_rank(1, 3, 8) == 7,
              "peer indices: local ranks by local index, then other nodes by node (the same local index)");
static_assert(kHTMaxPeers == kHTMaxNodeRanks + kHTMaxNodes && kHTNvlHeadColumns >= kHTMaxNodeRanks &&
                  kHTMaxNodeRanks <= 8,
              "node masks are uint8 (a bit per local rank); nvl_head has a column per local rank");
static_assert(kHTMinRingRows % kHTChunkRows == 0 && kHTMaxRingRows % kHTChunkRows == 0,
              "rings hold whole chunks: a proxy WRITE never wraps");
constexpr HTGeometry kHTSampleGeometry{8, 4, 3, 0};  // 2 nodes of 4 ranks, 3 channels
static_assert(ht_dispatch_row(HTRowShape{14336, 0, 8, 0}).bytes == 14448 &&
                  ht_dispatch_row(HTRowShape{7168, 56, 0, 0}).topk % 8 == 0 &&
                  ht_dispatch_row(HTRowShape{7168, 57, 3, 0}).bytes % kHTAlign == 0,
              "dispatch rows: ids 8-byte aligned, rows whole 16-byte words");
static_assert(ht_combine_row_bytes(false, HTRowShape{0, 0, 0, 7168}) == 14336 &&
                  ht_combine_row_bytes(true, HTRowShape{0, 0, 8, 7168}) == 28704,
              "combine rows: contributions, and partials with forwarding");
static_assert(ht_ring_offset(kHTSampleGeometry, 0, 7, 2, 64, 32) + 64 * 32 ==
                      ht_fwd_ring_offset(kHTSampleGeometry, 0, 0, 64, 32) &&
                  ht_fwd_ring_offset(kHTSampleGeometry, 3, 2, 64, 32) + 64 * 32 ==
                      ht_num_rings(kHTSampleGeometry) * 64 * 32,
              "ht_num_rings counts the rings ht_ring_offset and ht_fwd_ring_offset place");
static_assert(ht_rows_per_ring(ht_area_bytes_for(ht_num_rings(kHTSampleGeometry), kHTMinRingRows, 1040, false),
                               ht_num_rings(kHTSampleGeometry), 1040) == kHTMinRingRows &&
                  ht_areas(0, ht_area_bytes_for(21, 96, 4112, true), true).recv_bytes == 21ull * 96 * 4112,
              "ht_area_bytes_for inverts ht_rows_per_ring, the staging half included");
static_assert(ht_credit_stream(HTGeometry{}, true, kHTMaxChannels - 1) + 1 == kHTNumStreams &&
                  ht_data_stream(HTGeometry{}, true, kHTMaxChannels - 1) + 1 ==
                      ht_credit_stream(HTGeometry{}, false, 0),
              "the streams of one Buffer's normal mode are kHTNumStreams consecutive numbers from stream_base");

}  // namespace portep::cuda
