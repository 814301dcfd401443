// GPU memory as a transport sees it: allocate a region peers can open (IPC), open theirs, make host memory
// GPU-visible, and move bytes with the copy engines on one stream per transport channel. One implementation
// per GPU runtime (transport/cuda_ipc, transport/hip_ipc), the one this build's kernels use, for the device a
// Channel is created on. Every call throws TransportError with the failing API call's message; nothing aborts.
//
// Threading: copy_async/record/done for one channel come from one proxy thread (the transport's contract);
// the other calls come from the thread that owns the Channel.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <memory>
#include <string>

namespace portep {

class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;

  virtual int device() const = 0;
  // Zeroed device memory, owned until free_region.
  virtual void* alloc_region(size_t bytes) = 0;
  virtual void free_region(void* p) = 0;
  // An opaque handle another process of this host can open, and opening / closing one.
  virtual std::string export_region(void* p) = 0;
  virtual void* open_peer_region(const std::string& handle) = 0;
  virtual void close_peer_region(void* p) = 0;
  // Every peer has opened this rank's region: names it was shared under may go.
  virtual void release_names() {}
  // Host memory (e.g. a shared-memory mapping) made readable and writable by kernels; returns the device
  // address. unmap_host undoes it.
  virtual void* map_host(void* host, size_t bytes) = 0;
  virtual void unmap_host(void* host) = 0;

  // Queues a device-to-device copy on channel's stream. Copies issued between two record() calls form a batch
  // that runs after the previous batch; within a batch they may run in any order (callers never give one
  // batch two copies to the same bytes).
  virtual void copy_async(int channel, void* dst, const void* src, size_t bytes) = 0;
  // Submits and marks everything issued on channel so far; done(ticket) is true once all of it has completed.
  virtual uint64_t record(int channel) = 0;
  virtual bool done(int channel, uint64_t ticket) = 0;
  // Waits for every channel's copies (teardown); never throws.
  virtual void synchronize() = 0;

  // For NIC registration (ibv_reg_dmabuf_mr): a dma-buf file descriptor covering [p, p + bytes), with *offset
  // the position of p in it, which the caller closes; -1 with *why when this memory or driver has none.
  virtual int export_dmabuf(void* p, size_t bytes, uint64_t* offset, std::string* why) {
    (void)p, (void)bytes, (void)offset;
    *why = "this device memory has no dma-buf export";
    return -1;
  }
  // Writes a NIC placed in this memory become visible to kernels that saw the completion signal in host
  // memory (GPUDirect RDMA leaves them unordered until a flush). Called before such a signal is published.
  virtual void flush_remote_writes() {}
};

// This build's GPU runtime's implementation for `device` with `channels` copy streams, or nullptr with *why set
// when the build has no GPU runtime or the device does not exist.
std::unique_ptr<DeviceMemory> make_gpu_device_memory(int device, int channels, std::string* why);

// Host memory posing as device memory, copies on worker threads with random delays (tests without a GPU).
// With nic_can_register false, regions are addresses no NIC can register (and nothing may touch), as GPU
// memory is without dma-buf or peer memory: only the verbs transports' host staging can use such a device.
std::unique_ptr<DeviceMemory> make_emulated_device_memory(int channels, uint64_t seed, bool nic_can_register);

}  // namespace portep
