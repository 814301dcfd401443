// Host-side setup for the LL kernels: sets of device FIFOs, small device / mapped host allocations, the graph
// caches of the LL launches.
#include "gpu_kernels/cuda/gpu_runtime.h"

#include <string.h>

#include <initializer_list>
#include <vector>

#include "gpu_kernels/cuda/api.h"
#include "gpu_kernels/cuda/graph_cache.h"
#include "gpu_kernels/cuda/ll_api.h"

namespace portep::cuda {

int alloc_device_fifo_set(int count, uint32_t capacity, DeviceFifoSet* out) {
  if (!out || count < 1) return cudaErrorInvalidValue;
  *out = DeviceFifoSet{};
  std::vector<FifoView> host(static_cast<size_t>(count)), device(static_cast<size_t>(count));
  cudaError_t err = cudaSuccess;
  int made = 0;
  for (; made < count; ++made)
    if ((err = cudaError_t(alloc_mapped_fifo(capacity, &host[made], &device[made]))) != cudaSuccess) break;
  if (err == cudaSuccess) err = cudaMalloc(&out->device_views, sizeof(FifoView) * size_t(count));
  if (err == cudaSuccess)
    err = cudaMemcpy(out->device_views, device.data(), sizeof(FifoView) * size_t(count), cudaMemcpyHostToDevice);
  if (err == cudaSuccess) err = cudaMalloc(&out->device_tails, sizeof(uint64_t) * size_t(count));
  if (err == cudaSuccess) err = cudaMemset(out->device_tails, 0, sizeof(uint64_t) * size_t(count));
  out->host_views = new FifoView[size_t(count)];
  for (int i = 0; i < made; ++i) out->host_views[i] = host[i];
  out->count = made;
  if (err != cudaSuccess) {
    free_device_fifo_set(out);  // the allocation error is the one worth reporting
    return int(err);
  }
  return 0;
}

int free_device_fifo_set(DeviceFifoSet* set) {
  if (!set) return cudaErrorInvalidValue;
  int first = 0;
  for (int i = 0; i < set->count; ++i) {
    FifoView device_view{};
    int e = free_mapped_fifo(&set->host_views[i], &device_view);
    if (!first) first = e;
  }
  delete[] set->host_views;
  for (void* p : {static_cast<void*>(set->device_views), static_cast<void*>(set->device_tails)}) {
    const int e = p ? int(cudaFree(p)) : 0;
    if (!first) first = e;
  }
  *set = DeviceFifoSet{};
  return first;
}

int copy_to_device(void* dst, const void* src, uint64_t bytes) {
  return int(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault));
}

int device_alloc_zeroed(void** p, uint64_t bytes) {
  cudaError_t e = cudaMalloc(p, bytes);
  if (e == cudaSuccess) e = cudaMemset(*p, 0, bytes);
  return int(e);
}

int device_free(void* p) { return int(cudaFree(p)); }

int stream_create(void** stream) {
  cudaStream_t s = nullptr;
  const cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  *stream = s;
  return int(e);
}

int host_alloc_mapped(void** host, void** device, uint64_t bytes) {
  cudaError_t e = cudaHostAlloc(host, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
  if (e != cudaSuccess) return int(e);
  memset(*host, 0, bytes);
  e = cudaHostGetDevicePointer(device, *host, 0);
  if (e != cudaSuccess) (void)cudaFreeHost(*host);  // e is the error reported
  return int(e);
}

int host_free_mapped(void* host) { return int(cudaFreeHost(host)); }

int stream_capturing(void* stream, bool* capturing) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t e = cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status);
  if (e != cudaSuccess) (void)cudaGetLastError();  // e.g. the legacy stream while another stream captures globally
  *capturing = status != cudaStreamCaptureStatusNone;
  return int(e);
}

#if defined(__HIPCC__)
LLGraphs* ll_graphs_create() { return nullptr; }
void ll_graphs_destroy(LLGraphs*) {}
LLGraphCounts ll_graph_counts(const LLGraphs*) { return {}; }
#else
LLGraphs* ll_graphs_create() { return new LLGraphs; }
void ll_graphs_destroy(LLGraphs* graphs) { delete graphs; }
LLGraphCounts ll_graph_counts(const LLGraphs* graphs) {
  LLGraphCounts n;
  if (!graphs) return n;
  for (const GraphCache* g : {&graphs->dispatch, &graphs->combine}) {
    n.launches += g->launches;
    n.builds += g->builds;
    n.updates += g->updates;
  }
  return n;
}
#endif

}  // namespace portep::cuda
