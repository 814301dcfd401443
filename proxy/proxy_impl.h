// Internals shared by proxy_group.cpp (ownership, host-side calls) and proxy_thread.cpp (the drain loop).
#pragma once

#include <chrono>
#include <condition_variable>

#include "proxy/backoff.h"
#include "proxy/inflight.h"
#include "ordering/signal_protocol.h"
#include "proxy/proxy.h"

namespace portep {

struct alignas(64) HostFifoStorage {
  uint64_t head = 0;
  char pad0[56];
  uint64_t tail = 0;
  char pad1[56];
  uint32_t error_flag = 0;
  char pad2[60];
  std::atomic<uint64_t> ack{0};  // last QUIET/BARRIER ticket the owning thread handled
  char pad3[56];
  std::vector<TransferCmd> entries;
};

class ProxyGroupImpl;

// One proxy thread: drains its FIFOs, posts what the signal protocol asks (it implements SignalPoster), polls the
// transport and publishes the signals the protocol releases. It knows neither protocol (ordering/signal_protocol.h).
class ProxyThread final : private SignalPoster {
 public:
  ProxyThread(ProxyGroupImpl* g, int index);
  void run();

 private:
  void handle(const TransferCmd& cmd, int fifo);
  void handle_write(const CmdFields& f);
  void handle_signal(const CmdFields& f);
  void check_placed(const CmdFields& f) const;
  void check_host_fifo(const char* what, int fifo) const;
  void handle_quiet(const CmdFields& f, int fifo);
  void handle_barrier(const CmdFields& f, int fifo);
  template <class PostFn>
  uint64_t post_with_retry(uint64_t bytes, const char* what, int peer, PostFn&& post);
  // SignalPoster
  uint64_t post_write(int peer, uint64_t local_off, uint64_t remote_off, uint32_t bytes, const uint32_t* imm,
                      const char* what) override;
  uint64_t post_slot_add(int peer, uint32_t stream, uint32_t units, bool final_signal) override;
  void wait_retired_past(uint64_t seq, const char* what, int peer) override;
  void wait_idle(const char* what);
  IdleWaiter idle_waiter() const;
  bool progress();  // completions + notifications; true if anything happened
  void apply_notice(const RecvNotice& n);
  [[noreturn]] void timeout_error(const char* what, int peer);

  ProxyGroupImpl* g_;
  int index_;
  std::vector<int> fifos_;
  std::vector<FifoConsumer> consumers_;
  InflightTracker inflight_;
  SignalProtocol protocol_;
  std::vector<SignalRelease> releases_;
  std::vector<std::chrono::steady_clock::time_point> post_times_;  // by sequence number & post_mask_
  uint64_t post_mask_;
  std::chrono::nanoseconds timeout_;

 public:
  ProxyThreadStats stats;
};

class ProxyGroupImpl {
 public:
  ProxyGroupImpl(Transport* t, const ProxyConfig& c, uint64_t* slots);
  ~ProxyGroupImpl();

  void latch(const std::string& msg);
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  const std::atomic<bool>* failed_flag() const { return &failed_; }
  std::string error() const;
  FifoView view(int i) const;
  void wait_acks(const std::vector<std::pair<int, uint64_t>>& tickets, const char* what);
  void wait_barrier_arrivals(uint64_t epoch);

  Transport* transport;
  ProxyConfig cfg;
  uint64_t* signal_slots;
  bool native_signals;
  bool placed_writes;  // the transport takes placed WRITEs (kFlagPlaced)
  std::vector<std::unique_ptr<HostFifoStorage>> fifos;
  std::vector<FifoView> device_fifos;  // views i >= cfg.num_fifos
  std::vector<std::unique_ptr<ProxyThread>> workers;
  std::vector<std::thread> threads;
  std::atomic<bool> stop_flag{false};
  std::atomic<uint64_t> barrier_arrivals[4] = {};
  std::unique_ptr<PeerWatch> watch;  // cfg.status_stream >= 0
  uint64_t next_ticket = 1;          // host side only
  uint64_t barrier_epoch = 0;        // host side only
  std::mutex host_mu;                // serializes host-side quiet/barrier callers

 private:
  mutable std::mutex err_mu_;
  std::string error_;
  std::atomic<bool> failed_{false};
};

}  // namespace portep
