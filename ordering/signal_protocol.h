// The signal protocols of one proxy thread (docs/design.md §5): how a stream's WRITEs and SIGNALs go out, and how the
// notifications that come in become signal-slot counts. Chosen once from the transport's properties:
// - native (ordered transports with remote atomics): a write goes out as it is; a signal is one atomic add of the
//   stream's units onto the peer's slot, which the transport orders after the writes;
// - tagged (everything else): every write carries an immediate naming its stream and epoch, a signal one with the
//   epoch's unit count; the receiver holds a signal until its epoch's writes are in (pending_signals.h), so a slot
//   never counts a write that is not in place.
// The proxy thread validates commands, posts what this asks, and applies the releases; it knows neither protocol.
// Pure logic over the SignalPoster interface: no transport, no threads.
#pragma once

#include <stdint.h>

#include <vector>

#include "ordering/pending_signals.h"
#include "ordering/stream_epochs.h"

namespace portep {

// What a protocol needs of its proxy thread. Posts wait for room (bounded by the proxy's timeout) and return the
// post's sequence number; wait_retired_past returns once every post up to seq has completed.
class SignalPoster {
 public:
  virtual uint64_t post_write(int peer, uint64_t local_off, uint64_t remote_off, uint32_t bytes, const uint32_t* imm,
                              const char* what) = 0;
  // Adds units (+ the final mark) to the peer's slot (this rank, stream) with the transport's remote atomic.
  virtual uint64_t post_slot_add(int peer, uint32_t stream, uint32_t units, bool final_signal) = 0;
  virtual void wait_retired_past(uint64_t seq, const char* what, int peer) = 0;

 protected:
  ~SignalPoster() = default;
};

// What a notification was, for the proxy thread.
struct NoticeResult {
  enum Kind { kWrite, kSignal, kBarrier } kind;
  uint32_t barrier_epoch = 0;  // kBarrier: the barrier's epoch (mod 2^26)
  bool signal_held = false;    // kSignal: it arrived before its writes and waits for them
};

class SignalProtocol {
 public:
  // native: the native protocol (else tagged). skip_ordering: tagged, but signals released on arrival (tests of the
  // ordering's necessity only).
  SignalProtocol(uint32_t num_ranks, uint32_t num_streams, bool native, bool skip_ordering);

  bool native() const { return native_; }

  // A WRITE of bytes from local_off to the peer's remote_off on stream; placed: its producer stored the bytes into
  // the peer's memory already, so only its unit goes out (and with the native protocol nothing at all).
  void write(int peer, uint32_t stream, uint64_t local_off, uint64_t remote_off, uint32_t bytes, bool placed,
             SignalPoster& post);
  // A SIGNAL closing the stream's open epoch (final: the receiver's wait for a final signal may end).
  void signal(int peer, uint32_t stream, bool final_signal, SignalPoster& post);
  // The immediate of a barrier message of epoch (sent to every peer after this rank's posts completed).
  static uint32_t barrier_imm(uint64_t epoch);

  // One notification from src whose writes are in place and visible: the signals it releases are appended to out.
  // Throws on an immediate the protocol does not allow (malformed, or a kind nobody sends here).
  NoticeResult on_notice(uint32_t src, uint32_t imm, std::vector<SignalRelease>* out);

  uint64_t held() const { return pending_.held(); }

 private:
  bool native_, skip_ordering_;
  StreamEpochTable epochs_;
  PendingSignalTable pending_;
};

}  // namespace portep
