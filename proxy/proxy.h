// Proxy threads: drain the command FIFOs in order and turn commands into transport operations.
//
// Thread t owns FIFOs f with f % num_threads == t and uses transport channel t, so a stream that producers
// map to one FIFO stays on one thread and one connection per peer: its order survives to the transport.
// The protocol for signals is chosen from the transport's properties at run time:
//   ordered && remote_atomics  -> writes, then an atomic add of the unit count (nothing tagged)
//   otherwise                  -> every write carries a STREAM_WRITE immediate; the signal is a zero-length
//                                 write with a STREAM_SIGNAL immediate that the receiving proxy holds until
//                                 the epoch's writes are in (ordering/pending_signals.h)
// Errors (transport failures, protocol violations, timeouts) latch: the thread stops, and the next host call
// (check_error, quiet_all, barrier, push) raises them on the caller's thread.
#pragma once

#include <stdint.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "proxy/fifo.h"
#include "proxy/peer_watch.h"
#include "transport/transport.h"

namespace portep {

struct ProxyConfig {
  int rank = 0;
  int num_ranks = 1;
  int num_threads = 4;
  int num_fifos = 32;
  uint32_t fifo_capacity = 4096;
  uint32_t max_inflight_cmds = 512;           // per proxy thread
  uint64_t max_inflight_bytes = 64ull << 20;  // per proxy thread
  uint32_t num_streams = 64;                  // signal slots per source rank
  double timeout_s = 100.0;
  double idle_spin_us = 0;     // an idle proxy busy-polls this long before it yields and sleeps
  bool skip_ordering = false;  // debug only: release emulated signals on arrival (proves tests can fail)
  int status_stream = -1;      // >= 0: the first of the peers' status streams (peer_watch.h); -1: no peer watch
};

struct ProxyThreadStats {
  uint64_t commands = 0, writes = 0, signals = 0, bytes = 0, notices = 0;
  uint64_t held_signals = 0;     // signals waiting for their writes right now
  uint64_t in_flight = 0;        // operations posted to the transport and not yet completed
  uint64_t signals_delayed = 0;  // signals that arrived before their writes and were held (unordered transports)
  TransportBacklog backlog;      // where in-flight operations waited at the last poll that moved nothing
  // Where the thread's time goes (steady clock, nanoseconds): inside the transport's post and poll calls, and
  // from each operation's post until the poll that saw it complete.
  uint64_t polls = 0, post_ns = 0, poll_ns = 0;
  uint64_t completed = 0, op_latency_ns = 0, op_latency_max_ns = 0;
};

class ProxyGroupImpl;

class ProxyGroup {
 public:
  ProxyGroup(Transport* transport, const ProxyConfig& cfg, uint64_t* signal_slots);
  ~ProxyGroup();
  ProxyGroup(const ProxyGroup&) = delete;
  ProxyGroup& operator=(const ProxyGroup&) = delete;

  // FIFOs that GPU kernels push into (entries and tail in mapped host memory, head in device memory): host
  // views, owned by the caller, which keeps them alive until stop(). Device FIFO i is served by thread
  // i % num_threads; host producers never push into them (QUIET/BARRIER stay on the host FIFOs). Call before
  // start().
  void attach_device_fifos(const std::vector<FifoView>& host_views);
  int num_device_fifos() const;

  void start();
  void stop();  // joins every thread; idempotent

  const ProxyConfig& config() const;
  int num_fifos() const;
  FifoView fifo(int i) const;
  int fifo_for(uint32_t dst, uint32_t stream) const;  // the stream -> FIFO mapping every producer must use
  bool ordered_protocol() const;                      // true: native atomics, no immediates

  // Host producer helpers: push (throws on timeout or latched error), quiet/barrier through the FIFOs.
  void push(int fifo, const TransferCmd& cmd, uint64_t* cached_tail);
  void quiet_all();
  void barrier();

  void check_error() const;  // throws std::runtime_error with the latched message
  // Set once an error latched: for a caller that must not pay for check_error's call (the LL fast path).
  const std::atomic<bool>* failed_flag() const;
  // The peer watch (peer_watch.h), when cfg.status_stream >= 0, else null.
  const PeerWatch* peer_watch() const;
  PeerWatch* peer_watch();
  std::vector<ProxyThreadStats> stats() const;
  static int live_threads();  // proxy threads running in this process (all groups)

 private:
  std::unique_ptr<ProxyGroupImpl> impl_;
};

}  // namespace portep
