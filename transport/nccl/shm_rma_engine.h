// NCCL's host one-sided semantics (rma_engine.h) emulated in shared memory between the processes of one host: the
// nccl transport's protocol runs on it where no GPU or no NCCL >= 2.29.2 is (CI, a laptop). Windows are shared
// segments; a signal is a release increment of the peer's counter for this rank.
//
// As weak as the API allows, seeded: a lane carries out its operations in order but later than asked (a stage
// writes this rank's window, a put reads its source then), and a put's bytes land in the peer's window after a
// further delay (longer in the data window than in the control window), in any order among the lane's puts in
// flight. Signals are counted in lane order, each once its put and every earlier one landed. So a receiver that
// trusted a record before counting its signals would read a write whose bytes have not landed, and the tests see it
// (skip_ordering does exactly that). And as NCCL runs a communicator's operations one after another, an operation
// enqueued after an arm whose signals have not all come is not carried out until they have: a protocol that waits
// for a put that depends on this rank stalls here as it would on NCCL.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "transport/nccl/rma_engine.h"
#include "transport/shm/shm_segment.h"

namespace portep {

class ShmRmaEngine final : public RmaEngine {
 public:
  ShmRmaEngine(int rank, int num_ranks, uint64_t seed);
  ~ShmRmaEngine() override;  // carries out and lands what the lanes still hold, as NCCL would deliver it

  void* alloc_window(RmaWindow w, size_t bytes) override;
  std::string endpoint_blob() override;
  void connect(const std::vector<std::string>& blobs) override;
  void bootstrap_done() override;
  void write_words(int peer, RmaWindow w, uint64_t off, const uint64_t* words, int count) override;
  void put_signal(int peer, RmaWindow w, uint64_t local_off, uint64_t remote_off, size_t bytes) override;
  uint64_t mark(int peer) override;
  bool complete(int peer, uint64_t ticket) override;
  void drive(int peer) override;
  void arm(int src, uint64_t total, uint64_t off, size_t bytes, void* host_dst) override;
  bool ready(int src) override;
  std::string describe_peer(int peer) const override;
  bool peer_alive(int peer) const override;

 private:
  struct Op {
    bool put;  // else words written into this rank's window
    RmaWindow window;
    uint64_t local_off, remote_off;
    std::string bytes;  // the words written, or a put's source bytes once carried out
    size_t size;
    uint64_t order = 0;  // enqueue order across the lanes (an arm's too)
    bool landed = false;
    std::chrono::steady_clock::time_point lands_at{};  // a put in flight lands no earlier
  };
  struct Lane {
    std::deque<Op> queued;     // enqueued, not yet carried out
    std::deque<Op> in_flight;  // puts carried out, not yet counted at the peer (some landed)
    uint64_t enqueued = 0, carried_out = 0;
    std::mt19937_64 rng;
  };
  struct Armed {
    bool on = false;
    uint64_t total = 0, off = 0;
    size_t bytes = 0;
    void* dst = nullptr;
  };
  struct Peer {
    int pid = 0;
    char* windows[kNumRmaWindows] = {};
    size_t bytes[kNumRmaWindows] = {};
    uint64_t* counters = nullptr;  // the peer's signal counters, by source
    std::vector<ShmSegment> maps;
  };

  int peer_pid(int peer) const;  // 0 where not known
  void enqueue(int peer, Op op);
  void progress(int peer, bool all);
  void carry_out(int peer, Op& op);
  void land_and_count(int peer, bool all);
  bool held_by_an_arm(uint64_t order) const;
  void check(int peer, RmaWindow w, uint64_t off, size_t bytes, bool remote, const char* what) const;

  int rank_, num_ranks_;
  ShmSegment windows_[kNumRmaWindows];
  ShmSegment counters_;  // uint64 per source rank: signals counted from it
  std::vector<Peer> peers_;
  std::vector<Lane> lanes_;
  std::vector<Armed> armed_;
  std::atomic<uint64_t> order_{0};
  std::vector<std::atomic<uint64_t>> arm_order_, arm_total_;  // an arm's enqueue order (0: none) and
                                                              // total, for any lane's thread
};

}  // namespace portep
