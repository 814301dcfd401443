#include <algorithm>
#include <thread>

#if defined(__linux__)
#include <sys/prctl.h>
#endif

#include "proxy/backoff.h"
#include "proxy/proxy_impl.h"

namespace portep {

namespace {
using Clock = std::chrono::steady_clock;
constexpr int kPopBatch = 64;
constexpr int kPollBatch = 256;

// Short sleeps of an idle proxy end when asked, not up to 50 us later (Linux's default timer slack).
void set_short_timer_slack() {
#ifdef PR_SET_TIMERSLACK
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);  // best effort: a refusal only costs latency
#endif
}

size_t power_of_two_at_least(uint64_t n) {
  size_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

}  // namespace

IdleWaiter ProxyThread::idle_waiter() const {
  return IdleWaiter(kIdleProxy, std::chrono::nanoseconds(int64_t(g_->cfg.idle_spin_us * 1e3)));
}

ProxyThread::ProxyThread(ProxyGroupImpl* g, int index)
    : g_(g),
      index_(index),
      inflight_(g->cfg.max_inflight_cmds, g->cfg.max_inflight_bytes),
      protocol_(uint32_t(g->cfg.num_ranks), g->cfg.num_streams, g->native_signals, g->cfg.skip_ordering),
      post_times_(power_of_two_at_least(g->cfg.max_inflight_cmds)),
      post_mask_(post_times_.size() - 1),
      timeout_(std::chrono::nanoseconds(int64_t(g->cfg.timeout_s * 1e9))) {
  const int all_fifos = g->cfg.num_fifos + int(g->device_fifos.size());
  for (int f = index; f < g->cfg.num_fifos; f += g->cfg.num_threads) fifos_.push_back(f);
  for (int f = g->cfg.num_fifos + index; f < all_fifos; f += g->cfg.num_threads) fifos_.push_back(f);
  for (int f : fifos_) consumers_.emplace_back(g->view(f));
}

void ProxyThread::run() {
  set_short_timer_slack();
  IdleWaiter idle = idle_waiter();
  try {
    while (!g_->stop_flag.load(std::memory_order_acquire)) {
      int popped = 0;
      for (size_t i = 0; i < fifos_.size(); ++i) {
        TransferCmd cmd;
        int n = 0;
        while (n < kPopBatch && consumers_[i].pop(&cmd)) {
          handle(cmd, fifos_[i]);
          ++n;
        }
        if (n == 0) consumers_[i].flush();
        popped += n;
      }
      bool moved = progress();
      if (popped || moved) {
        idle.reset();
        continue;
      }
      for (int f : fifos_)
        if (__atomic_load_n(g_->view(f).error_flag, __ATOMIC_ACQUIRE))
          throw std::runtime_error("a producer of FIFO " + std::to_string(f) + " timed out waiting for room");
      idle.wait();
    }
  } catch (const std::exception& e) {
    g_->latch("rank " + std::to_string(g_->cfg.rank) + " proxy thread " + std::to_string(index_) + ": " + e.what());
  }
}

void ProxyThread::handle(const TransferCmd& cmd, int fifo) {
  const CmdFields f = cmd_decode(cmd);
  ++stats.commands;
  switch (f.op) {
    case kOpWrite:
      return handle_write(f);
    case kOpSignal:
      return handle_signal(f);
    case kOpQuiet:
      return handle_quiet(f, fifo);
    case kOpBarrier:
      return handle_barrier(f, fifo);
    case kOpNop:
      return;
  }
  throw std::runtime_error("FIFO " + std::to_string(fifo) + " held an invalid command (opcode " + std::to_string(f.op) +
                           ")");
}

template <class PostFn>
uint64_t ProxyThread::post_with_retry(uint64_t bytes, const char* what, int peer, PostFn&& post) {
  const auto start = Clock::now();
  IdleWaiter idle = idle_waiter();
  for (uint64_t iter = 1;; ++iter) {
    if (inflight_.has_room(bytes)) {
      const uint64_t seq = inflight_.posted();
      const auto t0 = Clock::now();
      const bool posted = post(seq);
      const auto t1 = Clock::now();
      stats.post_ns += uint64_t((t1 - t0).count());
      if (posted) {
        post_times_[seq & post_mask_] = t1;
        return inflight_.on_post(bytes);
      }
    }
    if (progress())
      idle.reset();
    else
      idle.wait();
    if ((iter & 63) == 0 && Clock::now() - start > timeout_) timeout_error(what, peer);
  }
}

void ProxyThread::handle_write(const CmdFields& f) {
  if (f.dst_rank >= uint32_t(g_->cfg.num_ranks))
    throw std::runtime_error("WRITE to rank " + std::to_string(f.dst_rank) + " but the group has " +
                             std::to_string(g_->cfg.num_ranks) + " ranks");
  if (f.stream >= g_->cfg.num_streams)
    throw std::runtime_error("WRITE on stream " + std::to_string(f.stream) + " but num_streams is " +
                             std::to_string(g_->cfg.num_streams));
  const bool placed = f.flags & kFlagPlaced;
  if (placed) check_placed(f);
  protocol_.write(int(f.dst_rank), f.stream, f.local_off, f.remote_off, f.size, placed, *this);
  ++stats.writes;
  stats.bytes += f.size;
}

uint64_t ProxyThread::post_write(int peer, uint64_t local_off, uint64_t remote_off, uint32_t bytes, const uint32_t* imm,
                                 const char* what) {
  return post_with_retry(bytes, what, peer, [&](uint64_t wr_id) {
    return g_->transport->post_write(index_, peer, local_off, remote_off, bytes, imm, wr_id);
  });
}

uint64_t ProxyThread::post_slot_add(int peer, uint32_t stream, uint32_t units, bool final_signal) {
  const uint64_t slot_off = (uint64_t(g_->cfg.rank) * g_->cfg.num_streams + stream) * 8;
  const uint64_t value = units + (final_signal ? kSignalFinalMark : 0);
  return post_with_retry(0, "SIGNAL", peer, [&](uint64_t wr_id) {
    return g_->transport->post_atomic_add(index_, peer, slot_off, value, wr_id);
  });
}

// A placed WRITE's bytes were stored by its producer, so no transport checked where: its range must lie in the
// destination's region (a layout that differs between ranks would otherwise go unnoticed).
void ProxyThread::check_placed(const CmdFields& f) const {
  const std::string what = "a placed WRITE to rank " + std::to_string(f.dst_rank);
  if (!g_->placed_writes)
    throw std::runtime_error(what + " on transport " + g_->transport->props().name +
                             ", which takes none (its peers' memory is not mapped here)");
  const uint64_t limit = g_->transport->peer_region_bytes(int(f.dst_rank), kRegionData);
  if (f.remote_off > limit || f.size > limit - f.remote_off)
    throw std::runtime_error(what + " covers [" + std::to_string(f.remote_off) + ", +" + std::to_string(f.size) +
                             "), outside its region of " + std::to_string(limit) + " bytes");
}

void ProxyThread::handle_signal(const CmdFields& f) {
  if (f.dst_rank >= uint32_t(g_->cfg.num_ranks) || f.stream >= g_->cfg.num_streams)
    throw std::runtime_error("SIGNAL to rank " + std::to_string(f.dst_rank) + " stream " + std::to_string(f.stream) +
                             " is outside " + std::to_string(g_->cfg.num_ranks) + " ranks x " +
                             std::to_string(g_->cfg.num_streams) + " streams");
  protocol_.signal(int(f.dst_rank), f.stream, f.flags & kFlagFinal, *this);
  ++stats.signals;
}

void ProxyThread::check_host_fifo(const char* what, int fifo) const {
  if (fifo >= g_->cfg.num_fifos)
    throw std::runtime_error(std::string(what) + " arrived on device FIFO " + std::to_string(fifo - g_->cfg.num_fifos) +
                             "; only host callers may push it");
}

void ProxyThread::handle_quiet(const CmdFields& f, int fifo) {
  check_host_fifo("QUIET", fifo);
  wait_idle("QUIET");
  g_->fifos[fifo]->ack.store(f.remote_off / kOffsetAlign, std::memory_order_release);
}

void ProxyThread::handle_barrier(const CmdFields& f, int fifo) {
  check_host_fifo("BARRIER", fifo);
  wait_idle("BARRIER");
  const uint64_t ticket = f.remote_off / kOffsetAlign;
  const uint64_t epoch = f.local_off / kOffsetAlign;
  const uint32_t imm_value = SignalProtocol::barrier_imm(epoch);
  for (int peer = 0; peer < g_->cfg.num_ranks; ++peer)
    if (peer != g_->cfg.rank) post_write(peer, 0, 0, 0, &imm_value, "BARRIER");
  wait_idle("BARRIER");
  g_->fifos[fifo]->ack.store(ticket, std::memory_order_release);
}

void ProxyThread::wait_retired_past(uint64_t seq, const char* what, int peer) {
  const auto start = Clock::now();
  IdleWaiter idle = idle_waiter();
  for (uint64_t iter = 1; inflight_.retired() <= seq; ++iter) {
    if (progress())
      idle.reset();
    else
      idle.wait();
    if ((iter & 63) == 0 && Clock::now() - start > timeout_) timeout_error(what, peer);
  }
}

void ProxyThread::wait_idle(const char* what) {
  if (inflight_.idle()) return;
  wait_retired_past(inflight_.posted() - 1, what, -1);
}

bool ProxyThread::progress() {
  uint64_t done[kPollBatch];
  const auto t0 = Clock::now();
  int n = g_->transport->poll_send(index_, done, kPollBatch);
  const auto t1 = Clock::now();
  for (int i = 0; i < n; ++i) {
    inflight_.on_complete(done[i]);
    const uint64_t latency = uint64_t((t1 - post_times_[done[i] & post_mask_]).count());
    stats.op_latency_ns += latency;
    stats.op_latency_max_ns = std::max(stats.op_latency_max_ns, latency);
  }
  stats.completed += uint64_t(n);
  RecvNotice notices[kPollBatch];
  int m = g_->transport->poll_recv(index_, notices, kPollBatch);
  // Every write these notices cover has landed: one flush makes them all visible to kernels before any of
  // their signals is published.
  if (m) g_->transport->make_writes_visible(index_);
  ++stats.polls;
  stats.poll_ns += uint64_t((Clock::now() - t0).count());
  for (int i = 0; i < m; ++i) apply_notice(notices[i]);
  stats.notices += uint64_t(m);
  stats.held_signals = protocol_.held();
  stats.in_flight = inflight_.posted() - inflight_.retired();
  // The backlog is for diagnosing waits: taken on polls that moved nothing, not on every busy one.
  if (!stats.in_flight)
    stats.backlog = TransportBacklog{};
  else if (n + m == 0)
    stats.backlog = g_->transport->backlog(index_);
  return n + m > 0;
}

void ProxyThread::apply_notice(const RecvNotice& n) {
  releases_.clear();
  const NoticeResult r = protocol_.on_notice(n.src, n.imm, &releases_);
  if (r.kind == NoticeResult::kBarrier) {
    g_->barrier_arrivals[r.barrier_epoch % 4].fetch_add(1, std::memory_order_acq_rel);
    return;
  }
  if (r.signal_held) ++stats.signals_delayed;
  for (const SignalRelease& rel : releases_) {
    uint64_t* slot = g_->signal_slots + (uint64_t(rel.src) * g_->cfg.num_streams + rel.stream);
    // Release: the notification's acquire (ring head) made the writes visible; publish them with the count.
    __atomic_fetch_add(slot, rel.units + (rel.final_signal ? kSignalFinalMark : 0), __ATOMIC_RELEASE);
  }
}

void ProxyThread::timeout_error(const char* what, int peer) {
  std::string who = peer >= 0 ? " to " + g_->transport->describe_peer(peer) : std::string();
  throw std::runtime_error(std::string(what) + who + " made no progress within " + std::to_string(g_->cfg.timeout_s) +
                           " s (" + std::to_string(inflight_.posted() - inflight_.retired()) +
                           " operations in flight, " + std::to_string(protocol_.held()) + " signals held)");
}

}  // namespace portep
