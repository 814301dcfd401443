#include <algorithm>
#include <thread>

#if defined(__linux__)
#include <sys/prctl.h>
#endif

#include "proxy/backoff.h"
#include "ordering/imm.h"
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
      pending_(uint32_t(g->cfg.num_ranks), g->cfg.num_streams),
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
  StreamEpoch& se = epochs_.at(f.dst_rank, f.stream);
  const int peer = int(f.dst_rank);
  if (!g_->native_signals) {
    if (se.units == imm::kMaxUnits) {  // the signal's unit field is full: close the epoch early
      CmdFields implicit = f;
      implicit.op = kOpSignal;
      implicit.flags &= ~kFlagFinal;
      handle_signal(implicit);
    }
    uint64_t wait_seq;
    if (se.units == 0 && se.must_wait_for(&wait_seq)) wait_retired_past(wait_seq, "WRITE (epoch window)", peer);
  }
  // Placed: the bytes are in dst's memory already. With native signals the stream's signal counts the unit and
  // nothing is posted; otherwise a zero-byte write carries the unit's immediate.
  const bool placed = f.flags & kFlagPlaced;
  if (placed) check_placed(f);
  if (!placed || !g_->native_signals) {
    const uint32_t imm_value = imm::encode_stream_write(f.stream, uint32_t(se.epoch));
    const uint32_t* imm = g_->native_signals ? nullptr : &imm_value;
    const uint32_t bytes = placed ? 0 : f.size;
    post_with_retry(bytes, "WRITE", peer, [&](uint64_t wr_id) {
      return g_->transport->post_write(index_, peer, f.local_off, f.remote_off, bytes, imm, wr_id);
    });
  }
  ++se.units;
  ++stats.writes;
  stats.bytes += f.size;
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
  StreamEpoch& se = epochs_.at(f.dst_rank, f.stream);
  const int peer = int(f.dst_rank);
  const bool final_signal = f.flags & kFlagFinal;
  uint64_t seq;
  if (g_->native_signals) {
    const uint64_t slot_off = (uint64_t(g_->cfg.rank) * g_->cfg.num_streams + f.stream) * 8;
    const uint64_t value = se.units + (final_signal ? kSignalFinalMark : 0);
    seq = post_with_retry(0, "SIGNAL", peer, [&](uint64_t wr_id) {
      return g_->transport->post_atomic_add(index_, peer, slot_off, value, wr_id);
    });
  } else {
    uint64_t wait_seq;
    if (se.units == 0 && se.must_wait_for(&wait_seq)) wait_retired_past(wait_seq, "SIGNAL (epoch window)", peer);
    const uint32_t imm_value = imm::encode_stream_signal(f.stream, uint32_t(se.epoch), se.units, final_signal);
    seq = post_with_retry(0, "SIGNAL", peer, [&](uint64_t wr_id) {
      return g_->transport->post_write(index_, peer, 0, 0, 0, &imm_value, wr_id);
    });
  }
  se.close(seq);
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
  const uint32_t imm_value = imm::encode_control(imm::kCtrlBarrier, uint32_t(epoch & imm::kCtrlArgMask));
  for (int peer = 0; peer < g_->cfg.num_ranks; ++peer) {
    if (peer == g_->cfg.rank) continue;
    post_with_retry(0, "BARRIER", peer, [&](uint64_t wr_id) {
      return g_->transport->post_write(index_, peer, 0, 0, 0, &imm_value, wr_id);
    });
  }
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
  stats.held_signals = pending_.held();
  stats.in_flight = inflight_.posted() - inflight_.retired();
  // The backlog is for diagnosing waits: taken on polls that moved nothing, not on every busy one.
  if (!stats.in_flight)
    stats.backlog = TransportBacklog{};
  else if (n + m == 0)
    stats.backlog = g_->transport->backlog(index_);
  return n + m > 0;
}

void ProxyThread::apply_notice(const RecvNotice& n) {
  const imm::Decoded d = imm::decode(n.imm);
  releases_.clear();
  switch (d.kind) {
    case imm::kStreamWrite:
      if (!d.valid) throw std::runtime_error("malformed STREAM_WRITE immediate from rank " + std::to_string(n.src));
      if (!g_->cfg.skip_ordering) pending_.on_write(n.src, d.stream, d.epoch, &releases_);
      break;
    case imm::kStreamSignal:
      if (g_->cfg.skip_ordering)
        releases_.push_back(SignalRelease{n.src, d.stream, d.units, d.final_signal});
      else
        pending_.on_signal(n.src, d.stream, d.epoch, d.units, d.final_signal, &releases_);
      if (releases_.empty()) ++stats.signals_delayed;
      break;
    case imm::kControl:
      if (d.op != imm::kCtrlBarrier)
        throw std::runtime_error("unknown control message " + std::to_string(d.op) + " from rank " +
                                 std::to_string(n.src));
      g_->barrier_arrivals[d.arg % 4].fetch_add(1, std::memory_order_acq_rel);
      return;
    case imm::kSeqAdd:
      throw std::runtime_error("sequenced add from rank " + std::to_string(n.src) +
                               ": no HT stream is registered with this proxy group");
  }
  for (const SignalRelease& r : releases_) {
    uint64_t* slot = g_->signal_slots + (uint64_t(r.src) * g_->cfg.num_streams + r.stream);
    // Release: the notification's acquire (ring head) made the writes visible; publish them with the count.
    __atomic_fetch_add(slot, r.units + (r.final_signal ? kSignalFinalMark : 0), __ATOMIC_RELEASE);
  }
}

void ProxyThread::timeout_error(const char* what, int peer) {
  std::string who = peer >= 0 ? " to " + g_->transport->describe_peer(peer) : std::string();
  throw std::runtime_error(std::string(what) + who + " made no progress within " + std::to_string(g_->cfg.timeout_s) +
                           " s (" + std::to_string(inflight_.posted() - inflight_.retired()) +
                           " operations in flight, " + std::to_string(pending_.held()) + " signals held)");
}

}  // namespace portep
