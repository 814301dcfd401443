// get_dispatch_layout on the GPU: per token, the ranks (and nodes) that hold any of its experts; counts per
// rank, per node and per expert. One thread per token; counts go to shared-memory histograms when they fit,
// then to global memory with one atomic per non-zero bin and block.
#include "gpu_kernels/cuda/gpu_runtime.h"
#include <stdint.h>

#include "gpu_kernels/cuda/api.h"
#include "gpu_kernels/cuda/kernel_errors.cuh"
#include "gpu_kernels/portability.cuh"

namespace portep::cuda {
namespace {

constexpr int kLayoutThreads = 256;
constexpr int kMaxSharedBins = 8192;  // 32 KiB of int32 histograms

__device__ __forceinline__ void count(int32_t* bin_shared, int32_t* bin_global, bool use_shared, int i) {
  if (use_shared)
    atomicAdd(&bin_shared[i], 1);
  else
    atomicAdd(&bin_global[i], 1);
}

__global__ void dispatch_layout_kernel(LayoutArgs a) {
  extern __shared__ int32_t bins[];  // [experts | ranks | nodes]
  const int num_nodes = a.num_ranks / a.ranks_per_node;
  const int num_bins = a.num_experts + a.num_ranks + (a.per_node ? num_nodes : 0);
  const bool shared = num_bins <= kMaxSharedBins;
  int32_t* expert_bins = bins;
  int32_t* rank_bins = bins + a.num_experts;
  int32_t* node_bins = rank_bins + a.num_ranks;
  if (shared)
    for (int i = threadIdx.x; i < num_bins; i += blockDim.x) bins[i] = 0;
  __syncthreads();

  const int experts_per_rank = a.num_experts / a.num_ranks;
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < a.num_tokens; t += gridDim.x * blockDim.x) {
    const int64_t* row = a.topk_idx + int64_t(t) * a.num_topk;
    bool* in_rank = a.is_token_in_rank + int64_t(t) * a.num_ranks;
    for (int r = 0; r < a.num_ranks; ++r) in_rank[r] = false;
    for (int k = 0; k < a.num_topk; ++k) {
      const int64_t e = row[k];
      if (e < -1 || e >= a.num_experts) {  // never checked on the host (that would synchronize)
        report_to(a.failed, a.error, kErrBadExpert, uint32_t(a.rank), uint32_t(t), uint32_t(k), e);
        continue;
      }
      if (e < 0) continue;
      count(expert_bins, a.per_expert, shared, int(e));
      const int r = int(e / experts_per_rank);
      if (in_rank[r]) continue;
      in_rank[r] = true;
      count(rank_bins, a.per_rank, shared, r);
      if (!a.per_node) continue;
      const int node = r / a.ranks_per_node;
      bool seen = false;  // another of this token's ranks on the same node was counted already
      for (int k2 = 0; k2 < k && !seen; ++k2)
        seen = row[k2] >= 0 && row[k2] < a.num_experts && int(row[k2] / experts_per_rank) / a.ranks_per_node == node;
      if (!seen) count(node_bins, a.per_node, shared, node);
    }
  }
  if (!shared) return;
  __syncthreads();
  for (int i = threadIdx.x; i < num_bins; i += blockDim.x) {
    if (bins[i] == 0) continue;
    if (i < a.num_experts)
      atomicAdd(&a.per_expert[i], bins[i]);
    else if (i < a.num_experts + a.num_ranks)
      atomicAdd(&a.per_rank[i - a.num_experts], bins[i]);
    else
      atomicAdd(&a.per_node[i - a.num_experts - a.num_ranks], bins[i]);
  }
}

}  // namespace

int launch_dispatch_layout(const LayoutArgs& a) {
  if (a.num_tokens < 0 || a.num_topk < 1 || a.num_ranks < 1 || a.ranks_per_node < 1 || a.num_ranks % a.ranks_per_node ||
      a.num_experts % a.num_ranks || !a.failed || !a.error)
    return int(cudaErrorInvalidValue);
  cudaStream_t s = static_cast<cudaStream_t>(a.stream);
  cudaError_t err;
  if ((err = cudaMemsetAsync(a.per_rank, 0, sizeof(int32_t) * a.num_ranks, s))) return int(err);
  if ((err = cudaMemsetAsync(a.per_expert, 0, sizeof(int32_t) * a.num_experts, s))) return int(err);
  const int num_nodes = a.num_ranks / a.ranks_per_node;
  if (a.per_node && (err = cudaMemsetAsync(a.per_node, 0, sizeof(int32_t) * num_nodes, s))) return int(err);
  if (a.num_tokens == 0) return 0;
  const int num_bins = a.num_experts + a.num_ranks + (a.per_node ? num_nodes : 0);
  const size_t shared = num_bins <= kMaxSharedBins ? sizeof(int32_t) * num_bins : 0;
  const int blocks = (a.num_tokens + kLayoutThreads - 1) / kLayoutThreads;
  return int(launch_kernel<dispatch_layout_kernel>(blocks, kLayoutThreads, shared, s, a));
}

int load_layout_kernels() { return int(load_kernel(dispatch_layout_kernel)); }

}  // namespace portep::cuda
