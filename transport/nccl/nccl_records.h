// The nccl transport's wire format in the control window: how a write's immediate reaches the receiver when the
// one-sided API carries no value with its signal (NCCL's ncclPutSignal counts signals, nothing more).
//
// Control window of every rank, the same layout on all (R ranks):
//   [inbox(0) .. inbox(R-1)] [outbox(0) .. outbox(R-1)]
//   inbox(s)  = written only by source s: [0, 8) credit: how many of this rank's records s has consumed;
//               [64, 64 + 16 * kRecordSlots) the ring of s's records to this rank, slot = (seq - 1) % kRecordSlots
//   outbox(p) = this rank's staging for lane p: [0, 16) the record being put, [64, 72) the credit being put
// A record is two 8-byte halves, each carrying the record's sequence number, so that a half still holding the
// previous lap's record (a torn read of a slot being written) never passes for the new one. This relies on each
// aligned 8-byte word landing whole, as NCCL's own LL protocol does (a flag in every 8 bytes):
//   half 0: imm (32) | seq (32)        half 1: put count (32) | seq low 24 bits << 8 | channel (8)
// The put count is how many puts this rank had made to the receiver when this record's own put was made,
// itself included: the receiver trusts a record only once it has counted that many signals from its source, and a
// counted signal means every earlier put of the lane (the write's bytes) has landed.
#pragma once

#include <stddef.h>
#include <stdint.h>

namespace portep::nccl_wire {

constexpr uint32_t kRecordSlots = 1024;
constexpr uint64_t kRecordBytes = 16;
constexpr uint64_t kInboxHeaderBytes = 64;
constexpr uint64_t kInboxBytes = kInboxHeaderBytes + kRecordBytes * kRecordSlots;
constexpr uint64_t kOutboxBytes = 128;
constexpr uint64_t kOutboxRecord = 0, kOutboxCredit = 64;
constexpr int kMaxChannels = 256;  // the channel travels in 8 bits

struct Record {
  uint32_t imm;
  uint32_t seq;
  uint32_t put_count;
  uint32_t tag;  // seq low 24 bits << 8 | channel
};
static_assert(sizeof(Record) == kRecordBytes, "a record is two 8-byte halves");
static_assert(kRecordSlots % 4 == 0 && (kRecordSlots & (kRecordSlots - 1)) == 0, "slots: a power of two");

inline uint64_t control_window_bytes(int num_ranks) { return uint64_t(num_ranks) * (kInboxBytes + kOutboxBytes); }
inline uint64_t inbox_offset(int src) { return uint64_t(src) * kInboxBytes; }
inline uint64_t slot_offset(int src, uint64_t seq) {
  return inbox_offset(src) + kInboxHeaderBytes + (seq - 1) % kRecordSlots * kRecordBytes;
}
inline uint64_t outbox_offset(int num_ranks, int peer) {
  return uint64_t(num_ranks) * kInboxBytes + uint64_t(peer) * kOutboxBytes;
}

inline Record encode(uint32_t imm, uint64_t seq, uint64_t put_count, int channel) {
  return Record{imm, uint32_t(seq), uint32_t(put_count), uint32_t(seq & 0xFFFFFF) << 8 | uint32_t(channel & 0xFF)};
}
// The record as the two 8-byte words it is written as (little-endian: the first field in the low half).
inline void words_of(const Record& r, uint64_t out[2]) {
  out[0] = uint64_t(r.seq) << 32 | r.imm;
  out[1] = uint64_t(r.tag) << 32 | r.put_count;
}
// Record seq has landed in this slot (both halves).
inline bool holds(const Record& r, uint64_t seq) { return r.seq == uint32_t(seq) && r.tag >> 8 == (seq & 0xFFFFFF); }
inline int channel_of(const Record& r) { return int(r.tag & 0xFF); }
// The record's put has been counted once `counted` signals (in all) came from its source; wrap-safe in 32 bits.
inline bool counted(const Record& r, uint64_t counted) { return int32_t(r.put_count - uint32_t(counted)) <= 0; }

}  // namespace portep::nccl_wire
