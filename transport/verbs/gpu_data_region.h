// The data region of a verbs transport (RC and EFA SRD alike) whose data kernels read and write
// (VerbsOptions::device). The NIC reaches it by the first of these that works:
//   1. GPU memory registered through the GPU's dma-buf (ibv_reg_dmabuf_mr);
//   2. GPU memory registered by its device pointer (ibv_reg_mr; needs a peer-memory client such as
//      nvidia-peermem);
//   3. host staging: pinned host pages that the NIC registers as ordinary memory and that kernels reach through
//      their GPU mapping, as NCCL's buffers sit when GPUDirect RDMA is off. The kernels' own copies between the
//      user's tensors and this buffer are the staging copies, so the proxies need no extra copy and the
//      receiver no record of which ranges a peer wrote.
// VerbsOptions::gpudirect = false (PORTEP_IB_GPUDIRECT=0) goes straight to 3, for machines whose GPUDirect
// path misbehaves. The error when all three fail names each reason.
#pragma once

#include <errno.h>
#include <infiniband/verbs.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <string>

#include "transport/device_memory.h"
#include "transport/transport.h"
#include "transport/verbs/verbs_common.h"
#include "transport/verbs/verbs_library.h"

namespace portep::verbs {

class GpuDataRegion {
 public:
  // Allocates and registers r->bytes (rounded up to whole GPU pages for 1 and 2) with `access`.
  void allocate(ibv_pd* pd, Region* r, DeviceMemory* device, int access, bool gpudirect) {
    device_ = device;
    std::string gpu_why = "GPUDirect RDMA turned off (PORTEP_IB_GPUDIRECT=0)";
    if (gpudirect && try_gpu_memory(pd, r, access, &gpu_why)) return;
    stage_in_host_memory(pd, r, access, gpu_why);
  }

  // Where kernels address `region`: this data region (r), or the host signal region through its GPU mapping.
  void* kernel_address(RegionId region, const Region& r, void* device_signal) const {
    if (region != kRegionData) return device_signal;
    return staged_ ? kernel_view_ : r.addr;
  }
  // "dma-buf", "peer memory (...)" or "host staging (...)", for describe_peer.
  const std::string& how() const { return how_; }

  // Before a proxy publishes a signal whose writes the NIC placed here: GPUDirect writes into GPU memory are
  // unordered with the signal until flushed; staged writes went to host memory, which needs nothing.
  void flush_nic_writes() const {
    if (device_ && !staged_) device_->flush_remote_writes();
  }

  void release(Region* r) {
    if (r->mr) verbs::ibv().dereg_mr(r->mr);
    if (staged_) {
      if (kernel_view_) device_->unmap_host(r->addr);
      if (r->addr) munmap(r->addr, r->bytes);
    } else if (r->addr) {
      device_->free_region(r->addr);
    }
    *r = Region{};
    kernel_view_ = nullptr;
    staged_ = false;
  }

 private:
  // 1 and 2 in whole 2 MiB GPU pages (a dma-buf export covers whole pages). False with *why naming both
  // failures; the GPU memory is then freed again.
  bool try_gpu_memory(ibv_pd* pd, Region* r, int access, std::string* why) {
    constexpr size_t kGpuPage = 2u << 20;
    const size_t asked = r->bytes;
    r->bytes = (asked + kGpuPage - 1) / kGpuPage * kGpuPage;
    r->addr = device_->alloc_region(r->bytes);
    std::string dmabuf_why = register_by_dmabuf(pd, r, access);
    if (r->mr) return true;
    r->mr = verbs::ibv().reg_mr(pd, r->addr, r->bytes, access);
    if (r->mr) {
      how_ = "peer memory (ibv_reg_mr on the device pointer)";
      return true;
    }
    const int err = errno;
    *why = "dma-buf: " + dmabuf_why + "; ibv_reg_mr on the device pointer: " + strerror(err) +
           " (is a peer-memory module such as nvidia-peermem loaded?)";
    device_->free_region(r->addr);
    *r = Region{};
    r->bytes = asked;
    return false;
  }

  // Registration through the GPU's dma-buf; on failure r->mr stays null and the reason is returned.
  std::string register_by_dmabuf(ibv_pd* pd, Region* r, int access) {
    if (!verbs::ibv().reg_dmabuf_mr) return "this machine's libibverbs has no ibv_reg_dmabuf_mr (rdma-core < 34)";
    std::string why;
    uint64_t offset = 0;
    const int fd = device_->export_dmabuf(r->addr, r->bytes, &offset, &why);
    if (fd < 0) return why;
    r->mr = verbs::ibv().reg_dmabuf_mr(pd, offset, r->bytes, reinterpret_cast<uintptr_t>(r->addr), fd, access);
    const int err = errno;
    close(fd);  // the registration holds its own reference to the buffer
    if (r->mr) {
      how_ = "dma-buf";
      return {};
    }
    return std::string("ibv_reg_dmabuf_mr: ") + strerror(err);
  }

  // 3: private host pages (never shared through /dev/shm: peers reach them through RDMA, as they would GPU
  // memory), registered with the NIC and mapped for kernels.
  void stage_in_host_memory(ibv_pd* pd, Region* r, int access, const std::string& gpu_why) {
    r->addr = alloc_pages(r->bytes);
    staged_ = true;
    try {
      register_region(pd, r, access);
      kernel_view_ = device_->map_host(r->addr, r->bytes);
    } catch (const TransportError& e) {
      release(r);
      throw TransportError(std::string("verbs: cannot place the GPU data region: in GPU memory: ") + gpu_why +
                           "; in host staging memory: " + e.what());
    }
    how_ = "host staging (pinned host memory mapped for kernels; GPU memory: " + gpu_why + ")";
  }

  DeviceMemory* device_ = nullptr;
  bool staged_ = false;
  void* kernel_view_ = nullptr;  // the staged pages as kernels address them
  std::string how_;
};

}  // namespace portep::verbs
