#pragma once

#include <stdint.h>

#include "proxy/fifo.h"

namespace portep {

struct FifoSelftestResult {
  uint64_t popped = 0;
  uint64_t out_of_order = 0;  // commands whose per-producer sequence or payload was not the next expected one
  bool producer_timeout = false;
  double seconds = 0;
};

// `producers` host threads push per_producer commands each into one FIFO of `capacity` slots while this
// thread consumes and checks every producer's sequence.
FifoSelftestResult fifo_selftest(int producers, uint64_t per_producer, uint32_t capacity, double timeout_s);

}  // namespace portep
