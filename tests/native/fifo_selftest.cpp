// A self-contained exercise of the FIFO protocol with host producers: used by the unit tests and the
// channel benchmark to measure the FIFO alone, without transports.
#include "tests/native/fifo_selftest.h"

#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

namespace portep {

FifoSelftestResult fifo_selftest(int producers, uint64_t per_producer, uint32_t capacity, double timeout_s) {
  if (producers < 1 || producers > 4096) throw std::invalid_argument("producers must be in 1..4096");
  if (capacity < 64 || (capacity & (capacity - 1)))
    throw std::invalid_argument("capacity must be a power of two >= 64");
  std::vector<TransferCmd> entries(capacity, TransferCmd{0, 0});
  alignas(64) uint64_t head = 0;
  alignas(64) uint64_t tail = 0;
  uint32_t error_flag = 0;
  const FifoView f{entries.data(), &head, &tail, &error_flag, capacity};
  const int64_t timeout_ns = int64_t(timeout_s * 1e9);

  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int p = 0; p < producers; ++p)
    threads.emplace_back([&, p] {
      uint64_t cached = 0;
      for (uint64_t i = 0; i < per_producer; ++i) {
        // stream = producer, remote_off = sequence within the producer: the consumer checks both.
        CmdFields c{kOpWrite, 0, uint32_t(p % kMaxRanks), uint32_t(i % 4096), uint32_t(p), (i % (1ull << 32)) * 16, 16};
        TransferCmd cmd;
        cmd_encode(c, &cmd);
        if (!fifo_host_push(f, cmd, &cached, timeout_ns)) return;
      }
    });

  FifoSelftestResult r;
  std::vector<uint64_t> next(size_t(producers), 0);
  FifoConsumer consumer(f);
  const uint64_t total = uint64_t(producers) * per_producer;
  uint32_t idle = 0;
  while (r.popped < total) {
    TransferCmd cmd;
    if (!consumer.pop(&cmd)) {
      consumer.flush();
      if (__atomic_load_n(&error_flag, __ATOMIC_ACQUIRE)) break;
      if (++idle > 1000) std::this_thread::yield();
      if ((idle & 1023) == 0 && std::chrono::steady_clock::now() - start > std::chrono::nanoseconds(timeout_ns)) break;
      continue;
    }
    idle = 0;
    const CmdFields c = cmd_decode(cmd);
    ++r.popped;
    const uint64_t want = next[c.stream]++;
    if (c.op != kOpWrite || c.remote_off != (want % (1ull << 32)) * 16 || c.size != uint32_t(want % 4096))
      ++r.out_of_order;
  }
  consumer.flush();
  for (auto& t : threads) t.join();
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.producer_timeout = __atomic_load_n(&error_flag, __ATOMIC_ACQUIRE) != 0;
  return r;
}

}  // namespace portep
