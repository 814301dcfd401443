#include "ordering/pending_signals.h"

namespace portep {

PendingSignalTable::PendingSignalTable(uint32_t num_sources, uint32_t num_streams)
    : num_sources_(num_sources), num_streams_(num_streams) {
  if (num_streams > imm::kMaxStreams)
    throw OrderingError("num_streams=" + std::to_string(num_streams) + " exceeds the immediate encoding's limit of " +
                        std::to_string(imm::kMaxStreams) + " streams per connection");
  states_.resize(size_t(num_sources) * num_streams);
}

PendingSignalTable::StreamState& PendingSignalTable::state(uint32_t src, uint32_t stream) {
  if (src >= num_sources_ || stream >= num_streams_)
    throw OrderingError("notification for source " + std::to_string(src) + " stream " + std::to_string(stream) +
                        " is outside the table (" + std::to_string(num_sources_) + " sources, " +
                        std::to_string(num_streams_) + " streams)");
  return states_[size_t(src) * num_streams_ + stream];
}

void PendingSignalTable::on_write(uint32_t src, uint32_t stream, uint32_t epoch, std::vector<SignalRelease>* out) {
  StreamState& s = state(src, stream);
  EpochState& e = s.epochs[epoch % imm::kNumEpochs];
  if (e.signal_present && e.arrived >= e.units)
    throw OrderingError("source " + std::to_string(src) + " stream " + std::to_string(stream) + " epoch " +
                        std::to_string(epoch) + ": more writes arrived than its signal announced (" +
                        std::to_string(e.units) + ")");
  if (e.arrived == 0xffff) throw OrderingError("write counter overflow in one epoch");
  ++e.arrived;
  if (e.signal_present) release_ready(src, stream, s, out);
}

void PendingSignalTable::on_signal(uint32_t src, uint32_t stream, uint32_t epoch, uint32_t units, bool final_signal,
                                   std::vector<SignalRelease>* out) {
  if (units > imm::kMaxUnits)
    throw OrderingError("signal of source " + std::to_string(src) + " stream " + std::to_string(stream) + " names " +
                        std::to_string(units) + " units; an epoch holds at most " + std::to_string(imm::kMaxUnits));
  StreamState& s = state(src, stream);
  EpochState& e = s.epochs[epoch % imm::kNumEpochs];
  if (e.signal_present)
    throw OrderingError("source " + std::to_string(src) + " stream " + std::to_string(stream) + " epoch " +
                        std::to_string(epoch) + ": duplicate signal (window of " + std::to_string(imm::kNumEpochs) +
                        " epochs overrun?)");
  if (e.arrived > units)
    throw OrderingError("source " + std::to_string(src) + " stream " + std::to_string(stream) + " epoch " +
                        std::to_string(epoch) + ": " + std::to_string(e.arrived) +
                        " writes arrived but the signal announced " + std::to_string(units));
  e.signal_present = true;
  e.units = uint16_t(units);
  e.final_signal = final_signal;
  ++held_;
  release_ready(src, stream, s, out);
}

void PendingSignalTable::release_ready(uint32_t src, uint32_t stream, StreamState& s, std::vector<SignalRelease>* out) {
  for (;;) {
    EpochState& e = s.epochs[s.next_epoch];
    if (!e.signal_present || e.arrived != e.units) return;
    out->push_back(SignalRelease{src, stream, e.units, e.final_signal});
    e = EpochState{};
    s.next_epoch = (s.next_epoch + 1) % imm::kNumEpochs;
    --held_;
    ++released_;
  }
}

}  // namespace portep
