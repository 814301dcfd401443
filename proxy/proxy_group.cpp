#include <stdexcept>

#include "proxy/proxy_impl.h"

namespace portep {

namespace {
std::atomic<int> g_live_threads{0};
using Clock = std::chrono::steady_clock;

void check_config(const ProxyConfig& c) {
  auto bad = [](const std::string& what) { throw std::invalid_argument(what); };
  if (c.num_ranks < 1 || uint32_t(c.num_ranks) > kMaxRanks)
    bad("num_ranks=" + std::to_string(c.num_ranks) + " must be in 1.." + std::to_string(kMaxRanks));
  if (c.num_threads < 1 || c.num_threads > 64)
    bad("num_proxy_threads=" + std::to_string(c.num_threads) + " must be in 1..64");
  if (c.num_fifos < c.num_threads)
    bad("num_fifos=" + std::to_string(c.num_fifos) + " must be >= num_proxy_threads=" + std::to_string(c.num_threads));
  if (c.fifo_capacity < 64 || (c.fifo_capacity & (c.fifo_capacity - 1)))
    bad("fifo_capacity=" + std::to_string(c.fifo_capacity) + " must be a power of two >= 64");
  if (c.num_streams < 1 || c.num_streams > kMaxStreams)
    bad("num_streams=" + std::to_string(c.num_streams) + " must be in 1.." + std::to_string(kMaxStreams));
  if (c.timeout_s <= 0) bad("timeout_s must be > 0");
}
}  // namespace

ProxyGroupImpl::ProxyGroupImpl(Transport* t, const ProxyConfig& c, uint64_t* slots)
    : transport(t), cfg(c), signal_slots(slots) {
  check_config(c);
  const TransportProps p = t->props();
  native_signals = p.ordered && p.remote_atomics;
  placed_writes = p.placed_writes;
  if (c.status_stream >= 0)
    watch = std::make_unique<PeerWatch>(t, c.rank, c.num_ranks, slots, c.num_streams, uint32_t(c.status_stream));
  if (!native_signals && c.num_streams > imm::kMaxStreams)
    throw std::invalid_argument("num_streams=" + std::to_string(c.num_streams) + " exceeds " +
                                std::to_string(imm::kMaxStreams) + ", the limit of the immediate encoding that the " +
                                p.name + " transport needs (it is unordered or has no remote atomics)");
  for (int i = 0; i < c.num_fifos; ++i) {
    auto f = std::make_unique<HostFifoStorage>();
    f->entries.assign(c.fifo_capacity, TransferCmd{0, 0});
    fifos.push_back(std::move(f));
  }
}

ProxyGroupImpl::~ProxyGroupImpl() = default;

void ProxyGroupImpl::latch(const std::string& msg) {
  std::lock_guard<std::mutex> lk(err_mu_);
  if (!failed_.load()) {
    error_ = msg;
    failed_.store(true, std::memory_order_release);
  }
}

std::string ProxyGroupImpl::error() const {
  std::lock_guard<std::mutex> lk(err_mu_);
  return error_;
}

FifoView ProxyGroupImpl::view(int i) const {
  if (i >= cfg.num_fifos) return device_fifos.at(size_t(i - cfg.num_fifos));
  HostFifoStorage& f = *fifos.at(size_t(i));
  return FifoView{f.entries.data(), &f.head, &f.tail, &f.error_flag, cfg.fifo_capacity};
}

void ProxyGroupImpl::wait_acks(const std::vector<std::pair<int, uint64_t>>& tickets, const char* what) {
  const auto start = Clock::now();
  const auto limit = std::chrono::nanoseconds(int64_t(cfg.timeout_s * 1e9));
  for (auto [fifo, ticket] : tickets) {
    for (uint64_t iter = 0; fifos[fifo]->ack.load(std::memory_order_acquire) < ticket; ++iter) {
      if (failed()) throw std::runtime_error(error());
      if (iter > 64) std::this_thread::sleep_for(std::chrono::microseconds(iter > 4096 ? 100 : 2));
      if (Clock::now() - start > limit)
        throw std::runtime_error(std::string(what) + " on rank " + std::to_string(cfg.rank) + ": FIFO " +
                                 std::to_string(fifo) + " was not drained within " + std::to_string(cfg.timeout_s) +
                                 " s");
    }
  }
}

void ProxyGroupImpl::wait_barrier_arrivals(uint64_t epoch) {
  const auto start = Clock::now();
  const auto limit = std::chrono::nanoseconds(int64_t(cfg.timeout_s * 1e9));
  std::atomic<uint64_t>& count = barrier_arrivals[(epoch & imm::kCtrlArgMask) % 4];
  const uint64_t expected = uint64_t(cfg.num_ranks - 1);
  for (uint64_t iter = 0; count.load(std::memory_order_acquire) < expected; ++iter) {
    if (failed()) throw std::runtime_error(error());
    if (iter > 64) std::this_thread::sleep_for(std::chrono::microseconds(iter > 4096 ? 100 : 2));
    if (Clock::now() - start > limit) {
      std::string peers;
      for (int p = 0; p < cfg.num_ranks; ++p)
        if (p != cfg.rank) peers += (peers.empty() ? "" : ", ") + transport->describe_peer(p);
      throw std::runtime_error("barrier " + std::to_string(epoch) + " on rank " + std::to_string(cfg.rank) + ": " +
                               std::to_string(count.load()) + " of " + std::to_string(expected) +
                               " peers arrived within " + std::to_string(cfg.timeout_s) + " s; peers: " + peers);
    }
  }
  count.fetch_sub(expected, std::memory_order_acq_rel);
}

ProxyGroup::ProxyGroup(Transport* transport, const ProxyConfig& cfg, uint64_t* signal_slots)
    : impl_(std::make_unique<ProxyGroupImpl>(transport, cfg, signal_slots)) {}

ProxyGroup::~ProxyGroup() { stop(); }

void ProxyGroup::attach_device_fifos(const std::vector<FifoView>& host_views) {
  if (!impl_->threads.empty()) throw std::runtime_error("attach_device_fifos after the proxies started");
  for (const FifoView& v : host_views)
    if (!v.entries || !v.tail || !v.error_flag || v.capacity == 0 || (v.capacity & (v.capacity - 1)))
      throw std::invalid_argument("a device FIFO view is incomplete or its capacity is not a power of two");
  impl_->device_fifos = host_views;
}

int ProxyGroup::num_device_fifos() const { return int(impl_->device_fifos.size()); }

void ProxyGroup::start() {
  if (!impl_->threads.empty()) return;
  if (impl_->watch) impl_->watch->start();
  for (int t = 0; t < impl_->cfg.num_threads; ++t)
    impl_->workers.push_back(std::make_unique<ProxyThread>(impl_.get(), t));
  for (int t = 0; t < impl_->cfg.num_threads; ++t) {
    ProxyThread* w = impl_->workers[t].get();
    g_live_threads.fetch_add(1);
    impl_->threads.emplace_back([w] {
      w->run();
      g_live_threads.fetch_sub(1);
    });
  }
}

void ProxyGroup::stop() {
  if (impl_->watch) impl_->watch->stop();
  impl_->stop_flag.store(true, std::memory_order_release);
  for (auto& t : impl_->threads)
    if (t.joinable()) t.join();
  impl_->threads.clear();
}

const ProxyConfig& ProxyGroup::config() const { return impl_->cfg; }
int ProxyGroup::num_fifos() const { return impl_->cfg.num_fifos; }
FifoView ProxyGroup::fifo(int i) const { return impl_->view(i); }
bool ProxyGroup::ordered_protocol() const { return impl_->native_signals; }

int ProxyGroup::fifo_for(uint32_t dst, uint32_t stream) const {
  // Spread (destination, stream) pairs over FIFOs; a pair always maps to the same FIFO.
  const uint64_t h = (uint64_t(dst) * 0x9E3779B1u) ^ (uint64_t(stream) * 0x85EBCA77u);
  return int((h ^ (h >> 15)) % uint64_t(impl_->cfg.num_fifos));
}

void ProxyGroup::push(int fifo, const TransferCmd& cmd, uint64_t* cached_tail) {
  check_error();
  if (fifo < 0 || fifo >= impl_->cfg.num_fifos)
    throw std::invalid_argument("fifo=" + std::to_string(fifo) + " must be in 0.." +
                                std::to_string(impl_->cfg.num_fifos - 1));
  if (!impl_->threads.size()) throw std::runtime_error("proxy group is not running");
  const int64_t timeout_ns = int64_t(impl_->cfg.timeout_s * 1e9);
  if (!fifo_host_push(impl_->view(fifo), cmd, cached_tail, timeout_ns)) {
    check_error();
    throw std::runtime_error("rank " + std::to_string(impl_->cfg.rank) + ": FIFO " + std::to_string(fifo) +
                             " had no room within " + std::to_string(impl_->cfg.timeout_s) + " s");
  }
}

void ProxyGroup::quiet_all() {
  std::lock_guard<std::mutex> lk(impl_->host_mu);
  std::vector<std::pair<int, uint64_t>> tickets;
  const uint64_t ticket = impl_->next_ticket++;
  for (int f = 0; f < impl_->cfg.num_fifos; ++f) {
    CmdFields q{kOpQuiet, 0, 0, 0, 0, ticket * kOffsetAlign, 0};
    TransferCmd cmd;
    cmd_encode(q, &cmd);
    uint64_t tail = 0;
    push(f, cmd, &tail);
    tickets.emplace_back(f, ticket);
  }
  impl_->wait_acks(tickets, "quiet");
}

void ProxyGroup::barrier() {
  quiet_all();
  std::lock_guard<std::mutex> lk(impl_->host_mu);
  const uint64_t epoch = ++impl_->barrier_epoch;
  const uint64_t ticket = impl_->next_ticket++;
  // remote_off carries the ticket the proxy acknowledges, local_off the epoch every rank counts alike.
  CmdFields b{kOpBarrier, 0, 0, 0, 0, ticket * kOffsetAlign, epoch * kOffsetAlign};
  TransferCmd cmd;
  cmd_encode(b, &cmd);
  uint64_t tail = 0;
  push(0, cmd, &tail);
  impl_->wait_acks({{0, ticket}}, "barrier");
  impl_->wait_barrier_arrivals(epoch);
}

void ProxyGroup::check_error() const {
  if (impl_->failed()) throw std::runtime_error(impl_->error());
}

const std::atomic<bool>* ProxyGroup::failed_flag() const { return impl_->failed_flag(); }

const PeerWatch* ProxyGroup::peer_watch() const { return impl_->watch.get(); }
PeerWatch* ProxyGroup::peer_watch() { return impl_->watch.get(); }

std::vector<ProxyThreadStats> ProxyGroup::stats() const {
  std::vector<ProxyThreadStats> out;
  for (auto& w : impl_->workers) out.push_back(w->stats);
  return out;
}

int ProxyGroup::live_threads() { return g_live_threads.load(); }

}  // namespace portep
