// Torch-free host entry points of the CUDA kernels. Plain C++: no CUDA types, so any host compiler can
// include it. Every function returns a cudaError_t as int (0 = success) and never aborts.
#pragma once

#include <stdint.h>

#include <vector>

#include "gpu_kernels/cuda/kernel_errors.h"
#include "gpu_kernels/slot_sums.h"
#include "proxy/fifo.h"

namespace portep::cuda {

// get_dispatch_layout: all pointers are device memory; per_node may be null (one node). Asynchronous on
// `stream`; returns the launch error.
struct LayoutArgs {
  const int64_t* topk_idx;  // [num_tokens, num_topk], -1 = no expert
  int num_tokens, num_topk, num_experts, num_ranks, ranks_per_node;
  int32_t* per_rank;       // [num_ranks]
  int32_t* per_node;       // [num_ranks / ranks_per_node] or null
  int32_t* per_expert;     // [num_experts]
  bool* is_token_in_rank;  // [num_tokens, num_ranks]
  void* stream;
  // an entry outside [-1, num_experts) is left out and reported as a notice (kErrBadExpert, kernel_errors.h)
  int rank;
  uint32_t* failed;    // device [kNumErrorWords]
  KernelError* error;  // mapped host [kNumErrorWords]
};
int launch_dispatch_layout(const LayoutArgs& a);
int load_layout_kernels();

// V2 combine's final sum (gpu_kernels/slot_sums.h) on `stream`; a token naming a row past num_rows gets NaN.
int launch_slot_sums(const portep::SlotSumArgs& a, void* stream);
int load_slot_sum_kernels();

int cuda_device_count(int* count);
const char* cuda_error_string(int err);

// capacity must be a power of two. entries, tail and error_flag are zeroed mapped pinned host memory;
// head is zeroed device memory, the same pointer in both views (the host never touches it).
// host_view holds host pointers for the proxy's consumer, device_view device pointers for kernels.
// On failure nothing stays allocated and both views are zeroed.
int alloc_mapped_fifo(uint32_t capacity, FifoView* host_view, FifoView* device_view);

// Frees what alloc_mapped_fifo allocated and zeroes both views; returns the first error.
int free_mapped_fifo(FifoView* host_view, FifoView* device_view);

}  // namespace portep::cuda
