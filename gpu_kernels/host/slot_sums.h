// V2 combine's final sum on the host (gpu_kernels/slot_sums.h has the arithmetic and the arguments).
#pragma once

#include "gpu_kernels/slot_sums.h"

namespace portep {

// Every token's out row; throws std::invalid_argument naming a token whose row index lies outside [-1, num_rows).
void host_slot_sums(const SlotSumArgs& a);

}  // namespace portep
