// V2 combine's final sum on the GPU (gpu_kernels/slot_sums.h): one block per token and a thread per channel pair,
// each channel's slots read in order (rows of consecutive channels are consecutive, so reads coalesce).
#include "gpu_kernels/cuda/gpu_runtime.h"
#include <stdint.h>

#include "gpu_kernels/cuda/api.h"
#include "gpu_kernels/portability.cuh"
#include "gpu_kernels/slot_sums.h"

namespace portep::cuda {
namespace {

constexpr int kSlotSumThreads = 256;

__global__ void slot_sums_kernel(SlotSumArgs a) {
  for (int64_t t = blockIdx.x; t < a.num_tokens; t += gridDim.x) {
    const bool valid = slot_rows_valid(a, t);  // (a bad index never reads: the token's row becomes NaN)
    for (int64_t h = threadIdx.x; h < a.hidden; h += blockDim.x)
      a.out[t * a.hidden + h] = valid ? slot_sum_at(a, t, h) : kSlotSumBadRow;
  }
}

}  // namespace

int launch_slot_sums(const SlotSumArgs& a, void* stream) {
  if (a.num_tokens < 0 || a.num_topk < 1 || a.hidden < 1 || a.num_rows < 0 || !a.out || !a.row_of_slot ||
      (a.num_rows > 0 && !a.rows) || (a.bias1 && !a.bias0))
    return int(cudaErrorInvalidValue);
  if (a.num_tokens == 0) return 0;
  const int blocks = int(a.num_tokens < 65535 * 16 ? a.num_tokens : 65535 * 16);
  return int(launch_kernel<slot_sums_kernel>(blocks, kSlotSumThreads, 0, static_cast<cudaStream_t>(stream), a));
}

int load_slot_sum_kernels() { return int(load_kernel(slot_sums_kernel)); }

}  // namespace portep::cuda
