// Host code of the LL kernels' graph launches (ll_api.h, LLGraphs): one kernel's launches as instantiated
// one-node CUDA graphs, one per distinct parameter block. Launching an instantiated graph costs the host about half
// a kernel launch (cuLaunchKernel prepares the launch on every call; the graph was prepared when it was built). A
// call whose parameters and launch configuration match a cached graph launches it; a new block takes a free entry
// (a graph built and instantiated, some tens of microseconds, once) or re-parameterises the least recently used
// one, which costs about what a kernel launch does. Launches already queued keep the parameters they were launched with
// (CUDA's rule for cudaGraphExecKernelNodeSetParams). Not thread-safe: its owner (an LLPlanTable) is used under the
// GIL. CUDA only.
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

  // func<<<grid, block, smem, stream>>>(*params) as the graph of the bytes `key`, which must hold everything in
  // params and the launch configuration (launch_graphed below makes them): 0; the launch's error, after which
  // nothing was queued and the entry is dropped; or kGraphDeclined where another GPU is current than the one its
  // graphs were made on (their kernels run there).
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
    Entry* e = find(key, key_bytes);
    if (!e) {
      cudaKernelNodeParams p{};
      p.func = const_cast<void*>(func);
      p.gridDim = grid;
      p.blockDim = block;
      p.sharedMemBytes = smem;
      p.kernelParams = params;
      e = victim();
      if (cudaError_t err = e->exec ? update(e, p) : build(e, p); err != cudaSuccess) return err;
      memcpy(e->key, key, key_bytes);
      e->bytes = key_bytes;
    }
    e->used = ++clock_;
    if (cudaError_t err = cudaGraphLaunch(e->exec, stream); err != cudaSuccess) return dropped(e, err);
    ++launches;
    return cudaSuccess;
  }

  uint64_t launches = 0, builds = 0, updates = 0;

 private:
  struct Entry {
    unsigned char key[kMaxKey];
    size_t bytes = 0;
    cudaGraph_t graph = nullptr;  // kept: its node names the kernel in the executable graph
    cudaGraphNode_t node = nullptr;
    cudaGraphExec_t exec = nullptr;
    uint64_t used = 0;
  };

  Entry* find(const void* key, size_t bytes) {
    for (Entry& e : entries_)
      if (e.exec && e.bytes == bytes && memcmp(e.key, key, bytes) == 0) return &e;
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
    if (err != cudaSuccess) return dropped(e, err);
    ++builds;
    return cudaSuccess;
  }

  cudaError_t update(Entry* e, const cudaKernelNodeParams& p) {
    e->bytes = 0;  // matches nothing until the update is in
    if (cudaGraphExecKernelNodeSetParams(e->exec, e->node, &p) == cudaSuccess) {
      ++updates;
      return cudaSuccess;
    }
    dropped(e, cudaSuccess);
    return build(e, p);
  }

  // `err` after a failed CUDA call on e's behalf: the call's own error cleared, e emptied.
  static cudaError_t dropped(Entry* e, cudaError_t err) {
    (void)cudaGetLastError();
    drop(e);
    return err;
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

  Entry entries_[kEntries];
  uint64_t clock_ = 0;
  int device_ = -1;  // the GPU current when the first graph was made
};

// kernel<<<blocks, threads, smem, a.c.stream>>>(a, ints...) through `cache`, an LL kernel's launch (ll_dispatch.cu,
// ll_combine.cu). The key is the parameters and the launch configuration, zeroed padding included, without the
// stream (where the graph launches) and a.c.seq (a graph's call reads it from the chain: ll_api.h).
template <class Args, class... Ints>
int launch_graphed(GraphCache& cache, const void* kernel, int blocks, int threads, size_t smem, const Args& a,
                   Ints... ints) {
  constexpr int kInts = int(sizeof...(Ints));
  struct Key {
    Args a;
    int ints[kInts];
    int blocks, threads;
    size_t smem;
  } key;
  static_assert(sizeof(Key) <= GraphCache::kMaxKey, "the kernel's parameters fit a cache key");
  memset(&key, 0, sizeof key);
  key.a = a;
  key.a.c.stream = nullptr;
  key.a.c.seq = 0;
  int i = 0;
  ((key.ints[i++] = int(ints)), ...);
  key.blocks = blocks;
  key.threads = threads;
  key.smem = smem;
  void* params[1 + kInts] = {&key.a};
  for (int j = 0; j < kInts; ++j) params[1 + j] = &key.ints[j];
  return cache.launch(kernel, dim3(unsigned(blocks)), dim3(unsigned(threads)), unsigned(smem),
                      static_cast<cudaStream_t>(a.c.stream), params, &key, sizeof key);
}

struct LLGraphs {
  GraphCache dispatch, combine;
};

}  // namespace portep::cuda

#endif  // !__HIPCC__
