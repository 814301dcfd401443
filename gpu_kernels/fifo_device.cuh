// GPU producer for the command FIFO in fifo.h; mirrors fifo_host_push. Call from one thread per producer
// (typically lane 0 of a warp); any number of threads may push into one FIFO.
#pragma once

#include <stdint.h>

#include "proxy/fifo.h"
#include "gpu_kernels/portability.cuh"
#include "proxy/transfer_cmd.h"

namespace portep {

// Reserves the next slot of f: cached_tail is the caller's private copy of f.tail (start it at 0: tail only
// grows, so a stale value is merely conservative). Returns false, raising kFifoErrorProducerTimeout, when no
// room appeared within timeout_ns; the reserved slot then stays empty and the consumer stops there.
PORTEP_DEVICE bool fifo_device_reserve(const FifoView& f, uint64_t* cached_tail, uint64_t timeout_ns, uint64_t* slot) {
  *slot = atomic_add_relaxed_gpu_u64(f.head, 1);
  if (*slot - *cached_tail < f.capacity) return true;
  const uint64_t start = globaltimer_ns();
  uint32_t backoff_ns = 32;
  for (;;) {
    // Acquire pairs with the consumer's release of tail: its zeroing of our slot happens before our store of
    // the command, so it cannot overwrite it.
    *cached_tail = ld_acquire_sys_u64(f.tail);
    if (*slot - *cached_tail < f.capacity) return true;
    if (globaltimer_ns() - start > timeout_ns) {
      atomic_or_relaxed_sys_u32(f.error_flag, kFifoErrorProducerTimeout);
      return false;
    }
    sleep_ns(backoff_ns);
    if (backoff_ns < 1024) backoff_ns *= 2;
  }
}

// Publishes cmd into a reserved slot. It orders no earlier write before it (st_publish_sys_cmd): a command
// that refers to data the caller wrote needs a fence_sys() before the push.
PORTEP_DEVICE void fifo_device_publish(const FifoView& f, uint64_t slot, const TransferCmd& cmd) {
  st_publish_sys_cmd(&f.entries[slot & (f.capacity - 1)], cmd);
}

PORTEP_DEVICE bool fifo_device_push(const FifoView& f, const TransferCmd& cmd, uint64_t* cached_tail,
                                    uint64_t timeout_ns) {
  uint64_t slot = 0;
  if (!fifo_device_reserve(f, cached_tail, timeout_ns, &slot)) return false;
  fifo_device_publish(f, slot, cmd);
  return true;
}

}  // namespace portep

namespace portep {

// fifo_device_push with the cached tail kept in device memory (one word per FIFO, shared by every pushing
// thread and every launch), so a FIFO that has wrapped does not cost each new producer a read of the host
// tail. A stale shared value is only conservative: the tail never decreases.
PORTEP_DEVICE bool fifo_device_push_shared_tail(const FifoView& f, const TransferCmd& cmd, uint64_t* shared_tail,
                                                uint64_t timeout_ns) {
  uint64_t cached = *reinterpret_cast<volatile uint64_t*>(shared_tail);
  const uint64_t before = cached;
  const bool ok = fifo_device_push(f, cmd, &cached, timeout_ns);
  if (cached != before) atomic_max_relaxed_gpu_u64(shared_tail, cached);
  return ok;
}

}  // namespace portep
