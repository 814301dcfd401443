// How host threads wait without burning the CPU that the thread they wait for needs: spin, then yield, then
// short sleeps (a yield with many runnable threads can cost a whole time slice, a short sleep does not).
#pragma once

#include <stdint.h>

#include <chrono>
#include <thread>

namespace portep {

struct BackoffPolicy {
  uint64_t spin_rounds;
  uint64_t yield_rounds;
  uint64_t short_sleep_rounds;
  int short_sleep_us;
  int long_sleep_us;
};

// Proxy threads with nothing to do; host waits for a peer (more patient spinning: the answer is often close).
constexpr BackoffPolicy kIdleProxy{64, 256, 4096, 10, 50};
constexpr BackoffPolicy kHostWait{256, 1024, 8192, 5, 20};

inline void backoff(const BackoffPolicy& p, uint64_t round) {
  if (round < p.spin_rounds) return;
  if (round < p.yield_rounds) {
    std::this_thread::yield();
    return;
  }
  std::this_thread::sleep_for(std::chrono::microseconds(round < p.short_sleep_rounds ? p.short_sleep_us : p.long_sleep_us));
}

}  // namespace portep
