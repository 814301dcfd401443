#include "tests/native/channel_traffic.h"

#include <string.h>

#include <chrono>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <thread>

namespace portep {

namespace {
using Clock = std::chrono::steady_clock;

uint64_t mix(uint64_t x) {  // splitmix64 finalizer
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

struct Geometry {
  int n, P, M;
  uint32_t S;
  uint64_t recv_base;
  Geometry(const TrafficPlan& p, int num_ranks)
      : n(num_ranks), P(p.producers), M(p.messages_per_producer), S((p.max_message_bytes + 15) / 16 * 16) {
    recv_base = uint64_t(n) * P * M * S;
  }
  uint64_t send_off(int p, int dst, int m) const { return ((uint64_t(p) * n + dst) * M + m) * S; }
  uint64_t recv_off(int src, int p, int m) const { return recv_base + ((uint64_t(src) * P + p) * M + m) * S; }
};

uint64_t message_key(const TrafficPlan& plan, int src, int p, int dst, int m) {
  return mix(plan.seed ^ mix((uint64_t(src) << 48) ^ (uint64_t(p) << 32) ^ (uint64_t(dst) << 20) ^ uint64_t(m)));
}
uint32_t message_len(const TrafficPlan& plan, uint64_t key) {
  return 1 + uint32_t(mix(key ^ 0xA5A5) % plan.max_message_bytes);
}
uint8_t message_byte(uint64_t key, uint32_t i) { return uint8_t(mix(key ^ (uint64_t(i / 8) << 8)) >> (8 * (i % 8))); }
int dst_of(const TrafficPlan& plan, int src, int p, int k, int n) {
  return int(mix(plan.seed ^ mix(0xD57ull << 52 ^ uint64_t(src) << 32 ^ uint64_t(p) << 24 ^ uint64_t(k))) %
             uint64_t(n));
}
bool signal_after(const TrafficPlan& plan, int src, int p, int k) {
  return mix(plan.seed ^ mix(0x5167ull << 48 ^ uint64_t(src) << 32 ^ uint64_t(p) << 24 ^ uint64_t(k))) %
             plan.signal_every ==
         0;
}

void check_plan(const Channel& ch, const TrafficPlan& plan) {
  const ChannelOptions& o = ch.options();
  if (plan.producers < 1 || uint32_t(plan.producers) > o.proxy.num_streams)
    throw std::invalid_argument("producers=" + std::to_string(plan.producers) +
                                " must be in 1..num_streams=" + std::to_string(o.proxy.num_streams));
  if (plan.messages_per_producer < 1 || plan.max_message_bytes < 1 || plan.signal_every < 1)
    throw std::invalid_argument("messages_per_producer, max_message_bytes and signal_every must be >= 1");
  if (traffic_region_bytes(plan, o.proxy.num_ranks) > ch.data_bytes())
    throw std::invalid_argument("the traffic plan needs " +
                                std::to_string(traffic_region_bytes(plan, o.proxy.num_ranks)) +
                                " bytes of data region, the channel has " + std::to_string(ch.data_bytes()));
}

// One producer's host-side FIFO pushes, with its own cached tails (FIFOs are multi-producer).
class Pusher {
 public:
  explicit Pusher(Channel& ch) : ch_(ch), g_(ch.proxies()), tails_(size_t(g_.num_fifos()), 0) {}
  void push(const CmdFields& f) {
    TransferCmd cmd;
    ch_.encode_or_throw(f, &cmd);
    int fifo = g_.fifo_for(f.dst_rank, f.stream);
    g_.push(fifo, cmd, &tails_[fifo]);
  }

 private:
  Channel& ch_;
  ProxyGroup& g_;
  std::vector<uint64_t> tails_;
};

void produce(Channel& ch, const TrafficPlan& plan, const Geometry& geo, int p, uint64_t* commands) {
  const int me = ch.options().proxy.rank;
  Pusher pusher(ch);
  std::vector<int> sent(size_t(geo.n), 0);
  for (int k = 0; k < plan.messages_per_producer; ++k) {
    const int dst = dst_of(plan, me, p, k, geo.n);
    const int m = sent[dst]++;
    const uint64_t key = message_key(plan, me, p, dst, m);
    const uint32_t len = message_len(plan, key);
    uint8_t* src = ch.data() + geo.send_off(p, dst, m);
    for (uint32_t i = 0; i < len; ++i) src[i] = message_byte(key, i);
    pusher.push(
        CmdFields{kOpWrite, 0, uint32_t(dst), len, uint32_t(p), geo.recv_off(me, p, m), geo.send_off(p, dst, m)});
    ++*commands;
    if (signal_after(plan, me, p, k)) {
      pusher.push(CmdFields{kOpSignal, 0, uint32_t(dst), 0, uint32_t(p), 0, 0});
      ++*commands;
    }
  }
  for (int dst = 0; dst < geo.n; ++dst) {
    pusher.push(CmdFields{kOpSignal, kFlagFinal, uint32_t(dst), 0, uint32_t(p), 0, 0});
    ++*commands;
  }
}

// Whether message m of stream (src, p) is exactly in place: its bytes, then zeros to the end of its slot.
bool message_in_place(const Channel& ch, const TrafficPlan& plan, const Geometry& geo, int src, int p, int m,
                      std::string* why) {
  const int me = ch.options().proxy.rank;
  const uint64_t key = message_key(plan, src, p, me, m);
  const uint32_t len = message_len(plan, key);
  const uint8_t* got = ch.data() + geo.recv_off(src, p, m);
  for (uint32_t i = 0; i < geo.S; ++i) {
    const uint8_t want = i < len ? message_byte(key, i) : 0;
    if (__atomic_load_n(got + i, __ATOMIC_RELAXED) != want) {
      *why = "rank " + std::to_string(me) + ": message " + std::to_string(m) + " of (src " + std::to_string(src) +
             ", stream " + std::to_string(p) + ") byte " + std::to_string(i) + " of " + std::to_string(len) +
             " differs when its signal was visible";
      return false;
    }
  }
  return true;
}
}  // namespace

uint64_t traffic_region_bytes(const TrafficPlan& p, int num_ranks) { return 2 * Geometry(p, num_ranks).recv_base; }

ProducerResult run_producers(Channel& ch, const TrafficPlan& plan) {
  check_plan(ch, plan);
  const Geometry geo(plan, ch.options().proxy.num_ranks);
  std::vector<uint64_t> commands(size_t(plan.producers), 0);
  std::vector<std::exception_ptr> errors(size_t(plan.producers));
  const auto start = Clock::now();
  {
    std::vector<std::thread> threads;
    for (int p = 0; p < plan.producers; ++p)
      threads.emplace_back([&, p] {
        try {
          produce(ch, plan, geo, p, &commands[p]);
        } catch (...) {
          errors[p] = std::current_exception();
        }
      });
    for (auto& t : threads) t.join();
  }
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  ProducerResult r;
  r.push_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  ch.quiet();
  r.total_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  for (uint64_t c : commands) r.commands += c;
  return r;
}

CheckResult run_checker(Channel& ch, const TrafficPlan& plan, double timeout_s) {
  check_plan(ch, plan);
  const int me = ch.options().proxy.rank;
  const Geometry geo(plan, ch.options().proxy.num_ranks);
  const uint32_t num_streams = ch.options().proxy.num_streams;
  const int num_pairs = geo.n * geo.P;
  std::vector<int> expected(size_t(num_pairs), 0), seen(size_t(num_pairs), 0);
  std::vector<bool> done(size_t(num_pairs), false);
  for (int src = 0; src < geo.n; ++src)
    for (int p = 0; p < geo.P; ++p)
      for (int k = 0; k < plan.messages_per_producer; ++k)
        if (dst_of(plan, src, p, k, geo.n) == me) ++expected[src * geo.P + p];

  CheckResult r;
  auto violation = [&](const std::string& why) {
    if (r.violations++ == 0) r.first_violation = why;
  };
  const auto start = Clock::now();
  while (r.streams_final < uint64_t(num_pairs)) {
    bool moved = false;
    for (int src = 0; src < geo.n; ++src)
      for (int p = 0; p < geo.P; ++p) {
        const int i = src * geo.P + p;
        if (done[i]) continue;
        const uint64_t v = __atomic_load_n(ch.signals() + uint64_t(src) * num_streams + p, __ATOMIC_ACQUIRE);
        const int count = int(v & 0xffffffffu);
        if (count > seen[i]) {
          ++r.observations;
          moved = true;
          std::string why;
          for (int m = seen[i]; m < count && m < plan.messages_per_producer; ++m, ++r.messages_checked)
            if (!message_in_place(ch, plan, geo, src, p, m, &why)) violation(why);
          seen[i] = count;
        }
        if (v >> 32) {
          done[i] = true;
          ++r.streams_final;
          if (count != expected[i])
            violation("rank " + std::to_string(me) + ": stream (src " + std::to_string(src) + ", " + std::to_string(p) +
                      ") ended at " + std::to_string(count) + " writes, expected " + std::to_string(expected[i]));
        }
      }
    if (moved) continue;
    if (std::chrono::duration<double>(Clock::now() - start).count() > timeout_s) {
      ch.proxies().check_error();
      throw std::runtime_error("checker on rank " + std::to_string(me) + ": only " + std::to_string(r.streams_final) +
                               " of " + std::to_string(num_pairs) + " streams ended within " +
                               std::to_string(timeout_s) + " s");
    }
    std::this_thread::yield();
  }
  for (int src = 0; src < geo.n; ++src)
    for (int p = 0; p < geo.P; ++p)
      for (int m = 0; m < expected[src * geo.P + p]; ++m) {
        std::string why;
        if (!message_in_place(ch, plan, geo, src, p, m, &why)) violation("at the end: " + why);
      }
  return r;
}

std::vector<double> run_pingpong(Channel& ch, int peer, bool initiator, int iterations, uint32_t bytes, uint64_t base,
                                 double timeout_s) {
  const uint64_t half = ch.data_bytes() / 2 / 16 * 16;
  if (bytes > half)
    throw std::invalid_argument("bytes=" + std::to_string(bytes) + " must be <= " + std::to_string(half));
  std::vector<double> lat;
  for (int i = 0; i < iterations; ++i) {
    const auto t0 = Clock::now();
    if (!initiator) ch.wait_signal(peer, 0, base + uint64_t(i) + 1, timeout_s);
    ch.write(peer, 0, half, bytes, 0);
    ch.signal(peer, 0, false);
    if (initiator) {
      ch.wait_signal(peer, 0, base + uint64_t(i) + 1, timeout_s);
      lat.push_back(std::chrono::duration<double, std::nano>(Clock::now() - t0).count());
    }
  }
  ch.quiet();  // the responder's last reply must be delivered before the caller may tear down
  return lat;
}

}  // namespace portep
