// The one-sided operations the nccl transport is built on, behind one small interface: NCCL's host API
// (ncclPutSignal / ncclWaitSignal on registered windows) on a GPU, or an emulation of the same semantics in shared
// memory (shm_rma_engine.h), on which the transport's protocol runs in CI and on a laptop.
//
// Semantics, NCCL's as the transport relies on them:
// - A lane is the sequence of operations this rank enqueues towards one peer (in NCCL a CUDA stream per peer). It
//   executes in enqueue order.
// - put_signal: the bytes land in the peer's window, then the peer counts one signal from this rank. A counted
//   signal means every earlier put of the same lane has landed too.
// - arm(src, total, ...): wait until `total` signals from src have been counted (in all, since connect), then copy a
//   range of this rank's own window into host memory; ready(src) says when that copy is there. One arm per source
//   at a time. NCCL runs a communicator's operations one after another, whatever their streams: this rank's later
//   puts wait behind an unmet wait. So a wait must only be for signals of puts the source has already made (their
//   bytes seen), never for one that may depend on this rank; an arm for no more signals than already waited for
//   copies at once.
// Local completion (mark / complete): the put's source bytes may be reused.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <string>
#include <vector>

namespace portep {

enum RmaWindow : int { kRmaData = 0, kRmaControl = 1, kNumRmaWindows = 2 };

class RmaEngine {
 public:
  virtual ~RmaEngine() = default;

  // Before connect: this rank's memory for window w, `bytes` long (every rank asks for the same size).
  virtual void* alloc_window(RmaWindow w, size_t bytes) = 0;
  virtual std::string endpoint_blob() = 0;
  virtual void connect(const std::vector<std::string>& blobs) = 0;
  // Every rank has connected (after a group barrier).
  virtual void bootstrap_done() {}

  // Lane `peer`: 8-byte words into this rank's own window w at off (what a later put of the lane reads), in lane
  // order; each word is written whole. The caller's words may be reused on return.
  virtual void write_words(int peer, RmaWindow w, uint64_t off, const uint64_t* words, int count) = 0;
  // Lane `peer`: bytes from this rank's window w at local_off to the peer's window w at remote_off, then a signal.
  virtual void put_signal(int peer, RmaWindow w, uint64_t local_off, uint64_t remote_off, size_t bytes) = 0;
  // A ticket for everything enqueued on lane `peer` so far; complete() once all of it completed locally.
  virtual uint64_t mark(int peer) = 0;
  virtual bool complete(int peer, uint64_t ticket) = 0;
  // Lets lane `peer` move on by itself (the emulation's held operations; NCCL's streams need nothing): called
  // often, from the transport's polls.
  virtual void drive(int peer) { (void)peer; }

  // Receive side of source src (src == this rank allowed): after `total` signals from src, copy this rank's control
  // window [off, off + bytes) to host_dst. Not re-armed before ready(src).
  virtual void arm(int src, uint64_t total, uint64_t off, size_t bytes, void* host_dst) = 0;
  virtual bool ready(int src) = 0;

  // For error messages, and whether the peer's process is still there (true where the engine cannot tell).
  virtual std::string describe_peer(int peer) const = 0;
  virtual bool peer_alive(int peer) const { return true; }
  // Where this rank's data window is, for kernels (nullptr: host memory).
  virtual void* data_device_address() const { return nullptr; }
};

}  // namespace portep
