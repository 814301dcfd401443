// DeviceMemory over the HIP runtime (AMD GPUs): hipMalloc + HIP IPC handles for regions, hipHostRegister for
// host memory kernels poll, and hipMemcpyAsync on one non-blocking stream per channel for the copies, with a
// ring of events per channel to learn when they finished. Compiled with the HIP kernels; not yet run on an AMD
// GPU (see docs/backends.md, the HIP build).
#include <hip/hip_runtime.h>

#include <algorithm>
#include <string>
#include <vector>

#include "transport/device_memory.h"
#include "transport/own_regions.h"
#include "transport/transport.h"

namespace portep {

namespace {

constexpr uint32_t kEventsPerChannel = 256;

void check(hipError_t e, const char* what) {
  if (e != hipSuccess) throw TransportError(std::string("hip-ipc: ") + what + ": " + hipGetErrorString(e));
}

// Sets the device for one call from the owning thread and restores the caller's (torch keeps its own); quiet:
// teardown, never throws.
class DeviceGuard {
 public:
  DeviceGuard(int device, bool quiet) {
    if (hipGetDevice(&previous_) != hipSuccess) previous_ = -1;
    if (previous_ == device) return;
    const hipError_t e = hipSetDevice(device);
    if (!quiet) check(e, "hipSetDevice");
  }
  ~DeviceGuard() {
    if (previous_ >= 0) (void)hipSetDevice(previous_);
  }

 private:
  int previous_ = -1;
};

struct CopyChannel {
  hipStream_t stream = nullptr;
  std::vector<hipEvent_t> events;
  uint64_t recorded = 0;   // tickets 1..recorded have events
  uint64_t completed = 0;  // tickets 1..completed are known done
};

class HipDeviceMemory final : public DeviceMemory {
 public:
  HipDeviceMemory(int device, int channels) : device_(device), channels_(size_t(channels)) {
    DeviceGuard guard(device_, false);
    for (auto& c : channels_) {
      check(hipStreamCreateWithFlags(&c.stream, hipStreamNonBlocking), "hipStreamCreateWithFlags");
      c.events.resize(kEventsPerChannel);
      for (auto& e : c.events) check(hipEventCreateWithFlags(&e, hipEventDisableTiming), "hipEventCreate");
    }
  }

  ~HipDeviceMemory() override {
    DeviceGuard guard(device_, true);
    for (auto& c : channels_) {
      if (c.stream) (void)hipStreamSynchronize(c.stream);
      for (auto e : c.events)
        if (e) (void)hipEventDestroy(e);
      if (c.stream) (void)hipStreamDestroy(c.stream);
    }
  }

  int device() const override { return device_; }

  void synchronize() override {
    DeviceGuard guard(device_, true);
    for (auto& c : channels_)
      if (c.stream) (void)hipStreamSynchronize(c.stream);
  }

  void* alloc_region(size_t bytes) override {
    DeviceGuard guard(device_, false);
    void* p = nullptr;
    check(hipMalloc(&p, bytes), "hipMalloc");
    if (hipError_t e = hipMemset(p, 0, bytes); e != hipSuccess) {
      (void)hipFree(p);
      check(e, "hipMemset");
    }
    return p;
  }

  void free_region(void* p) override {
    DeviceGuard guard(device_, true);
    own_region_remove(p);
    if (p) (void)hipFree(p);
  }

  std::string export_region(void* p) override {
    DeviceGuard guard(device_, false);
    hipIpcMemHandle_t h;
    check(hipIpcGetMemHandle(&h, p), "hipIpcGetMemHandle");
    std::string handle(reinterpret_cast<const char*>(&h), sizeof(h));
    own_region_add(handle, p, device_);
    return handle;
  }

  void* open_peer_region(const std::string& handle) override {
    if (handle.size() != sizeof(hipIpcMemHandle_t))
      throw TransportError("hip-ipc: malformed IPC handle of " + std::to_string(handle.size()) + " bytes");
    DeviceGuard guard(device_, false);
    if (const OwnRegion own = own_region_find(handle); own.address) return open_own_region(own);
    hipIpcMemHandle_t h;
    std::copy(handle.begin(), handle.end(), reinterpret_cast<char*>(&h));
    void* p = nullptr;
    check(hipIpcOpenMemHandle(&p, h, hipIpcMemLazyEnablePeerAccess), "hipIpcOpenMemHandle");
    return p;
  }

  void close_peer_region(void* p) override {
    if (own_opened_.release(p)) return;  // a region of this process: its owner frees it
    DeviceGuard guard(device_, true);
    if (p) (void)hipIpcCloseMemHandle(p);
  }

  void* map_host(void* host, size_t bytes) override {
    DeviceGuard guard(device_, false);
    check(hipHostRegister(host, bytes, hipHostRegisterMapped | hipHostRegisterPortable), "hipHostRegister");
    void* d = nullptr;
    if (hipError_t e = hipHostGetDevicePointer(&d, host, 0); e != hipSuccess) {
      (void)hipHostUnregister(host);
      check(e, "hipHostGetDevicePointer");
    }
    return d;
  }

  void unmap_host(void* host) override {
    DeviceGuard guard(device_, true);
    if (host) (void)hipHostUnregister(host);
  }

  // No dma-buf export here (the NIC registers GPU memory through peer memory, else the verbs transports stage in
  // host memory), and no flush: NIC writes into AMD GPU memory are not yet known to be ordered for kernels that
  // saw a host-memory signal, so a transport that would need that refuses clearly.
  void flush_remote_writes() override {
    throw TransportError(
        "hip-ipc: NIC writes into AMD GPU memory are not verified to be visible in order to kernels "
        "(no flush); set PORTEP_IB_GPUDIRECT=0 to stage them in host memory");
  }

  void copy_async(int channel, void* dst, const void* src, size_t bytes) override {
    use_device();
    check(hipMemcpyAsync(dst, src, bytes, hipMemcpyDefault, at(channel).stream), "hipMemcpyAsync");
  }

  uint64_t record(int channel) override {
    use_device();
    CopyChannel& c = at(channel);
    if (c.recorded - c.completed >= kEventsPerChannel) {  // the ring is full: the oldest event must finish first
      check(hipEventSynchronize(c.events[(c.completed + 1) % kEventsPerChannel]), "hipEventSynchronize");
      ++c.completed;
    }
    const uint64_t ticket = ++c.recorded;
    check(hipEventRecord(c.events[ticket % kEventsPerChannel], c.stream), "hipEventRecord");
    return ticket;
  }

  bool done(int channel, uint64_t ticket) override {
    CopyChannel& c = at(channel);
    if (ticket <= c.completed) return true;
    if (ticket > c.recorded) throw TransportError("hip-ipc: ticket " + std::to_string(ticket) + " was never recorded");
    use_device();
    // Events of one stream complete in order: walking up from the oldest open ticket finds the new prefix.
    while (c.completed < ticket) {
      hipError_t e = hipEventQuery(c.events[(c.completed + 1) % kEventsPerChannel]);
      if (e == hipErrorNotReady) return false;
      check(e, "copy on the proxy's stream failed (hipEventQuery)");
      ++c.completed;
    }
    return true;
  }

 private:
  CopyChannel& at(int channel) {
    if (channel < 0 || size_t(channel) >= channels_.size())
      throw TransportError("hip-ipc: channel " + std::to_string(channel) + " out of range");
    return channels_[size_t(channel)];
  }

  // A peer rank's region in this very process: its address, reachable from this device once peer access is on.
  void* open_own_region(const OwnRegion& own) {
    if (own.device != device_) {
      int can = 0;
      check(hipDeviceCanAccessPeer(&can, device_, own.device), "hipDeviceCanAccessPeer");
      if (!can)
        throw TransportError("hip-ipc: GPU " + std::to_string(device_) + " cannot access GPU " +
                             std::to_string(own.device) + ", where a rank of this process holds its region");
      if (hipError_t e = hipDeviceEnablePeerAccess(own.device, 0); e == hipErrorPeerAccessAlreadyEnabled)
        (void)hipGetLastError();
      else
        check(e, "hipDeviceEnablePeerAccess");
    }
    own_opened_.add(own.address);
    return own.address;
  }

  // The runtime's current device is per thread: proxy threads set it on first use.
  void use_device() {
    thread_local int current = -1;
    if (current != device_) {
      check(hipSetDevice(device_), "hipSetDevice");
      current = device_;
    }
  }

  int device_;
  std::vector<CopyChannel> channels_;
  OwnRegionsOpened own_opened_;  // peer regions of this process, opened by address
};

}  // namespace

std::unique_ptr<DeviceMemory> make_gpu_device_memory(int device, int channels, std::string* why) {
  int count = 0;
  if (hipError_t e = hipGetDeviceCount(&count); e != hipSuccess) {
    if (why) *why = std::string("hipGetDeviceCount: ") + hipGetErrorString(e);
    return nullptr;
  }
  if (device < 0 || device >= count) {
    if (why) *why = "device " + std::to_string(device) + " is outside the " + std::to_string(count) + " HIP devices";
    return nullptr;
  }
  return std::make_unique<HipDeviceMemory>(device, channels);
}

}  // namespace portep
