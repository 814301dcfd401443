#include "gpu_kernels/host/slot_sums.h"

#include <stdexcept>
#include <string>
#include <vector>

namespace portep {

// Row by row rather than channel by channel (slot_sum_at's order for every channel, in contiguous loops).
void host_slot_sums(const SlotSumArgs& a) {
  if (a.num_topk < 1 || a.num_topk > kSlotSumMaxTopk)
    throw std::invalid_argument("slot sums: num_topk " + std::to_string(a.num_topk) + " outside [1, " +
                                std::to_string(kSlotSumMaxTopk) + "]");
  std::vector<int64_t> present(a.num_topk);
  std::vector<float> acc(a.hidden);
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    const int n = slot_rows_of(a, t, present.data());
    if (n < 0)
      throw std::invalid_argument("slot sums: token " + std::to_string(t) + " names a row outside [-1, " +
                                  std::to_string(a.num_rows) + ")");
    for (int64_t h = 0; h < a.hidden; ++h) acc[h] = slot_sum_start(a, t, h);
    for (int j = 0; j < n; ++j) {
      const uint16_t* row = a.rows + present[j] * a.hidden;
      for (int64_t h = 0; h < a.hidden; ++h) acc[h] = acc[h] + bf16_to_f32(row[h]);
    }
    uint16_t* out = a.out + t * a.hidden;
    for (int64_t h = 0; h < a.hidden; ++h) out[h] = slot_sum_end(a, acc[h], n);
  }
}

}  // namespace portep
