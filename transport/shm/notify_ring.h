// Single-producer single-consumer ring of 32-bit immediates in shared memory: how a write-with-imm
// notification reaches the receiving process. One ring per (source rank, channel) inside the receiver's
// inbox segment. Producer: the source's proxy thread of that channel. Consumer: the receiver's.
//
// Layout of one ring (kRingBytes):  [0,8) head  |  [64,72) tail  |  [128, 128 + 4*kRingSlots) records
// head/tail are free-running counters; slot = counter % kRingSlots. The producer writes the record, then
// release-stores head; the consumer acquire-loads head, reads records, then release-stores tail.
#pragma once

#include <stdint.h>

namespace portep {

constexpr uint32_t kRingSlots = 8192;
constexpr uint32_t kRingHeaderBytes = 128;
constexpr uint64_t kRingBytes = kRingHeaderBytes + 4ull * kRingSlots;

struct NotifyRingView {
  uint64_t* head;
  uint64_t* tail;
  uint32_t* records;

  static NotifyRingView at(void* base) {
    char* p = static_cast<char*>(base);
    return NotifyRingView{reinterpret_cast<uint64_t*>(p), reinterpret_cast<uint64_t*>(p + 64),
                          reinterpret_cast<uint32_t*>(p + kRingHeaderBytes)};
  }
};

class NotifyRingProducer {
 public:
  NotifyRingProducer() = default;
  explicit NotifyRingProducer(NotifyRingView r) : r_(r), head_(__atomic_load_n(r.head, __ATOMIC_RELAXED)) {}

  bool push(uint32_t imm) {
    if (head_ - cached_tail_ >= kRingSlots) {
      cached_tail_ = __atomic_load_n(r_.tail, __ATOMIC_ACQUIRE);
      if (head_ - cached_tail_ >= kRingSlots) return false;
    }
    r_.records[head_ % kRingSlots] = imm;
    ++head_;
    // Release: the record, and every data byte this thread copied before it, are visible with the head.
    __atomic_store_n(r_.head, head_, __ATOMIC_RELEASE);
    return true;
  }

 private:
  NotifyRingView r_{};
  uint64_t head_ = 0;
  uint64_t cached_tail_ = 0;
};

class NotifyRingConsumer {
 public:
  NotifyRingConsumer() = default;
  explicit NotifyRingConsumer(NotifyRingView r) : r_(r), tail_(__atomic_load_n(r.tail, __ATOMIC_RELAXED)) {}

  // Copies up to max records into out; returns how many.
  int pop(uint32_t* out, int max) {
    const uint64_t head = __atomic_load_n(r_.head, __ATOMIC_ACQUIRE);
    int n = 0;
    while (tail_ != head && n < max) out[n++] = r_.records[tail_++ % kRingSlots];
    if (n) __atomic_store_n(r_.tail, tail_, __ATOMIC_RELEASE);
    return n;
  }

 private:
  NotifyRingView r_{};
  uint64_t tail_ = 0;
};

}  // namespace portep
