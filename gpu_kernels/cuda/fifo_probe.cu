#include "gpu_runtime.h"
#include <stdint.h>
#include <string.h>

#include "api.h"
#include "portep/fifo_device.cuh"
#include "portep/portability.cuh"
#include "portep/transfer_cmd.h"

namespace portep::cuda {
namespace {

constexpr int kProbeBlockThreads = 256;

__global__ void fifo_probe_kernel(const FifoView* fifos, int num_fifos, int commands_per_warp, int warps,
                                  int dst_rank_modulo, uint64_t timeout_ns, uint32_t op) {
  if (threadIdx.x % kWarpSize != 0) return;
  const int warp = int((blockIdx.x * uint64_t(blockDim.x) + threadIdx.x) / kWarpSize);
  if (warp >= warps) return;
  const FifoView f = fifos[warp % num_fifos];
  uint64_t cached_tail = 0;
  for (int i = 0; i < commands_per_warp; ++i) {
    CmdFields c;
    c.op = op;
    c.flags = 0;
    c.dst_rank = uint32_t(warp % dst_rank_modulo);
    c.size = 16;
    c.stream = uint32_t(warp);
    c.remote_off = 16ull * uint64_t(i % 1024);
    c.local_off = c.remote_off;
    TransferCmd cmd;
    if (cmd_encode(c, &cmd) != kEncodeOk) return;
    if (!fifo_device_push(f, cmd, &cached_tail, timeout_ns)) return;
  }
}

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

int launch_fifo_probe(const FifoProbeArgs& a) {
  if (a.fifos == nullptr || a.num_fifos < 1 || a.commands_per_warp < 0 || a.warps < 0 ||
      uint32_t(a.warps) > kMaxStreams || a.dst_rank_modulo < 1 || uint32_t(a.dst_rank_modulo) > kMaxRanks) {
    return cudaErrorInvalidValue;
  }
  if (a.warps == 0 || a.commands_per_warp == 0) return cudaSuccess;
  const long long threads = (long long)a.warps * kWarpSize;
  const unsigned blocks = unsigned((threads + kProbeBlockThreads - 1) / kProbeBlockThreads);
  fifo_probe_kernel<<<blocks, kProbeBlockThreads, 0, static_cast<cudaStream_t>(a.stream)>>>(
      a.fifos, a.num_fifos, a.commands_per_warp, a.warps, a.dst_rank_modulo, a.timeout_ns,
      a.nop ? uint32_t(kOpNop) : uint32_t(kOpWrite));
  return cudaGetLastError();
}

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
