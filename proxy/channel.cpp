#include "proxy/channel.h"

#include "proxy/backoff.h"

#include <chrono>
#include <stdexcept>
#include <thread>

namespace portep {

Channel::Channel(const ChannelOptions& o) : opts_(o) {
  opts_.transport.num_channels = o.proxy.num_threads;
  opts_.transport.rank = o.proxy.rank;
  opts_.transport.num_ranks = o.proxy.num_ranks;
  if (o.data_bytes == 0 || o.data_bytes > kMaxOffset + kOffsetAlign)
    throw std::invalid_argument("nbytes=" + std::to_string(o.data_bytes) + " must be in 1.." +
                                std::to_string(kMaxOffset + kOffsetAlign) + " (64 GiB, the command's reach)");
  transport_ = make_transport(opts_.transport);
  data_ = static_cast<uint8_t*>(transport_->alloc_region(kRegionData, o.data_bytes));
  signals_ = static_cast<uint64_t*>(transport_->alloc_region(kRegionSignal, signal_slots() * 8));
  proxies_ = std::make_unique<ProxyGroup>(transport_.get(), opts_.proxy, signals_);
  cached_tails_.assign(size_t(opts_.proxy.num_fifos), 0);
}

Channel::~Channel() { destroy(); }

std::string Channel::endpoint_blob() { return transport_->endpoint_blob(); }

void Channel::connect(const std::vector<std::string>& blobs) { transport_->connect(blobs); }

void Channel::bootstrap_done() {
  transport_->bootstrap_done();
  proxies_->start();
}

void Channel::destroy() {
  // Deliver what was already pushed (a final signal a peer still waits for may sit in a FIFO or in the
  // transport's window); skipped when a proxy failed, and bounded by the timeout like every wait.
  if (proxies_) {
    try {
      proxies_->check_error();
      proxies_->quiet_all();
    } catch (const std::exception&) {
    }
    proxies_->stop();
  }
  proxies_.reset();
  transport_.reset();  // unmaps its segments, unless a memory_owner() holder remains
  data_ = nullptr;
  signals_ = nullptr;
}

ProxyGroup& Channel::proxies() {
  if (!proxies_) throw std::runtime_error("channel was destroyed");
  return *proxies_;
}

void Channel::encode_or_throw(const CmdFields& f, TransferCmd* out) const {
  int st = cmd_encode(f, out);
  if (st != kEncodeOk) throw std::invalid_argument(cmd_encode_status_text(st));
}

void Channel::write(int dst, uint64_t local_off, uint64_t remote_off, uint64_t bytes, uint32_t stream) {
  ProxyGroup& g = proxies();
  check_peer_stream("dst", dst, stream);
  if (local_off + bytes > opts_.data_bytes || remote_off + bytes > opts_.data_bytes)
    throw std::invalid_argument("range of " + std::to_string(bytes) + " bytes at local_offset=" +
                                std::to_string(local_off) + " / remote_offset=" + std::to_string(remote_off) +
                                " exceeds the registered " + std::to_string(opts_.data_bytes) + " bytes");
  TransferCmd cmd;
  encode_or_throw(CmdFields{kOpWrite, 0, uint32_t(dst), uint32_t(bytes > kMaxCmdBytes ? kMaxCmdBytes + 1 : bytes),
                            stream, remote_off, local_off},
                  &cmd);
  const int f = g.fifo_for(uint32_t(dst), stream);
  g.push(f, cmd, &cached_tails_[f]);
}

void Channel::signal(int dst, uint32_t stream, bool final_signal) {
  ProxyGroup& g = proxies();
  check_peer_stream("dst", dst, stream);
  TransferCmd cmd;
  encode_or_throw(CmdFields{kOpSignal, final_signal ? uint32_t(kFlagFinal) : 0u, uint32_t(dst), 0, stream, 0, 0}, &cmd);
  const int f = g.fifo_for(uint32_t(dst), stream);
  g.push(f, cmd, &cached_tails_[f]);
}

void Channel::quiet() { proxies().quiet_all(); }

void Channel::barrier() { proxies().barrier(); }

void Channel::check_peer_stream(const char* peer_name, int peer, uint32_t stream) const {
  if (peer < 0 || peer >= opts_.proxy.num_ranks)
    throw std::invalid_argument(std::string(peer_name) + "=" + std::to_string(peer) + " must be in 0.." +
                                std::to_string(opts_.proxy.num_ranks - 1));
  if (stream >= opts_.proxy.num_streams)
    throw std::invalid_argument("stream=" + std::to_string(stream) +
                                " must be < num_streams=" + std::to_string(opts_.proxy.num_streams));
}

uint64_t* Channel::slot(int src, uint32_t stream) const {
  check_peer_stream("src", src, stream);
  return signals_ + uint64_t(src) * opts_.proxy.num_streams + stream;
}

// Polls slot (src, stream) until ready(value). Gives up after timeout_s, or soon after the peer watch says src
// will not answer (its process is gone, it left, it refused the call): what src sent before is still delivered
// during kPeerGrace, since its notice may overtake its last data. Returns kPeerOk with *value, else why it gave up
// (kWaitTimedOut for the timeout). Raises a latched proxy error.
constexpr auto kPeerGrace = std::chrono::nanoseconds(kPeerGraceNs);
template <class Ready>
uint32_t Channel::wait_slot_for(int src, uint32_t stream, double timeout_s, Ready ready, uint64_t* value) {
  using Clock = std::chrono::steady_clock;
  ProxyGroup& g = proxies();
  const PeerWatch* watch = g.peer_watch();
  uint64_t* p = slot(src, stream);
  const auto start = Clock::now();
  auto down_since = Clock::time_point::max();
  for (uint64_t iter = 0;; ++iter) {
    *value = __atomic_load_n(p, __ATOMIC_ACQUIRE);
    if (ready(*value)) return kPeerOk;
    if ((iter & 255) == 255) {
      g.check_error();
      const auto now = Clock::now();
      const uint32_t status = watch && src != opts_.proxy.rank ? watch->status(src) : kPeerOk;
      if (status == kPeerOk) {
        down_since = Clock::time_point::max();
      } else if (down_since == Clock::time_point::max()) {
        down_since = now;
      } else if (now - down_since > kPeerGrace) {
        return status;
      }
      if (now - start > std::chrono::duration<double>(timeout_s)) return kWaitTimedOut;
    }
    backoff(kHostWait, iter);
  }
}

// wait_slot_for, raising failure(value) with the reason when it gives up.
template <class Ready, class Failure>
uint64_t Channel::wait_slot(int src, uint32_t stream, double timeout_s, Ready ready, Failure failure) {
  uint64_t v = 0;
  const uint32_t why = wait_slot_for(src, stream, timeout_s, ready, &v);
  if (why != kPeerOk) raise_wait_failure(src, why, timeout_s, failure(v));
  return v;
}

void Channel::raise_wait_failure(int src, uint32_t why, double timeout_s, const std::string& what) const {
  const std::string head = "rank " + std::to_string(opts_.proxy.rank) + ": " + what;
  if (why == kWaitTimedOut)
    throw std::runtime_error(head + " within " + std::to_string(timeout_s) + " s; " + transport_->describe_peer(src));
  throw std::runtime_error(head + ": rank " + std::to_string(src) + " " + peer_status_text(why) + " (" +
                           transport_->describe_peer(src) + ")");
}

uint64_t Channel::wait_signal(int src, uint32_t stream, uint64_t count, double timeout_s) {
  return wait_slot(
      src, stream, timeout_s, [&](uint64_t v) { return (v & 0xffffffffu) >= count; },
      [&](uint64_t v) {
        return "signal (src " + std::to_string(src) + ", stream " + std::to_string(stream) + ") reached " +
               std::to_string(v & 0xffffffffu) + " of " + std::to_string(count);
      });
}

// This rank's own regions are always reachable, also on transports that map no peer (verbs).
uint8_t* Channel::peer_data(int dst) const {
  if (!transport_) return nullptr;
  void* p = transport_->peer_region(dst, kRegionData);
  return static_cast<uint8_t*>(p ? p : (dst == opts_.proxy.rank ? data_ : nullptr));
}

uint64_t Channel::peer_data_bytes(int dst) const {
  if (!transport_) return 0;
  if (transport_->peer_region(dst, kRegionData)) return transport_->peer_region_bytes(dst, kRegionData);
  return dst == opts_.proxy.rank ? opts_.data_bytes : 0;
}

void Channel::direct_signal(int dst, uint32_t stream, uint64_t units, bool final_signal) {
  check_peer_stream("dst", dst, stream);
  auto* slots = transport_ ? static_cast<uint64_t*>(transport_->peer_region(dst, kRegionSignal)) : nullptr;
  if (!slots && transport_ && dst == opts_.proxy.rank) slots = signals_;
  if (!slots)
    throw std::invalid_argument("rank " + std::to_string(dst) + " is not reachable by direct stores from rank " +
                                std::to_string(opts_.proxy.rank));
  uint64_t* slot = slots + uint64_t(opts_.proxy.rank) * opts_.proxy.num_streams + stream;
  __atomic_fetch_add(slot, units + (final_signal ? kSignalFinalMark : 0), __ATOMIC_RELEASE);
}

uint64_t Channel::consume_signal(int src, uint32_t stream, uint64_t min_units, bool need_final, double timeout_s) {
  const uint64_t v = wait_slot(
      src, stream, timeout_s, [&](uint64_t v) { return need_final ? (v >> 32) >= 1 : (v & 0xffffffffu) >= min_units; },
      [&](uint64_t v) {
        return "no " + (need_final ? std::string("final signal") : std::to_string(min_units) + " units") + " on (src " +
               std::to_string(src) + ", stream " + std::to_string(stream) + "), have " +
               std::to_string(v & 0xffffffffu) + " units";
      });
  return take(src, stream, v, min_units, need_final);
}

uint64_t Channel::take(int src, uint32_t stream, uint64_t value, uint64_t min_units, bool need_final) {
  const uint64_t units = need_final ? (value & 0xffffffffu) : min_units;
  __atomic_fetch_sub(slot(src, stream), need_final ? units + kSignalFinalMark : min_units, __ATOMIC_ACQ_REL);
  return units;
}

void Channel::announce(StatusEvent kind) {
  if (opts_.proxy.status_stream < 0) throw std::logic_error("announce: this Channel has no status streams");
  const uint32_t stream = uint32_t(opts_.proxy.status_stream) + kind;
  for (int dst = 0; dst < opts_.proxy.num_ranks; ++dst) {
    if (dst == opts_.proxy.rank || transport_->peer_region(dst, kRegionSignal))
      direct_signal(dst, stream, 0, true);
    else
      signal(dst, stream, true);
  }
}

uint32_t Channel::peer_status(int peer) const {
  const PeerWatch* w = proxies_ ? proxies_->peer_watch() : nullptr;
  return w && peer != opts_.proxy.rank ? w->status(peer) : kPeerOk;
}

uint64_t Channel::status_events(int src, StatusEvent kind) const {
  const PeerWatch* w = proxies_ ? proxies_->peer_watch() : nullptr;
  return w ? w->events(src, kind) : 0;
}

uint32_t Channel::try_consume_final(int src, uint32_t stream, double timeout_s, uint64_t* units) {
  uint64_t v = 0;
  const uint32_t why = wait_slot_for(src, stream, timeout_s, [](uint64_t v) { return (v >> 32) >= 1; }, &v);
  *units = why == kPeerOk ? take(src, stream, v, 0, true) : 0;
  return why;
}

}  // namespace portep
