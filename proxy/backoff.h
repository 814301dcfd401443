// How host threads wait without burning the CPU that the thread they wait for needs: spin, then yield, then
// short sleeps (a yield with many runnable threads can cost a whole time slice, a short sleep does not).
#pragma once

#include <stdint.h>

#include <chrono>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PORTEP_CPU_RELAX() _mm_pause()
#else
#define PORTEP_CPU_RELAX() ((void)0)
#endif

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
  std::this_thread::sleep_for(
      std::chrono::microseconds(round < p.short_sleep_rounds ? p.short_sleep_us : p.long_sleep_us));
}

// A thread with nothing to do: busy-polls for `spin` of wall time first (a GPU proxy that sleeps adds the
// sleep, plus the kernel's timer slack, to every hop a command makes), then backs off as `policy` says.
class IdleWaiter {
 public:
  IdleWaiter(const BackoffPolicy& policy, std::chrono::nanoseconds spin) : policy_(policy), spin_(spin) {}
  void reset() { round_ = spun_ = 0; }
  void wait() {
    if (round_++ == 0) start_ = std::chrono::steady_clock::now();
    if (spin_.count() > 0 && spun_ == 0) {
      if (std::chrono::steady_clock::now() - start_ < spin_) {
        PORTEP_CPU_RELAX();
        return;
      }
      spun_ = round_;  // the policy's rounds (spin, yield, short sleeps) start counting here
    }
    backoff(policy_, round_ - spun_);
  }

 private:
  const BackoffPolicy& policy_;
  std::chrono::nanoseconds spin_;
  uint64_t round_ = 0;
  uint64_t spun_ = 0;  // rounds spent in the timed spin
  std::chrono::steady_clock::time_point start_{};
};

}  // namespace portep
