#include "portep/channel.h"

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
  if (proxies_) proxies_->stop();
  proxies_.reset();
  transport_.reset();  // unmaps and unlinks whatever is still named
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
  if (dst < 0 || dst >= opts_.proxy.num_ranks)
    throw std::invalid_argument("dst=" + std::to_string(dst) + " must be in 0.." + std::to_string(opts_.proxy.num_ranks - 1));
  if (stream >= opts_.proxy.num_streams)
    throw std::invalid_argument("stream=" + std::to_string(stream) + " must be < num_streams=" +
                                std::to_string(opts_.proxy.num_streams));
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
  if (dst < 0 || dst >= opts_.proxy.num_ranks)
    throw std::invalid_argument("dst=" + std::to_string(dst) + " must be in 0.." + std::to_string(opts_.proxy.num_ranks - 1));
  if (stream >= opts_.proxy.num_streams)
    throw std::invalid_argument("stream=" + std::to_string(stream) + " must be < num_streams=" +
                                std::to_string(opts_.proxy.num_streams));
  TransferCmd cmd;
  encode_or_throw(CmdFields{kOpSignal, final_signal ? uint32_t(kFlagFinal) : 0u, uint32_t(dst), 0, stream, 0, 0}, &cmd);
  const int f = g.fifo_for(uint32_t(dst), stream);
  g.push(f, cmd, &cached_tails_[f]);
}

void Channel::quiet() { proxies().quiet_all(); }

void Channel::barrier() { proxies().barrier(); }

uint64_t Channel::wait_signal(int src, uint32_t stream, uint64_t count, double timeout_s) {
  ProxyGroup& g = proxies();
  if (src < 0 || src >= opts_.proxy.num_ranks || stream >= opts_.proxy.num_streams)
    throw std::invalid_argument("signal slot (src=" + std::to_string(src) + ", stream=" + std::to_string(stream) +
                                ") is outside " + std::to_string(opts_.proxy.num_ranks) + " ranks x " +
                                std::to_string(opts_.proxy.num_streams) + " streams");
  const uint64_t* slot = signals_ + uint64_t(src) * opts_.proxy.num_streams + stream;
  const auto start = std::chrono::steady_clock::now();
  for (uint64_t iter = 0;; ++iter) {
    const uint64_t v = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
    if ((v & 0xffffffffu) >= count) return v;
    if ((iter & 255) == 255) {
      g.check_error();
      if (std::chrono::steady_clock::now() - start > std::chrono::duration<double>(timeout_s))
        throw std::runtime_error("rank " + std::to_string(opts_.proxy.rank) + ": signal (src " + std::to_string(src) +
                                 ", stream " + std::to_string(stream) + ") reached " + std::to_string(v & 0xffffffffu) +
                                 " of " + std::to_string(count) + " within " + std::to_string(timeout_s) + " s; " +
                                 transport_->describe_peer(src));
      std::this_thread::yield();
    }
  }
}

}  // namespace portep
