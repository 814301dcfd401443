// Host code of the LL kernels' graph launches (ll_api.h, LLGraphs): one kernel's launches as instantiated
// one-node CUDA graphs, one per distinct parameter block. Launching an instantiated graph costs the host about half
// a kernel launch (cuLaunchKernel prepares the launch on every call; the graph was prepared when it was built). A
// call whose parameters match a cached graph launches it; a new block takes a free entry (a graph built and
// instantiated, some tens of microseconds, once) or re-parameterises the least recently used one, which costs about
// what a kernel launch does. Launches already queued keep the parameters they were launched with (CUDA's rule for
// cudaGraphExecKernelNodeSetParams). Not thread-safe: its owner (an LLPlanTable) is used under the GIL. CUDA only.
#pragma once

#if !defined(__HIPCC__)

#include <stdint.h>
#include <string.h>

#include "gpu_kernels/cuda/gpu_runtime.h"
#include "gpu_kernels/cuda/ll_api.h"

namespace portep::cuda {

class GraphCache {
 public:
  static constexpr int kEntries = 16;
  static constexpr size_t kMaxKey = 512;

  GraphCache() = default;
  GraphCache(const GraphCache&) = delete;
  GraphCache& operator=(const GraphCache&) = delete;
  ~GraphCache() {
    for (Entry& e : entries_) drop(&e);
  }

  // func<<<grid, block, smem, stream>>>(*params) as the graph of the parameter bytes `key` (which must hold
  // everything in params): 0; the launch's error, after which nothing was queued and the entry is dropped; or
  // kGraphDeclined where another GPU is current than the one its graphs were made on (their kernels run there).
  int launch(const void* func, dim3 grid, dim3 block, unsigned smem, cudaStream_t stream, void** params,
             const void* key, size_t key_bytes) {
    if (key_bytes > kMaxKey) return cudaErrorInvalidValue;
    int device = -1;
    if (cudaGetDevice(&device) != cudaSuccess) {
      (void)cudaGetLastError();
      return kGraphDeclined;
    }
    if (device_ < 0) device_ = device;
    if (device != device_) return kGraphDeclined;
    cudaKernelNodeParams p{};
    p.func = const_cast<void*>(func);
    p.gridDim = grid;
    p.blockDim = block;
    p.sharedMemBytes = smem;
    p.kernelParams = params;
    Entry* e = find(key, key_bytes, grid, block, smem);
    cudaError_t err = cudaSuccess;
    if (!e) {
      e = victim();
      err = e->exec ? update(e, p) : build(e, p);
      if (err != cudaSuccess) return err;
      memcpy(e->key, key, key_bytes);
      e->bytes = key_bytes;
      e->grid = grid;
      e->block = block;
      e->smem = smem;
    }
    e->used = ++clock_;
    err = cudaGraphLaunch(e->exec, stream);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      drop(e);
      return err;
    }
    ++launches;
    return cudaSuccess;
  }

  uint64_t launches = 0, builds = 0, updates = 0;

 private:
  struct Entry {
    unsigned char key[kMaxKey];
    size_t bytes = 0;
    dim3 grid, block;
    unsigned smem = 0;
    cudaGraph_t graph = nullptr;  // kept: its node names the kernel in the executable graph
    cudaGraphNode_t node = nullptr;
    cudaGraphExec_t exec = nullptr;
    uint64_t used = 0;
  };

  Entry* find(const void* key, size_t bytes, dim3 grid, dim3 block, unsigned smem) {
    for (Entry& e : entries_)
      if (e.exec && e.bytes == bytes && e.smem == smem && same(e.grid, grid) && same(e.block, block) &&
          memcmp(e.key, key, bytes) == 0)
        return &e;
    return nullptr;
  }

  Entry* victim() {
    Entry* v = &entries_[0];
    for (Entry& e : entries_) {
      if (!e.exec) return &e;
      if (e.used < v->used) v = &e;
    }
    return v;
  }

  cudaError_t build(Entry* e, const cudaKernelNodeParams& p) {
    cudaError_t err = cudaGraphCreate(&e->graph, 0);
    if (err == cudaSuccess) err = cudaGraphAddKernelNode(&e->node, e->graph, nullptr, 0, &p);
    if (err == cudaSuccess) err = cudaGraphInstantiate(&e->exec, e->graph, 0);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      drop(e);
      return err;
    }
    ++builds;
    return cudaSuccess;
  }

  cudaError_t update(Entry* e, const cudaKernelNodeParams& p) {
    e->bytes = 0;  // matches nothing until the update is in
    if (cudaGraphExecKernelNodeSetParams(e->exec, e->node, &p) == cudaSuccess) {
      ++updates;
      return cudaSuccess;
    }
    (void)cudaGetLastError();
    drop(e);
    return build(e, p);
  }

  // An exec still queued is freed by CUDA when it completes (cudaGraphExecDestroy's rule).
  static void drop(Entry* e) {
    if (e->exec) (void)cudaGraphExecDestroy(e->exec);
    if (e->graph) (void)cudaGraphDestroy(e->graph);
    e->exec = nullptr;
    e->graph = nullptr;
    e->node = nullptr;
    e->bytes = 0;
    e->used = 0;
  }

  static bool same(dim3 a, dim3 b) { return a.x == b.x && a.y == b.y && a.z == b.z; }

  Entry entries_[kEntries];
  uint64_t clock_ = 0;
  int device_ = -1;  // the GPU current when the first graph was made
};

struct LLGraphs {
  GraphCache dispatch, combine;
};

}  // namespace portep::cuda

#endif  // !__HIPCC__
