// What this rank knows of each peer beyond its signals: whether its process is gone (the transport says, where it
// can: same host), whether it left (destroyed its side), and whether it refused a call this rank is making. A
// thread reads the peers' status slots and asks the transport, every few milliseconds, so that every wait (host
// waits here, kernel waits through a mirror in mapped host memory) can give up on a peer that will never answer,
// instead of waiting out its timeout.
//
// Status slots: three signal streams from status_stream (REFUSED, FAILED, LEFT); each event a rank announces adds
// a final mark (kSignalFinalMark) to slot (that rank, stream) at every rank, itself included, so bits 63..32 count
// the events. A peer p "refused a call this rank makes" while p's REFUSED count exceeds this rank's own: a call
// refused on every rank alike leaves the counts equal and stops nobody. A peer that announced a FAILED call is out
// of step until the ranks resynchronise (which zeroes the REFUSED and FAILED slots everywhere).
#pragma once

#include <stdint.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "proxy/peer_status.h"
#include "transport/transport.h"

namespace portep {

const char* peer_status_text(uint32_t status);

class PeerWatch {
 public:
  // slots: this rank's signal slots [num_ranks][num_streams]; status_stream: the first of the three status streams.
  PeerWatch(Transport* t, int rank, int num_ranks, const uint64_t* slots, uint32_t num_streams, uint32_t status_stream);
  ~PeerWatch();
  PeerWatch(const PeerWatch&) = delete;
  PeerWatch& operator=(const PeerWatch&) = delete;

  void start();
  void stop();

  uint32_t status(int peer) const { return status_[size_t(peer)].load(std::memory_order_acquire); }
  // Events of `kind` rank `src` announced so far (its slot's final count).
  uint64_t events(int src, StatusEvent kind) const;
  // Where kernels read each peer's status: num_ranks uint32 words of mapped host memory, kept equal to status().
  void mirror_to(uint32_t* words);

 private:
  void poll();  // the thread's: every peer once
  uint32_t compute(int peer, bool check_process);

  Transport* transport_;
  int rank_, num_ranks_;
  const uint64_t* slots_;
  uint32_t num_streams_, status_stream_;
  std::vector<std::atomic<uint32_t>> status_;
  std::vector<uint8_t> gone_;  // sticky: a process, once gone, stays gone
  std::atomic<uint32_t*> mirror_{nullptr};
  std::atomic<bool> stop_{false};
  std::thread thread_;
  uint64_t ticks_ = 0;
};

}  // namespace portep
