// The command FIFO: one memory layout for two producers (a GPU kernel, fifo_device.cuh, or host threads,
// below) and one host consumer (the proxy thread that owns the FIFO).
//
// Layout and protocol:
//   entries[capacity]  16-byte TransferCmd slots in host memory (pinned and GPU-mapped on GPU backends).
//                      All-zero means empty; opcode 0 is never valid, so lo != 0 marks a published command.
//   head               reservation counter: producers take slot = fetch_add(head, 1). Device memory on a GPU,
//                      host memory for host producers. Only producers touch it.
//   tail               host memory, written only by the consumer: how many entries it has consumed and zeroed.
//                      Producers may reuse slot s once s - tail < capacity.
//   error_flag         host memory: a producer that timed out waiting for room sets it (never spins forever).
//
// Publish (host producer): store hi (relaxed), then lo (release). A GPU publishes both words with one
// 128-bit system-scope store that orders no earlier write (a kernel fences before a command that refers to its
// data). Consume: load lo (acquire); non-zero => read hi, zero the slot, advance tail.
#pragma once

#include <stdint.h>

#include "proxy/transfer_cmd.h"

namespace portep {

struct FifoView {
  TransferCmd* entries;
  uint64_t* head;
  uint64_t* tail;
  uint32_t* error_flag;
  uint32_t capacity;  // power of two
};

enum FifoErrorBits : uint32_t {
  kFifoErrorProducerTimeout = 1u << 0,
  kFifoErrorConsumerTimeout = 1u << 1,
};

}  // namespace portep

#if !defined(__CUDA_ARCH__) && !defined(__HIP_DEVICE_COMPILE__)
#include <chrono>
#include <thread>

namespace portep {

// Host producer: any number of threads may push into one FIFO. Returns false (and raises the error flag)
// when no room appeared within timeout_ns.
inline bool fifo_host_push(const FifoView& f, const TransferCmd& cmd, uint64_t* cached_tail, int64_t timeout_ns) {
  const uint64_t slot = __atomic_fetch_add(f.head, 1, __ATOMIC_RELAXED);
  if (slot - *cached_tail >= f.capacity) {
    auto start = std::chrono::steady_clock::now();
    uint32_t spins = 0;
    for (;;) {
      *cached_tail = __atomic_load_n(f.tail, __ATOMIC_ACQUIRE);
      if (slot - *cached_tail < f.capacity) break;
      if (++spins < 64) continue;
      std::this_thread::yield();
      if ((spins & 255) == 0 && std::chrono::steady_clock::now() - start > std::chrono::nanoseconds(timeout_ns)) {
        __atomic_fetch_or(f.error_flag, kFifoErrorProducerTimeout, __ATOMIC_RELEASE);
        return false;
      }
    }
  }
  TransferCmd* e = &f.entries[slot & (f.capacity - 1)];
  __atomic_store_n(&e->hi, cmd.hi, __ATOMIC_RELAXED);
  __atomic_store_n(&e->lo, cmd.lo, __ATOMIC_RELEASE);
  return true;
}

// Host consumer, owned by exactly one proxy thread. Publishes the tail in batches to keep the
// producers' cache lines quiet; flush() publishes whatever is pending.
class FifoConsumer {
 public:
  explicit FifoConsumer(const FifoView& f) : f_(f), tail_(__atomic_load_n(f.tail, __ATOMIC_ACQUIRE)) {}

  bool pop(TransferCmd* out) {
    TransferCmd* e = &f_.entries[tail_ & (f_.capacity - 1)];
    const uint64_t lo = __atomic_load_n(&e->lo, __ATOMIC_ACQUIRE);
    if (lo == 0) return false;
    out->lo = lo;
    out->hi = __atomic_load_n(&e->hi, __ATOMIC_RELAXED);
    __atomic_store_n(&e->hi, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&e->lo, 0, __ATOMIC_RELAXED);
    ++tail_;
    if (++unpublished_ >= kPublishEvery) flush();
    return true;
  }

  void flush() {
    if (unpublished_ == 0) return;
    // Release: the zeroing of every consumed slot is visible before producers may reuse it.
    __atomic_store_n(f_.tail, tail_, __ATOMIC_RELEASE);
    unpublished_ = 0;
  }

  uint64_t tail() const { return tail_; }

 private:
  static constexpr uint32_t kPublishEvery = 32;
  FifoView f_;
  uint64_t tail_;
  uint32_t unpublished_ = 0;
};

}  // namespace portep
#endif
