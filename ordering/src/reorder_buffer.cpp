#include "portep/reorder_buffer.h"

#include <string>

namespace portep {

SeqReorderBuffer::SeqReorderBuffer(uint32_t num_sources, uint32_t num_slots, uint32_t window)
    : num_sources_(num_sources), num_slots_(num_slots), window_(window) {
  if (window == 0 || window > imm::kSeqSpace)
    throw OrderingError("reorder window=" + std::to_string(window) + " must be in 1.." +
                        std::to_string(imm::kSeqSpace) + " (the immediate's sequence space)");
  if (num_slots > imm::kMaxSlots)
    throw OrderingError("num_slots=" + std::to_string(num_slots) + " exceeds the immediate encoding's limit of " +
                        std::to_string(imm::kMaxSlots));
  slots_.resize(size_t(num_sources) * num_slots);
}

void SeqReorderBuffer::on_add(uint32_t src, uint32_t slot, uint32_t seq, uint32_t value, std::vector<SeqApply>* out) {
  if (src >= num_sources_ || slot >= num_slots_)
    throw OrderingError("sequenced add for source " + std::to_string(src) + " slot " + std::to_string(slot) +
                        " is outside the buffer (" + std::to_string(num_sources_) + " sources, " +
                        std::to_string(num_slots_) + " slots)");
  if (value > imm::kMaxSeqValue)
    throw OrderingError("sequenced add of " + std::to_string(value) + " exceeds the encodable maximum " +
                        std::to_string(imm::kMaxSeqValue));
  SlotState& s = slots_[size_t(src) * num_slots_ + slot];
  seq %= imm::kSeqSpace;
  const uint32_t distance = (seq + imm::kSeqSpace - s.expected) % imm::kSeqSpace;
  if (distance >= window_)
    throw OrderingError("source " + std::to_string(src) + " slot " + std::to_string(slot) + ": sequence " +
                        std::to_string(seq) + " is outside the window [" + std::to_string(s.expected) + ", +" +
                        std::to_string(window_) + ") (duplicate or in-flight cap above the window)");
  uint64_t& word = s.present[seq / 64];
  const uint64_t bit = 1ull << (seq % 64);
  if (word & bit)
    throw OrderingError("source " + std::to_string(src) + " slot " + std::to_string(slot) + ": duplicate sequence " +
                        std::to_string(seq));
  word |= bit;
  s.values[seq] = uint16_t(value);
  ++held_;
  for (;;) {
    uint64_t& w = s.present[s.expected / 64];
    const uint64_t b = 1ull << (s.expected % 64);
    if (!(w & b)) return;
    w &= ~b;
    out->push_back(SeqApply{src, slot, s.values[s.expected]});
    --held_;
    s.expected = (s.expected + 1) % imm::kSeqSpace;
  }
}

void check_inflight_cap(uint32_t inflight_cap, uint32_t window) {
  if (inflight_cap >= window)
    throw OrderingError("in-flight cap " + std::to_string(inflight_cap) + " must be smaller than the reorder window " +
                        std::to_string(window) + ", otherwise sequence numbers could alias");
}

}  // namespace portep
