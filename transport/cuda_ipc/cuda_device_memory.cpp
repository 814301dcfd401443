// DeviceMemory over the CUDA runtime: cudaMalloc + CUDA IPC handles for regions, cudaHostRegister for
// host memory kernels poll, and cudaMemcpyAsync on one non-blocking stream per channel for the copies, with
// a ring of events per channel to learn when they finished.
#include <cuda.h>
#include <cuda_runtime.h>
#include <string.h>
#include <unistd.h>

#include <atomic>
#include <vector>

#include "transport/cuda_ipc/cuda_util.h"
#include "transport/device_memory.h"
#include "transport/own_regions.h"
#include "transport/transport.h"

namespace portep {

namespace {

constexpr uint32_t kEventsPerChannel = 256;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw TransportError(std::string("cuda-ipc: ") + what + ": " + cudaGetErrorString(e));
}

struct DeviceGuard : CudaDeviceGuard {
  explicit DeviceGuard(int device) : CudaDeviceGuard(device, "cuda-ipc") {}
};

struct DeviceGuardQuiet : CudaDeviceGuard {  // teardown: best effort, never throws
  explicit DeviceGuardQuiet(int device) : CudaDeviceGuard(device, "cuda-ipc", true) {}
};

struct CopyChannel {
  cudaStream_t stream = nullptr;
  std::vector<void*> dsts;  // copies issued since the last record, submitted together when it comes
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
  std::vector<cudaEvent_t> events;
  uint64_t recorded = 0;   // tickets 1..recorded have events
  uint64_t completed = 0;  // tickets 1..completed are known done
};

class CudaDeviceMemory final : public DeviceMemory {
 public:
  CudaDeviceMemory(int device, int channels) : device_(device), channels_(size_t(channels)) {
    DeviceGuard guard(device_);
    for (auto& c : channels_) {
      check(cudaStreamCreateWithFlags(&c.stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
      c.events.resize(kEventsPerChannel);
      for (auto& e : c.events) check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
    }
  }

  ~CudaDeviceMemory() override {
    DeviceGuardQuiet guard(device_);
    for (auto& c : channels_) {
      if (c.stream) cudaStreamSynchronize(c.stream);
      for (auto e : c.events)
        if (e) cudaEventDestroy(e);
      if (c.stream) cudaStreamDestroy(c.stream);
    }
    if (scratch_) cudaFree(scratch_);
  }

  int device() const override { return device_; }

  void synchronize() override {
    DeviceGuardQuiet guard(device_);
    for (auto& c : channels_) {
      try {
        submit_copies(c);
      } catch (const TransportError&) {  // teardown: the copies are abandoned either way
      }
      if (c.stream) cudaStreamSynchronize(c.stream);
    }
  }

  void* alloc_region(size_t bytes) override {
    DeviceGuard guard(device_);
    void* p = nullptr;
    check(cudaMalloc(&p, bytes), "cudaMalloc");
    if (cudaError_t e = cudaMemset(p, 0, bytes); e != cudaSuccess) {
      cudaFree(p);
      check(e, "cudaMemset");
    }
    return p;
  }

  void free_region(void* p) override {
    DeviceGuardQuiet guard(device_);
    own_region_remove(p);
    if (p) cudaFree(p);
  }

  std::string export_region(void* p) override {
    DeviceGuard guard(device_);
    cudaIpcMemHandle_t h;
    check(cudaIpcGetMemHandle(&h, p), "cudaIpcGetMemHandle");
    std::string handle(reinterpret_cast<const char*>(&h), sizeof(h));
    own_region_add(handle, p, device_);
    return handle;
  }

  void* open_peer_region(const std::string& handle) override {
    if (handle.size() != sizeof(cudaIpcMemHandle_t))
      throw TransportError("cuda-ipc: malformed IPC handle of " + std::to_string(handle.size()) + " bytes");
    DeviceGuard guard(device_);
    if (const OwnRegion own = own_region_find(handle); own.address) return open_own_region(own);
    cudaIpcMemHandle_t h;
    memcpy(&h, handle.data(), sizeof(h));
    void* p = nullptr;
    check(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
    try {
      touch_peer(p);
    } catch (...) {
      cudaIpcCloseMemHandle(p);
      throw;
    }
    return p;
  }

  void close_peer_region(void* p) override {
    if (own_opened_.release(p)) return;  // a region of this process: its owner frees it
    DeviceGuardQuiet guard(device_);
    if (p) cudaIpcCloseMemHandle(p);
  }

  void* map_host(void* host, size_t bytes) override {
    DeviceGuard guard(device_);
    check(cudaHostRegister(host, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable), "cudaHostRegister");
    void* d = nullptr;
    if (cudaError_t e = cudaHostGetDevicePointer(&d, host, 0); e != cudaSuccess) {
      cudaHostUnregister(host);
      check(e, "cudaHostGetDevicePointer");
    }
    return d;
  }

  void unmap_host(void* host) override {
    DeviceGuardQuiet guard(device_);
    if (host) cudaHostUnregister(host);
  }

  // The driver's cuMemGetHandleForAddressRange through the runtime's entry-point lookup (no link to libcuda);
  // the range is widened to host pages, as it requires.
  int export_dmabuf(void* p, size_t bytes, uint64_t* offset, std::string* why) override {
    using GetHandle = CUresult (*)(void*, CUdeviceptr, size_t, CUmemRangeHandleType, unsigned long long);
    DeviceGuard guard(device_);
    void* fn = cuda_driver_entry("cuMemGetHandleForAddressRange", 11070);
    if (!fn) {
      *why = "the driver has no cuMemGetHandleForAddressRange (CUDA 11.7+)";
      return -1;
    }
    int supported = 0;
    // The runtime's attribute numbers are the driver's; this one has no runtime name.
    if (cuda_attribute(static_cast<cudaDeviceAttr>(CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED), &supported) && !supported) {
      *why = "GPU " + std::to_string(device_) + " reports no dma-buf support";
      return -1;
    }
    const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
    const uintptr_t begin = reinterpret_cast<uintptr_t>(p) / page * page;
    const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes + page - 1) / page * page;
    int fd = -1;
    const CUresult r = reinterpret_cast<GetHandle>(fn)(&fd, CUdeviceptr(begin), size_t(end - begin),
                                                       CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
    if (r != CUDA_SUCCESS || fd < 0) {
      *why = "cuMemGetHandleForAddressRange(DMA_BUF_FD) failed with CUresult " + std::to_string(int(r));
      return -1;
    }
    *offset = uint64_t(reinterpret_cast<uintptr_t>(p) - begin);
    return fd;
  }

  // Only where the GPU does not already order GPUDirect RDMA writes for its own kernels (the attribute says);
  // a GPU that neither orders them nor can flush them cannot take NIC writes safely, and says so.
  void flush_remote_writes() override {
    use_device();
    RdmaFlush mode = rdma_flush_.load(std::memory_order_relaxed);
    if (mode == RdmaFlush::kUnknown) rdma_flush_.store(mode = rdma_flush_mode(), std::memory_order_relaxed);
    if (mode == RdmaFlush::kNotNeeded) return;
    if (mode == RdmaFlush::kUnsupported)
      throw TransportError("cuda-ipc: GPU " + std::to_string(device_) +
                           " neither orders GPUDirect RDMA writes for "
                           "its kernels nor supports cudaDeviceFlushGPUDirectRDMAWrites");
    check(cudaDeviceFlushGPUDirectRDMAWrites(cudaFlushGPUDirectRDMAWritesTargetCurrentDevice,
                                             cudaFlushGPUDirectRDMAWritesToOwner),
          "cudaDeviceFlushGPUDirectRDMAWrites");
  }

  void copy_async(int channel, void* dst, const void* src, size_t bytes) override {
    CopyChannel& c = at(channel);
    c.dsts.push_back(dst);
    c.srcs.push_back(src);
    c.sizes.push_back(bytes);
  }

  uint64_t record(int channel) override {
    use_device();
    CopyChannel& c = at(channel);
    submit_copies(c);
    if (c.recorded - c.completed >= kEventsPerChannel) {  // the ring is full: the oldest event must finish first
      check(cudaEventSynchronize(c.events[(c.completed + 1) % kEventsPerChannel]), "cudaEventSynchronize");
      ++c.completed;
    }
    const uint64_t ticket = ++c.recorded;
    check(cudaEventRecord(c.events[ticket % kEventsPerChannel], c.stream), "cudaEventRecord");
    return ticket;
  }

  bool done(int channel, uint64_t ticket) override {
    CopyChannel& c = at(channel);
    if (ticket <= c.completed) return true;
    if (ticket > c.recorded) throw TransportError("cuda-ipc: ticket " + std::to_string(ticket) + " was never recorded");
    use_device();
    // Events of one stream complete in order: walking up from the oldest open ticket finds the new prefix.
    while (c.completed < ticket) {
      cudaError_t e = cudaEventQuery(c.events[(c.completed + 1) % kEventsPerChannel]);
      if (e == cudaErrorNotReady) return false;
      check(e, "copy on the proxy's stream failed (cudaEventQuery)");
      ++c.completed;
    }
    return true;
  }

 private:
  CopyChannel& at(int channel) {
    if (channel < 0 || size_t(channel) >= channels_.size())
      throw TransportError("cuda-ipc: channel " + std::to_string(channel) + " out of range");
    return channels_[size_t(channel)];
  }
  // A peer rank's region in this very process: its address, reachable from this device once peer access is on.
  void* open_own_region(const OwnRegion& own) {
    if (own.device != device_) {
      int can = 0;
      check(cudaDeviceCanAccessPeer(&can, device_, own.device), "cudaDeviceCanAccessPeer");
      if (!can)
        throw TransportError("cuda-ipc: GPU " + std::to_string(device_) + " cannot access GPU " +
                             std::to_string(own.device) + ", where a rank of this process holds its region");
      if (cudaError_t e = cudaDeviceEnablePeerAccess(own.device, 0); e == cudaErrorPeerAccessAlreadyEnabled)
        cudaGetLastError();
      else
        check(e, "cudaDeviceEnablePeerAccess");
    }
    own_opened_.add(own.address);
    return own.address;
  }

  // A first copy from the peer's region, now, while this GPU is idle: the driver enables peer access lazily on
  // first use, and doing that during a proxy's first copy can wait for a running kernel, which may be the
  // receive kernel waiting for that very copy's peer.
  void touch_peer(const void* peer) {
    if (!scratch_) check(cudaMalloc(&scratch_, 16), "cudaMalloc (peer warm-up)");
    cudaStream_t stream = channels_.empty() ? nullptr : channels_[0].stream;
    check(cudaMemcpyAsync(scratch_, peer, 16, cudaMemcpyDefault, stream), "cudaMemcpyAsync (peer warm-up)");
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize (peer warm-up)");
  }

  // One driver call for every copy queued on the channel (a proxy drains many WRITE commands per poll; a
  // cudaMemcpyAsync each costs microseconds of CPU time on the proxy's critical path).
  void submit_copies(CopyChannel& c) {
    const size_t n = c.sizes.size();
    if (n == 0) return;
    cudaError_t e = cudaSuccess;
#if CUDART_VERSION >= 13000  // 12.8/12.9 declare another signature (failIdx)
    if (n > 1 && batch_supported_.load(std::memory_order_relaxed)) {
      cudaMemcpyAttributes attr{};
      attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      size_t attr_index = 0;
      e = cudaMemcpyBatchAsync(c.dsts.data(), c.srcs.data(), c.sizes.data(), n, &attr, &attr_index, 1, c.stream);
      if (e == cudaErrorNotSupported || e == cudaErrorInvalidValue ||
          e == cudaErrorCallRequiresNewerDriver) {  // older driver: one call per copy
        cudaGetLastError();
        batch_supported_.store(false, std::memory_order_relaxed);
      } else {
        clear_copies(c);
        check(e, "cudaMemcpyBatchAsync");
        return;
      }
    }
#endif
    for (size_t i = 0; i < n && e == cudaSuccess; ++i)
      e = cudaMemcpyAsync(c.dsts[i], c.srcs[i], c.sizes[i], cudaMemcpyDefault, c.stream);
    clear_copies(c);
    check(e, "cudaMemcpyAsync");
  }
  static void clear_copies(CopyChannel& c) {
    c.dsts.clear();
    c.srcs.clear();
    c.sizes.clear();
  }

  // An attribute of this GPU; false when the query itself failed (older runtimes lack some attributes), with
  // the failure cleared so that it never surfaces as a later call's error.
  bool cuda_attribute(cudaDeviceAttr attr, int* value) const {
    if (cudaDeviceGetAttribute(value, attr, device_) == cudaSuccess) return true;
    cudaGetLastError();
    return false;
  }

  enum class RdmaFlush { kUnknown, kNotNeeded, kNeeded, kUnsupported };
  RdmaFlush rdma_flush_mode() const {
    int ordering = 0, options = 0;
    if (cuda_attribute(cudaDevAttrGPUDirectRDMAWritesOrdering, &ordering) &&
        ordering >= int(cudaGPUDirectRDMAWritesOrderingOwner))
      return RdmaFlush::kNotNeeded;
    if (cuda_attribute(cudaDevAttrGPUDirectRDMAFlushWritesOptions, &options) &&
        (options & int(cudaFlushGPUDirectRDMAWritesOptionHost)))
      return RdmaFlush::kNeeded;
    return RdmaFlush::kUnsupported;
  }

  // The runtime's current device is per thread: proxy threads set it on first use. They also leave the global
  // stream-capture interaction mode: while the application captures a CUDA graph in global mode (torch's
  // default), a proxy's event queries and copies for work issued before the capture must neither fail nor
  // invalidate that capture (NCCL's proxy threads do the same).
  void use_device() {
    thread_local int current = -1;
    if (current != device_) {
      check(cudaSetDevice(device_), "cudaSetDevice");
      cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
      check(cudaThreadExchangeStreamCaptureMode(&mode), "cudaThreadExchangeStreamCaptureMode");
      current = device_;
    }
  }
  int device_;
  std::vector<CopyChannel> channels_;
  void* scratch_ = nullptr;                                 // 16 bytes for the peer warm-up copies
  OwnRegionsOpened own_opened_;                             // peer regions of this process, opened by address
  std::atomic<RdmaFlush> rdma_flush_{RdmaFlush::kUnknown};  // decided by the first proxy publishing NIC writes
  std::atomic<bool> batch_supported_{true};                 // proxy threads clear it on a driver without batched copies
};

}  // namespace

std::unique_ptr<DeviceMemory> make_gpu_device_memory(int device, int channels, std::string* why) {
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    if (why) *why = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(e);
    return nullptr;
  }
  if (device < 0 || device >= count) {
    if (why) *why = "device " + std::to_string(device) + " is outside the " + std::to_string(count) + " CUDA devices";
    return nullptr;
  }
  return std::make_unique<CudaDeviceMemory>(device, channels);
}

}  // namespace portep
