#include "proxy/peer_watch.h"

#include <chrono>

#include "proxy/transfer_cmd.h"

namespace portep {

namespace {
constexpr auto kTick = std::chrono::milliseconds(2);
constexpr uint64_t kProcessEvery = 25;  // ticks between checks of the peers' processes (system calls)
}  // namespace

const char* peer_status_text(uint32_t status) {
  switch (status) {
    case kPeerOk:
      return "answering";
    case kPeerRefused:
      return "refused a call this rank made (its own error says why)";
    case kPeerFailed:
      return "had a call fail and is out of step until the ranks resynchronise";
    case kPeerLeft:
      return "destroyed its Buffer";
    case kPeerGone:
      return "process gone";
  }
  return "in an unknown state";
}

PeerWatch::PeerWatch(Transport* t, int rank, int num_ranks, const uint64_t* slots, uint32_t num_streams,
                     uint32_t status_stream)
    : transport_(t),
      rank_(rank),
      num_ranks_(num_ranks),
      slots_(slots),
      num_streams_(num_streams),
      status_stream_(status_stream),
      status_(size_t(num_ranks)),
      gone_(size_t(num_ranks), 0) {
  if (status_stream + kNumStatusEvents > num_streams)
    throw std::invalid_argument("status_stream=" + std::to_string(status_stream) + " leaves no room for the " +
                                std::to_string(kNumStatusEvents) + " status streams in " + std::to_string(num_streams));
  for (auto& s : status_) s.store(kPeerOk);
}

PeerWatch::~PeerWatch() { stop(); }

void PeerWatch::start() {
  if (thread_.joinable()) return;
  stop_.store(false);
  thread_ = std::thread([this] {
    while (!stop_.load(std::memory_order_acquire)) {
      poll();
      std::this_thread::sleep_for(kTick);
    }
  });
}

void PeerWatch::stop() {
  stop_.store(true, std::memory_order_release);
  if (thread_.joinable()) thread_.join();
}

uint64_t PeerWatch::events(int src, StatusEvent kind) const {
  const uint64_t* slot = slots_ + uint64_t(src) * num_streams_ + status_stream_ + kind;
  return __atomic_load_n(slot, __ATOMIC_ACQUIRE) >> 32;
}

void PeerWatch::mirror_to(uint32_t* words) {
  if (words)
    for (int p = 0; p < num_ranks_; ++p) __atomic_store_n(words + p, status(p), __ATOMIC_RELEASE);
  mirror_.store(words, std::memory_order_release);
}

uint32_t PeerWatch::compute(int peer, bool check_process) {
  // What a peer announced before its process ended (it left, or failed) names the cause; "gone" is for the rest.
  if (events(peer, kEventLeft)) return kPeerLeft;
  if (events(peer, kEventFailed)) return kPeerFailed;
  if (check_process && !gone_[size_t(peer)] && !transport_->peer_alive(peer)) gone_[size_t(peer)] = 1;
  if (gone_[size_t(peer)]) return kPeerGone;
  if (events(peer, kEventRefused) > events(rank_, kEventRefused)) return kPeerRefused;
  return kPeerOk;
}

void PeerWatch::poll() {
  const bool check_process = ticks_++ % kProcessEvery == 0;
  uint32_t* mirror = mirror_.load(std::memory_order_acquire);
  for (int p = 0; p < num_ranks_; ++p) {
    if (p == rank_) continue;
    const uint32_t s = compute(p, check_process);
    if (s == status_[size_t(p)].load(std::memory_order_relaxed)) continue;
    status_[size_t(p)].store(s, std::memory_order_release);
    if (mirror) __atomic_store_n(mirror + p, s, __ATOMIC_RELEASE);
  }
}

}  // namespace portep
