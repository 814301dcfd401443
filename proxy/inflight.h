// In-order retirement of posted operations. Each post takes the next sequence number; completions may come
// back in any order (unordered transports), but an operation retires only when every earlier one has, so
// "retired() > s" means everything up to and including s is complete. Caps bound both commands and bytes.
#pragma once

#include <stdint.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace portep {

class InflightTracker {
 public:
  InflightTracker(uint32_t max_cmds, uint64_t max_bytes) : max_cmds_(max_cmds), max_bytes_(max_bytes) {
    if (max_cmds == 0) throw std::invalid_argument("max_inflight_cmds must be >= 1");
    uint32_t cap = 1;
    while (cap < max_cmds) cap <<= 1;
    slots_.resize(cap);
  }

  // Whether a post of `bytes` fits under both caps now. A single post larger than the byte cap is allowed
  // when nothing else is in flight, so big transfers cannot deadlock.
  bool has_room(uint64_t bytes) const {
    if (posted_ - retired_ >= max_cmds_) return false;
    return bytes_ + bytes <= max_bytes_ || posted_ == retired_;
  }

  uint64_t on_post(uint64_t bytes) {
    Slot& s = slots_[posted_ & (slots_.size() - 1)];
    s.bytes = bytes;
    s.done = false;
    bytes_ += bytes;
    return posted_++;
  }

  void on_complete(uint64_t seq) {
    if (seq < retired_ || seq >= posted_)
      throw std::logic_error("completion for sequence " + std::to_string(seq) + " which is not in flight [" +
                             std::to_string(retired_) + ", " + std::to_string(posted_) + ")");
    Slot& s = slots_[seq & (slots_.size() - 1)];
    if (s.done) throw std::logic_error("duplicate completion for sequence " + std::to_string(seq));
    s.done = true;
    while (retired_ < posted_) {
      Slot& front = slots_[retired_ & (slots_.size() - 1)];
      if (!front.done) break;
      bytes_ -= front.bytes;
      ++retired_;
    }
  }

  uint64_t posted() const { return posted_; }
  uint64_t retired() const { return retired_; }
  uint64_t inflight_bytes() const { return bytes_; }
  bool idle() const { return posted_ == retired_; }

 private:
  struct Slot {
    uint64_t bytes = 0;
    bool done = false;
  };
  uint32_t max_cmds_;
  uint64_t max_bytes_;
  std::vector<Slot> slots_;
  uint64_t posted_ = 0, retired_ = 0, bytes_ = 0;
};

}  // namespace portep
