// Sender-side state of each (destination, stream) for the signal protocols (docs/design.md §5, Ordering on
// unordered transports).
// Writes count units into the open epoch; a signal closes it. With native atomics the signal adds the units
// directly; without, the epoch number (mod 16) rides in every immediate and the receiver holds the signal
// until the epoch's writes are in (ordering/pending_signals.h). To keep the mod-16 window from aliasing,
// epoch e may start only after every command of epoch e-16 has retired (closing_seq below).
#pragma once

#include <stdint.h>

#include <unordered_map>

#include "ordering/imm.h"

namespace portep {

struct StreamEpoch {
  uint64_t epoch = 0;                          // epochs closed so far
  uint32_t units = 0;                          // writes in the open epoch
  uint64_t closing_seq[imm::kNumEpochs] = {};  // post sequence of the signal that closed epoch (index mod 16)
  bool closed_once[imm::kNumEpochs] = {};

  // Sequence number that must have retired before the open epoch may post (none: returns false).
  bool must_wait_for(uint64_t* seq) const {
    const uint32_t i = uint32_t(epoch % imm::kNumEpochs);
    if (!closed_once[i]) return false;
    *seq = closing_seq[i];
    return true;
  }
  void close(uint64_t signal_seq) {
    const uint32_t i = uint32_t(epoch % imm::kNumEpochs);
    closing_seq[i] = signal_seq;
    closed_once[i] = true;
    ++epoch;
    units = 0;
  }
};

class StreamEpochTable {
 public:
  StreamEpoch& at(uint32_t dst, uint32_t stream) { return map_[(uint64_t(dst) << 32) | stream]; }

 private:
  std::unordered_map<uint64_t, StreamEpoch> map_;
};

}  // namespace portep
