// The byte layout of the normal-mode (HT) kernels' memory: every offset and size that the kernels (ht_common.cuh,
// ht_*.cu) and the host (bind_cuda_ht.cpp, and through its HTLayout backends/cuda/ht.py) use is computed here and
// nowhere else. What the protocol puts in these places, and when: ht_api.h. Plain C++, host and device.
//
// One rank's data region (offsets the same on every rank):
//   [ctrl_off, + kHTCtrlBytes)  control area (table below)
//   [area_off, + area_bytes)    the normal-mode area: all of it the receive area when every peer is direct; with
//                               some peer reached through the proxies the receive area is its first half (rounded
//                               down to kHTAlign) and the staging area the rest (ht_areas)
//
// Control area, offsets from ctrl_off:
//   kHTSlotsOff     notify slots [2 epoch parities][kHTMaxRanks source] x kHTSlotBytes (what each source sent here)
//   kHTTailsOff     tails [2: dispatch, combine][kHTMaxRanks source][kHTMaxChannels] uint64: rows arrived
//   kHTOutgoingOff  outgoing slots [2 epoch parities][kHTMaxRanks destination] x kHTSlotBytes (what a proxy WRITE
//                   carries to that destination's slot)
//   kHTHeadsOff     heads [2][kHTMaxRanks reader][kHTMaxChannels] uint64: rows of this rank's ring at the reader
//                   consumed
//   kHTFwdTailsOff  forward tails [2][kHTMaxRanks writer][kHTMaxChannels] uint64
//   kHTFwdHeadsOff  forward heads [2][kHTMaxRanks reader][kHTMaxChannels] uint64
//   kHTScratchOff   16 bytes: source and target of the credit WRITEs
//   kHTCtrlBytes    the end
// A tail or head word is epoch << 32 | rows (ht_word_value).
//
// Notify slot, offsets from the slot (kHTSlotBytes, a multiple of kHTAlign):
//   kHTSlotFlagOff          uint64 flag: the op's epoch
//   kHTSlotCountsOff        int32 [kHTMaxRanks]: the source's tokens per destination rank
//   kHTSlotChannelsOff      int32 [kHTMaxChannels]: its tokens per channel for this rank
//   kHTSlotNodeChannelsOff  int32 [kHTMaxChannels]: its tokens per channel for this rank's node
//   kHTSlotExpertsOff       int32 [kHTMaxLocalExperts]: its selections of this rank's experts
//
// Receive area, offsets from recv_off, for an op of C channels whose ring rows are row_bytes each:
//   rings [R - 1: the other ranks ascending, the holder left out][C] x ring_rows rows (ht_ring_offset), then with
//   forwarding forward rings [L: the other party's local index][C] x ring_rows rows (ht_fwd_ring_offset);
//   ring_rows: the whole chunks of kHTChunkRows rows that each of the ht_num_rings rings gets (ht_rows_per_ring).
// Staging area, offsets from stage_off: the same rings, one per destination (proxy peers only).
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

constexpr int kHTMaxRanks = 8;  // ranks in all: one NVLink domain, or nodes x ranks per node across nodes
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
constexpr uint64_t kHTSlotChannelsOff = kHTSlotCountsOff + 4 * kHTMaxRanks;
constexpr uint64_t kHTSlotNodeChannelsOff = kHTSlotChannelsOff + 4 * kHTMaxChannels;
constexpr uint64_t kHTSlotExpertsOff = kHTSlotNodeChannelsOff + 4 * kHTMaxChannels;
constexpr uint64_t kHTSlotBytes = (kHTSlotExpertsOff + 4 * kHTMaxLocalExperts + kHTAlign - 1) / kHTAlign * kHTAlign;

// ---- control area ----
constexpr uint64_t kHTSlotTableBytes = 2 * kHTMaxRanks * kHTSlotBytes;            // [2 parities][R] slots
constexpr uint64_t kHTWordTableBytes = 8ull * kHTMaxRanks * kHTMaxChannels;       // one op's [R][C] uint64 words
constexpr uint64_t kHTSlotsOff = 0;
constexpr uint64_t kHTTailsOff = kHTSlotsOff + kHTSlotTableBytes;
constexpr uint64_t kHTOutgoingOff = kHTTailsOff + 2 * kHTWordTableBytes;
constexpr uint64_t kHTHeadsOff = kHTOutgoingOff + kHTSlotTableBytes;
constexpr uint64_t kHTFwdTailsOff = kHTHeadsOff + 2 * kHTWordTableBytes;
constexpr uint64_t kHTFwdHeadsOff = kHTFwdTailsOff + 2 * kHTWordTableBytes;
constexpr uint64_t kHTScratchOff = kHTFwdHeadsOff + 2 * kHTWordTableBytes;
constexpr uint64_t kHTScratchBytes = 16;  // one credit WRITE
constexpr uint64_t kHTCtrlBytes = kHTScratchOff + kHTScratchBytes;

// Slots alternate by the parity of the op's epoch (ht_common.cuh says why).
PORTEP_HD constexpr uint64_t ht_slot_off(uint64_t epoch, int rank) {
  return kHTSlotsOff + ((epoch & 1) * kHTMaxRanks + rank) * kHTSlotBytes;
}
// The outgoing slot for `rank`, from `ctrl`: the control area's address, or 0 for the offset. Outgoing slots number
// on from the notify slots (2 * kHTMaxRanks on), past the tails that lie between.
template <class T>
PORTEP_HD constexpr T ht_outgoing_slot(T ctrl, uint64_t epoch, int rank) {
  return ctrl + (kHTOutgoingOff - kHTSlotTableBytes) + ((2 + (epoch & 1)) * kHTMaxRanks + rank) * kHTSlotBytes;
}
// A word table (kHTTailsOff, kHTHeadsOff, kHTFwdTailsOff, kHTFwdHeadsOff): its half for the op, and in that half
// (at `half` in memory) the word of (rank, ch).
PORTEP_HD constexpr uint64_t ht_word_half(uint64_t table, bool combine) {
  return table + (combine ? kHTWordTableBytes : 0);
}
PORTEP_HD uint64_t* ht_word(uint8_t* half, int rank, int ch) {
  return reinterpret_cast<uint64_t*>(half) + rank * kHTMaxChannels + ch;
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
// The ring `holder` keeps for `other` in channel ch (receive area; staging area: the holder's ring for other).
template <class G>
PORTEP_HD constexpr uint64_t ht_ring_offset(const G& g, int holder, int other, int ch, uint32_t ring_rows,
                                            uint32_t row_bytes) {
  const int peer = other < holder ? other : other - 1;
  return (uint64_t(peer) * g.num_channels + ch) * ring_rows * row_bytes;
}
// The forward ring a holder keeps for the other party of local index other_local in channel ch (receive area).
template <class G>
PORTEP_HD constexpr uint64_t ht_fwd_ring_offset(const G& g, int other_local, int ch, uint32_t ring_rows,
                                                uint32_t row_bytes) {
  return (uint64_t(g.num_ranks - 1 + other_local) * g.num_channels + ch) * ring_rows * row_bytes;
}
PORTEP_HD constexpr uint64_t ht_ring_slot(uint32_t i, uint32_t ring_rows, uint32_t row_bytes) {
  return uint64_t(i % ring_rows) * row_bytes;
}
template <class G>
PORTEP_HD constexpr uint64_t ht_num_rings(const G& g) {
  return uint64_t(g.num_ranks - 1 + (ht_forwarding(g) ? g.ranks_per_node : 0)) * g.num_channels;
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
static_assert(kHTTailsOff % kHTAlign == 0 && kHTOutgoingOff % kHTAlign == 0 && kHTHeadsOff % kHTAlign == 0 &&
                  kHTFwdTailsOff % kHTAlign == 0 && kHTFwdHeadsOff % kHTAlign == 0 && kHTScratchOff % kHTAlign == 0,
              "control words are 8-byte aligned, WRITE offsets 16-byte aligned");
static_assert(kHTCtrlBytes % kHTAlign == 0, "the control area ends on a WRITE boundary");
static_assert(ht_outgoing_slot(uint64_t(0), 0, 0) == kHTOutgoingOff &&
                  ht_outgoing_slot(uint64_t(0), 3, kHTMaxRanks - 1) + kHTSlotBytes ==
                      kHTOutgoingOff + kHTSlotTableBytes &&
                  ht_slot_off(3, kHTMaxRanks - 1) + kHTSlotBytes == kHTSlotsOff + kHTSlotTableBytes,
              "each slot table holds [2 parities][kHTMaxRanks] slots");
static_assert(kHTMinRingRows % kHTChunkRows == 0 && kHTMaxRingRows % kHTChunkRows == 0,
              "rings hold whole chunks: a proxy WRITE never wraps");
static_assert(kHTMaxRanks <= 32 && kHTNvlHeadColumns >= kHTMaxRanks,
              "rank masks are uint32 words; nvl_head has a column per local rank");
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
