#include "ordering/signal_protocol.h"

#include <string>

#include "ordering/imm.h"

namespace portep {

SignalProtocol::SignalProtocol(uint32_t num_ranks, uint32_t num_streams, bool native, bool skip_ordering)
    : native_(native), skip_ordering_(skip_ordering), pending_(num_ranks, num_streams) {}

void SignalProtocol::write(int peer, uint32_t stream, uint64_t local_off, uint64_t remote_off, uint32_t bytes,
                           bool placed, SignalPoster& post) {
  StreamEpoch& se = epochs_.at(uint32_t(peer), stream);
  if (!native_) {
    if (se.units == imm::kMaxUnits) signal(peer, stream, false, post);  // the unit field is full: close the epoch
    uint64_t wait_seq;
    if (se.units == 0 && se.must_wait_for(&wait_seq)) post.wait_retired_past(wait_seq, "WRITE (epoch window)", peer);
  }
  // Placed and native: the stream's signal counts the unit, nothing is posted; placed and tagged: a zero-byte write
  // carries the unit's immediate.
  if (!placed || !native_) {
    const uint32_t imm_value = imm::encode_stream_write(stream, uint32_t(se.epoch));
    post.post_write(peer, local_off, remote_off, placed ? 0 : bytes, native_ ? nullptr : &imm_value, "WRITE");
  }
  ++se.units;
}

void SignalProtocol::signal(int peer, uint32_t stream, bool final_signal, SignalPoster& post) {
  StreamEpoch& se = epochs_.at(uint32_t(peer), stream);
  uint64_t seq;
  if (native_) {
    seq = post.post_slot_add(peer, stream, se.units, final_signal);
  } else {
    uint64_t wait_seq;
    if (se.units == 0 && se.must_wait_for(&wait_seq)) post.wait_retired_past(wait_seq, "SIGNAL (epoch window)", peer);
    const uint32_t imm_value = imm::encode_stream_signal(stream, uint32_t(se.epoch), se.units, final_signal);
    seq = post.post_write(peer, 0, 0, 0, &imm_value, "SIGNAL");
  }
  se.close(seq);
}

uint32_t SignalProtocol::barrier_imm(uint64_t epoch) {
  return imm::encode_control(imm::kCtrlBarrier, uint32_t(epoch & imm::kCtrlArgMask));
}

NoticeResult SignalProtocol::on_notice(uint32_t src, uint32_t imm_value, std::vector<SignalRelease>* out) {
  const imm::Decoded d = imm::decode(imm_value);
  switch (d.kind) {
    case imm::kStreamWrite:
      if (!d.valid) throw OrderingError("malformed STREAM_WRITE immediate from rank " + std::to_string(src));
      if (!skip_ordering_) pending_.on_write(src, d.stream, d.epoch, out);
      return NoticeResult{NoticeResult::kWrite};
    case imm::kStreamSignal: {
      const size_t before = out->size();
      if (skip_ordering_)
        out->push_back(SignalRelease{src, d.stream, d.units, d.final_signal});
      else
        pending_.on_signal(src, d.stream, d.epoch, d.units, d.final_signal, out);
      NoticeResult r{NoticeResult::kSignal};
      r.signal_held = out->size() == before;
      return r;
    }
    case imm::kControl:
      if (d.op != imm::kCtrlBarrier)
        throw OrderingError("unknown control message " + std::to_string(d.op) + " from rank " + std::to_string(src));
      return NoticeResult{NoticeResult::kBarrier, d.arg};
    case imm::kSeqAdd:
      break;
  }
  throw OrderingError("sequenced add from rank " + std::to_string(src) +
                      ": no HT stream is registered with this proxy group");
}

}  // namespace portep
