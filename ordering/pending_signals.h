// Receiver-side holding of stream signals on transports that do not order (docs/design.md §5, Ordering on
// unordered transports).
//
// Every write of stream s carries the epoch it belongs to; the signal that closes epoch e carries the number
// of writes (units) in e. A signal is released when (1) all units of its epoch have arrived and (2) every
// earlier epoch of the stream has been released, so the slot a receiver polls never counts a write that is
// not in place. Epochs are numbered mod 16; the sender keeps at most 15 epochs of one stream unretired
// (ordering/stream_epochs.h), so the window cannot alias.
//
// Pure logic: no I/O, no threads. One table per receiving proxy thread; all traffic of one (source, stream)
// arrives on one connection and therefore at one table.
#pragma once

#include <stdint.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "ordering/imm.h"

namespace portep {

struct SignalRelease {
  uint32_t src;
  uint32_t stream;
  uint32_t units;
  bool final_signal;
};

class PendingSignalTable {
 public:
  PendingSignalTable(uint32_t num_sources, uint32_t num_streams);

  // A write of (src, stream) in epoch arrived. May release held signals (appended to out).
  void on_write(uint32_t src, uint32_t stream, uint32_t epoch, std::vector<SignalRelease>* out);
  // The signal closing epoch arrived. May release it and later held signals (appended to out).
  void on_signal(uint32_t src, uint32_t stream, uint32_t epoch, uint32_t units, bool final_signal,
                 std::vector<SignalRelease>* out);

  // Signals that arrived but are not released yet (for diagnostics and tests).
  uint64_t held() const { return held_; }
  uint64_t released() const { return released_; }

 private:
  struct EpochState {
    uint16_t arrived = 0;
    uint16_t units = 0;
    bool signal_present = false;
    bool final_signal = false;
  };
  struct StreamState {
    EpochState epochs[imm::kNumEpochs];
    uint32_t next_epoch = 0;  // mod kNumEpochs
  };

  StreamState& state(uint32_t src, uint32_t stream);
  void release_ready(uint32_t src, uint32_t stream, StreamState& s, std::vector<SignalRelease>* out);

  uint32_t num_sources_, num_streams_;
  std::vector<StreamState> states_;
  uint64_t held_ = 0, released_ = 0;
};

// Thrown when the arrivals contradict the protocol (duplicate signal, more writes than the signal names):
// a sender or transport bug, never silently absorbed.
class OrderingError : public std::runtime_error {
 public:
  explicit OrderingError(const std::string& what) : std::runtime_error(what) {}
};

}  // namespace portep
