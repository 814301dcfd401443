// HT tail increments on transports that do not order (docs/design.md §5, Ordering on unordered transports: SEQ_ADD).
//
// The tail increment of an HT chunk rides in the immediate of the chunk's data write, with a sequence
// number per (source, slot) taken mod 256. The receiver applies increments strictly in sequence order: an
// early arrival waits in a window of `window` entries. A sequence number outside the window, or one already
// held, is a protocol violation and raises OrderingError. The sender's in-flight cap per (peer, slot) must be
// smaller than the window: check_inflight_cap() refuses a configuration that could alias.
//
// Pure logic: no I/O, no threads.
#pragma once

#include <stdint.h>

#include <vector>

#include "portep/imm.h"
#include "portep/pending_signals.h"

namespace portep {

struct SeqApply {
  uint32_t src;
  uint32_t slot;
  uint32_t value;
};

class SeqReorderBuffer {
 public:
  // window: 1..256 (the sequence space of the immediate).
  SeqReorderBuffer(uint32_t num_sources, uint32_t num_slots, uint32_t window);

  // An increment arrived; appends every increment now applicable, in sequence order, to out.
  void on_add(uint32_t src, uint32_t slot, uint32_t seq, uint32_t value, std::vector<SeqApply>* out);

  uint32_t window() const { return window_; }
  uint64_t held() const { return held_; }

 private:
  struct SlotState {
    uint32_t expected = 0;              // next sequence number to apply, mod 256
    uint64_t present[imm::kSeqSpace / 64] = {};
    uint16_t values[imm::kSeqSpace] = {};
  };

  uint32_t num_sources_, num_slots_, window_;
  std::vector<SlotState> slots_;
  uint64_t held_ = 0;
};

// Refuses (OrderingError, naming both numbers) an in-flight cap that could exceed the reorder window.
void check_inflight_cap(uint32_t inflight_cap, uint32_t window);

}  // namespace portep
