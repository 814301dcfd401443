#include "gpu_kernels/host/slot_sums.h"

#include <stdexcept>
#include <string>

namespace portep {

void host_slot_sums(const SlotSumArgs& a) {
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    if (!slot_rows_valid(a, t))
      throw std::invalid_argument("slot sums: token " + std::to_string(t) + " names a row outside [-1, " +
                                  std::to_string(a.num_rows) + ")");
    for (int64_t h = 0; h < a.hidden; ++h) a.out[t * a.hidden + h] = slot_sum_at(a, t, h);
  }
}

}  // namespace portep
