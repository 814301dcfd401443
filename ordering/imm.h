// Immediate-data encodings: the 32-bit tag a write-with-immediate carries on transports that do not keep
// order (EFA SRD, striped RC, unordered shm). The receiver knows the source rank from the connection the
// notification arrived on, so no rank bits are spent here: scale in ranks is limited only by TransferCmd.
//
// Bit table (bit 31 is the most significant):
//
//   kind [31:30] = 0  STREAM_WRITE   [29:26] epoch (4)  [25:13] stream (13)  [12:0] reserved, must be 0
//   kind [31:30] = 1  STREAM_SIGNAL  [29]    final (1)  [28:25] epoch (4)  [24:12] stream (13)  [11:0] units (12)
//   kind [31:30] = 2  SEQ_ADD        [29:18] slot (12)  [17:10] seq (8)    [9:0]  value (10)
//   kind [31:30] = 3  CONTROL        [29:26] op (4)     [25:0]  arg (26)
//
// STREAM_*: a stream's writes are grouped into epochs closed by a signal; the signal names how many
//   writes (units) its epoch had. The receiver releases the signal once that many writes of the epoch have
//   arrived and every earlier epoch has been released (ordering/pending_signals.h). 13 stream bits give 8192
//   streams per connection (LL: local expert x phase; 4096 experts over any number of ranks).
// SEQ_ADD: reserved for sequence-ordered HT tail increments; nothing sends it, and a proxy that receives one
//   raises (proxy/proxy_thread.cpp).
// CONTROL: barrier and other out-of-band messages; arg is op-specific (barrier: epoch mod 2^26).
#pragma once

#include <stdint.h>

namespace portep {
namespace imm {

enum Kind : uint32_t { kStreamWrite = 0, kStreamSignal = 1, kSeqAdd = 2, kControl = 3 };
enum ControlOp : uint32_t { kCtrlBarrier = 1 };

constexpr uint32_t kEpochBits = 4, kStreamBits = 13, kUnitsBits = 12;
constexpr uint32_t kSlotBits = 12, kSeqBits = 8, kValueBits = 10;
constexpr uint32_t kCtrlOpBits = 4, kCtrlArgBits = 26;

constexpr uint32_t kNumEpochs = 1u << kEpochBits;       // 16
constexpr uint32_t kMaxStreams = 1u << kStreamBits;     // 8192
constexpr uint32_t kMaxUnits = (1u << kUnitsBits) - 1;  // 4095 writes per epoch
constexpr uint32_t kMaxSlots = 1u << kSlotBits;         // 4096
constexpr uint32_t kSeqSpace = 1u << kSeqBits;          // 256
constexpr uint32_t kMaxSeqValue = (1u << kValueBits) - 1;
constexpr uint32_t kCtrlArgMask = (1u << kCtrlArgBits) - 1;

constexpr uint32_t bits_mask(uint32_t n) { return (1u << n) - 1; }

inline Kind kind_of(uint32_t v) { return Kind(v >> 30); }

inline uint32_t encode_stream_write(uint32_t stream, uint32_t epoch) {
  return (kStreamWrite << 30) | ((epoch & bits_mask(kEpochBits)) << 26) | ((stream & bits_mask(kStreamBits)) << 13);
}

inline uint32_t encode_stream_signal(uint32_t stream, uint32_t epoch, uint32_t units, bool final_signal) {
  return (kStreamSignal << 30) | (uint32_t(final_signal) << 29) | ((epoch & bits_mask(kEpochBits)) << 25) |
         ((stream & bits_mask(kStreamBits)) << 12) | (units & bits_mask(kUnitsBits));
}

inline uint32_t encode_seq_add(uint32_t slot, uint32_t seq, uint32_t value) {
  return (kSeqAdd << 30) | ((slot & bits_mask(kSlotBits)) << 18) | ((seq & bits_mask(kSeqBits)) << 10) |
         (value & bits_mask(kValueBits));
}

inline uint32_t encode_control(uint32_t op, uint32_t arg) {
  return (kControl << 30) | ((op & bits_mask(kCtrlOpBits)) << 26) | (arg & kCtrlArgMask);
}

struct Decoded {
  Kind kind;
  uint32_t stream = 0, epoch = 0, units = 0;  // STREAM_*
  bool final_signal = false;                  // STREAM_SIGNAL
  uint32_t slot = 0, seq = 0, value = 0;      // SEQ_ADD
  uint32_t op = 0, arg = 0;                   // CONTROL
  bool valid = true;                          // false: reserved bits set
};

inline Decoded decode(uint32_t v) {
  Decoded d;
  d.kind = kind_of(v);
  switch (d.kind) {
    case kStreamWrite:
      d.epoch = (v >> 26) & bits_mask(kEpochBits);
      d.stream = (v >> 13) & bits_mask(kStreamBits);
      d.valid = (v & bits_mask(13)) == 0;
      break;
    case kStreamSignal:
      d.final_signal = (v >> 29) & 1;
      d.epoch = (v >> 25) & bits_mask(kEpochBits);
      d.stream = (v >> 12) & bits_mask(kStreamBits);
      d.units = v & bits_mask(kUnitsBits);
      break;
    case kSeqAdd:
      d.slot = (v >> 18) & bits_mask(kSlotBits);
      d.seq = (v >> 10) & bits_mask(kSeqBits);
      d.value = v & bits_mask(kValueBits);
      break;
    case kControl:
      d.op = (v >> 26) & bits_mask(kCtrlOpBits);
      d.arg = v & kCtrlArgMask;
      break;
  }
  return d;
}

}  // namespace imm
}  // namespace portep
