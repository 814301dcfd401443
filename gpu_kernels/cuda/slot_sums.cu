// V2 combine's final sum on the GPU (gpu_kernels/slot_sums.h): a block per token, its rows listed once in shared
// memory, a thread per channel adding them in slot order (consecutive threads read consecutive channels).
#include "gpu_kernels/cuda/gpu_runtime.h"
#include <stdint.h>

#include "gpu_kernels/cuda/api.h"
#include "gpu_kernels/portability.cuh"
#include "gpu_kernels/slot_sums.h"

namespace portep::cuda {
namespace {

constexpr int kSlotSumThreads = 256;

__global__ void slot_sums_kernel(SlotSumArgs a) {
  __shared__ int64_t present[kSlotSumMaxTopk];
  __shared__ int count;
  for (int64_t t = blockIdx.x; t < a.num_tokens; t += gridDim.x) {
    if (threadIdx.x == 0) count = slot_rows_of(a, t, present);
    __syncthreads();
    const int n = count;  // -1: a bad index, never read; the token's row becomes NaN
    for (int64_t h = threadIdx.x; h < a.hidden; h += blockDim.x)
      a.out[t * a.hidden + h] = n < 0 ? kSlotSumBadRow : slot_sum_at(a, t, h, present, n);
    __syncthreads();  // every thread is done with present before the next token's rows overwrite it
  }
}

}  // namespace

int launch_slot_sums(const SlotSumArgs& a, void* stream) {
  if (a.num_tokens < 0 || a.num_topk < 1 || a.num_topk > kSlotSumMaxTopk || a.hidden < 1 || a.num_rows < 0)
    return int(cudaErrorInvalidValue);
  if (a.num_tokens == 0) return 0;  // an empty out and row_of_slot have no address (a rank that received no rows)
  if (!a.out || !a.row_of_slot || (a.num_rows > 0 && !a.rows) || (a.bias1 && !a.bias0))
    return int(cudaErrorInvalidValue);
  const int blocks = int(a.num_tokens < 65535 * 16 ? a.num_tokens : 65535 * 16);
  return int(launch_kernel<slot_sums_kernel>(blocks, kSlotSumThreads, 0, static_cast<cudaStream_t>(stream), a));
}

int load_slot_sum_kernels() { return int(load_kernel(slot_sums_kernel)); }

}  // namespace portep::cuda
