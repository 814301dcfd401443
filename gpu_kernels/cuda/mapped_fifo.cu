// The mapped command FIFOs (proxy/fifo.h) in GPU-reachable memory, and the CUDA runtime queries of api.h.
#include "gpu_kernels/cuda/gpu_runtime.h"
#include <stdint.h>
#include <string.h>

#include "gpu_kernels/cuda/api.h"
#include "proxy/transfer_cmd.h"

namespace portep::cuda {
namespace {

template <typename T>
cudaError_t host_alloc_zeroed(T** p, size_t bytes) {
  void* raw = nullptr;
  const cudaError_t err = cudaHostAlloc(&raw, bytes, cudaHostAllocMapped);
  if (err != cudaSuccess) return err;
  memset(raw, 0, bytes);
  *p = static_cast<T*>(raw);
  return cudaSuccess;
}

template <typename T>
cudaError_t device_alias(T** dev, T* host) {
  void* raw = nullptr;
  const cudaError_t err = cudaHostGetDevicePointer(&raw, host, 0);
  if (err == cudaSuccess) *dev = static_cast<T*>(raw);
  return err;
}

cudaError_t alloc_into(uint32_t capacity, FifoView* h, FifoView* d) {
  cudaError_t err;
  if ((err = host_alloc_zeroed(&h->entries, sizeof(TransferCmd) * size_t(capacity))) != cudaSuccess) return err;
  if ((err = host_alloc_zeroed(&h->tail, sizeof(uint64_t))) != cudaSuccess) return err;
  if ((err = host_alloc_zeroed(&h->error_flag, sizeof(uint32_t))) != cudaSuccess) return err;
  void* head = nullptr;
  if ((err = cudaMalloc(&head, sizeof(uint64_t))) != cudaSuccess) return err;
  h->head = static_cast<uint64_t*>(head);
  if ((err = cudaMemset(head, 0, sizeof(uint64_t))) != cudaSuccess) return err;
  // The memset runs on the default stream; a kernel on a non-blocking stream would not wait for it.
  if ((err = cudaDeviceSynchronize()) != cudaSuccess) return err;
  if ((err = device_alias(&d->entries, h->entries)) != cudaSuccess) return err;
  if ((err = device_alias(&d->tail, h->tail)) != cudaSuccess) return err;
  if ((err = device_alias(&d->error_flag, h->error_flag)) != cudaSuccess) return err;
  d->head = h->head;
  h->capacity = capacity;
  d->capacity = capacity;
  return cudaSuccess;
}

}  // namespace

int cuda_device_count(int* count) {
  if (count == nullptr) return cudaErrorInvalidValue;
  return cudaGetDeviceCount(count);
}

const char* cuda_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

int alloc_mapped_fifo(uint32_t capacity, FifoView* host_view, FifoView* device_view) {
  if (host_view == nullptr || device_view == nullptr) return cudaErrorInvalidValue;
  *host_view = FifoView{};
  *device_view = FifoView{};
  if (capacity == 0 || (capacity & (capacity - 1)) != 0) return cudaErrorInvalidValue;
  const cudaError_t err = alloc_into(capacity, host_view, device_view);
  // The allocation error is the one worth reporting; a failure while undoing it adds nothing.
  if (err != cudaSuccess) (void)free_mapped_fifo(host_view, device_view);
  return err;
}

int free_mapped_fifo(FifoView* host_view, FifoView* device_view) {
  if (host_view == nullptr || device_view == nullptr) return cudaErrorInvalidValue;
  cudaError_t first = cudaSuccess;
  auto keep_first = [&first](cudaError_t e) {
    if (first == cudaSuccess) first = e;
  };
  if (host_view->entries) keep_first(cudaFreeHost(host_view->entries));
  if (host_view->tail) keep_first(cudaFreeHost(host_view->tail));
  if (host_view->error_flag) keep_first(cudaFreeHost(host_view->error_flag));
  if (host_view->head) keep_first(cudaFree(host_view->head));
  *host_view = FifoView{};
  *device_view = FifoView{};
  return first;
}

}  // namespace portep::cuda
