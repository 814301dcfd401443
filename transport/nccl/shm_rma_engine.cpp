#include "transport/nccl/shm_rma_engine.h"

#include <string.h>
#include <unistd.h>

#include "transport/endpoint_text.h"
#include "transport/shm/peer_process.h"
#include "transport/transport.h"

namespace portep {

namespace {
const char* kWindowTags[kNumRmaWindows] = {"rma-data", "rma-control"};
constexpr int kMaxHeldOps = 8;  // a lane holds at most this many operations back
// A put in flight lands within this long (as of the lane's next progress): the data window's puts, as large ones
// would, take longer than the control window's 16-byte records, which so often land before the bytes they announce.
constexpr int kMaxLandingUs[kNumRmaWindows] = {500, 20};
}  // namespace

ShmRmaEngine::ShmRmaEngine(int rank, int num_ranks, uint64_t seed)
    : rank_(rank),
      num_ranks_(num_ranks),
      lanes_(size_t(num_ranks)),
      armed_(size_t(num_ranks)),
      arm_order_(size_t(num_ranks)),
      arm_total_(size_t(num_ranks)) {
  counters_ = ShmSegment::create("rma-signals", size_t(num_ranks) * sizeof(uint64_t));
  for (int p = 0; p < num_ranks; ++p) lanes_[p].rng.seed(seed * 1000003u + uint64_t(rank) * 7919u + uint64_t(p));
}

ShmRmaEngine::~ShmRmaEngine() {
  if (peers_.empty()) return;
  for (auto& order : arm_order_) order = 0;  // nothing waits any more
  for (int p = 0; p < num_ranks_; ++p) progress(p, true);
}

void* ShmRmaEngine::alloc_window(RmaWindow w, size_t bytes) {
  windows_[w] = ShmSegment::create(kWindowTags[w], bytes ? bytes : 64);
  return windows_[w].data();
}

std::string ShmRmaEngine::endpoint_blob() {
  std::string out = std::to_string(getpid()) + "\n" + counters_.name() + "\n";
  for (const ShmSegment& w : windows_) {
    if (!w.data()) throw TransportError("nccl-emulated: allocate both windows before the endpoint description");
    out += w.name() + "\n" + std::to_string(w.size()) + "\n";
  }
  return out;
}

void ShmRmaEngine::connect(const std::vector<std::string>& blobs) {
  if (int(blobs.size()) != num_ranks_)
    throw TransportError("nccl-emulated: connect got " + std::to_string(blobs.size()) + " endpoints for " +
                         std::to_string(num_ranks_) + " ranks");
  peers_.clear();
  peers_.resize(size_t(num_ranks_));
  for (int p = 0; p < num_ranks_; ++p) {
    const auto f = split_lines(blobs[p]);
    if (f.size() != 2 + 2 * kNumRmaWindows)
      throw TransportError("nccl-emulated: malformed endpoint description from rank " + std::to_string(p));
    Peer& peer = peers_[p];
    peer.pid = std::stoi(f[0]);
    for (int w = 0; w < kNumRmaWindows; ++w) {
      peer.bytes[w] = std::stoull(f[3 + 2 * w]);
      if (p == rank_) {
        peer.windows[w] = static_cast<char*>(windows_[w].data());
      } else {
        peer.maps.push_back(ShmSegment::open(f[2 + 2 * w], peer.bytes[w]));
        peer.windows[w] = static_cast<char*>(peer.maps.back().data());
      }
    }
    if (p == rank_) {
      peer.counters = static_cast<uint64_t*>(counters_.data());
    } else {
      peer.maps.push_back(ShmSegment::open(f[1], size_t(num_ranks_) * sizeof(uint64_t)));
      peer.counters = static_cast<uint64_t*>(peer.maps.back().data());
    }
  }
}

void ShmRmaEngine::bootstrap_done() {  // every peer has mapped the segments: nothing may open them any more
  counters_.stop_sharing();
  for (ShmSegment& w : windows_) w.stop_sharing();
}

void ShmRmaEngine::check(int peer, RmaWindow w, uint64_t off, size_t bytes, bool remote, const char* what) const {
  if (peer < 0 || peer >= int(peers_.size()))
    throw TransportError("nccl-emulated: " + std::string(what) + " to rank " + std::to_string(peer) + " of " +
                         std::to_string(num_ranks_) + " (connected: " + (peers_.empty() ? "no" : "yes") + ")");
  const size_t size = peers_[remote ? peer : rank_].bytes[w];
  if (off > size || bytes > size - off)
    throw TransportError("nccl-emulated: " + std::string(what) + " of " + std::to_string(bytes) + " bytes at " +
                         std::to_string(off) + " overruns " + (remote ? "rank " + std::to_string(peer) + "'s" : "the") +
                         " " + kWindowTags[w] + " window of " + std::to_string(size) + " bytes");
}

void ShmRmaEngine::write_words(int peer, RmaWindow w, uint64_t off, const uint64_t* words, int count) {
  const size_t bytes = size_t(count) * sizeof(uint64_t);
  check(peer, w, off, bytes, false, "write_words");
  enqueue(peer, Op{false, w, off, 0, std::string(reinterpret_cast<const char*>(words), bytes), bytes});
}

void ShmRmaEngine::put_signal(int peer, RmaWindow w, uint64_t local_off, uint64_t remote_off, size_t bytes) {
  check(peer, w, local_off, bytes, false, "put source");
  check(peer, w, remote_off, bytes, true, "put");
  enqueue(peer, Op{true, w, local_off, remote_off, {}, bytes});
}

void ShmRmaEngine::enqueue(int peer, Op op) {
  Lane& lane = lanes_[peer];
  op.order = ++order_;
  lane.queued.push_back(std::move(op));
  ++lane.enqueued;
  progress(peer, false);
}

// Carries out a seeded number of the lane's oldest operations (all but kMaxHeldOps at least; all: every one), then
// lands and counts puts in flight.
void ShmRmaEngine::progress(int peer, bool all) {
  Lane& lane = lanes_[peer];
  size_t n = lane.queued.size();
  if (!all && n) {
    const size_t least = n > size_t(kMaxHeldOps) ? n - kMaxHeldOps : 0;
    n = least + size_t(lane.rng() % (n - least + 1));
  }
  for (size_t i = 0; i < n; ++i) {
    if (held_by_an_arm(lane.queued.front().order)) break;
    Op op = std::move(lane.queued.front());
    lane.queued.pop_front();
    carry_out(peer, op);
    op.lands_at = std::chrono::steady_clock::now() + std::chrono::microseconds(lane.rng() % kMaxLandingUs[op.window]);
    ++lane.carried_out;
    if (op.put) lane.in_flight.push_back(std::move(op));
  }
  land_and_count(peer, all);
}

// Whether an operation enqueued at `order` waits behind an arm enqueued before it whose signals have not all come.
bool ShmRmaEngine::held_by_an_arm(uint64_t order) const {
  for (int src = 0; src < num_ranks_; ++src) {
    const uint64_t at = arm_order_[src].load(std::memory_order_acquire);
    if (at && at < order &&
        __atomic_load_n(&peers_[rank_].counters[src], __ATOMIC_ACQUIRE) <
            arm_total_[src].load(std::memory_order_relaxed))
      return true;
  }
  return false;
}

void ShmRmaEngine::carry_out(int peer, Op& op) {
  char* mine = peers_[rank_].windows[op.window];
  if (op.put)
    op.bytes.assign(mine + op.local_off, op.size);  // the source is read now; its bytes land later
  else
    memcpy(mine + op.local_off, op.bytes.data(), op.size);
}

// Lands a seeded choice of the puts in flight (all: every one), then counts, in lane order, each put that landed
// after every earlier one did.
void ShmRmaEngine::land_and_count(int peer, bool all) {
  Lane& lane = lanes_[peer];
  const auto now = std::chrono::steady_clock::now();
  for (Op& op : lane.in_flight) {
    if (op.landed || (!all && now < op.lands_at)) continue;
    memcpy(peers_[peer].windows[op.window] + op.remote_off, op.bytes.data(), op.size);
    op.landed = true;
  }
  while (!lane.in_flight.empty() && lane.in_flight.front().landed) {
    lane.in_flight.pop_front();
    // Release: the bytes this put and the lane's earlier ones landed are visible with the count.
    __atomic_add_fetch(&peers_[peer].counters[rank_], 1, __ATOMIC_RELEASE);
  }
}

uint64_t ShmRmaEngine::mark(int peer) {
  check(peer, kRmaData, 0, 0, false, "mark");
  return lanes_[peer].enqueued;
}

bool ShmRmaEngine::complete(int peer, uint64_t ticket) {
  check(peer, kRmaData, 0, 0, false, "complete");
  Lane& lane = lanes_[peer];
  progress(peer, lane.rng() % 4 == 0);  // also lands the lane's puts in flight: the peer waits for them
  return lane.carried_out >= ticket;
}

void ShmRmaEngine::drive(int peer) {
  check(peer, kRmaData, 0, 0, false, "drive");
  progress(peer, lanes_[peer].rng() % 4 == 0);
}

void ShmRmaEngine::arm(int src, uint64_t total, uint64_t off, size_t bytes, void* host_dst) {
  check(src, kRmaControl, off, bytes, false, "arm");
  if (armed_[src].on) throw TransportError("nccl-emulated: source " + std::to_string(src) + " is already armed");
  armed_[src] = Armed{true, total, off, bytes, host_dst};
  arm_total_[src].store(total, std::memory_order_relaxed);
  arm_order_[src].store(++order_, std::memory_order_release);
}

bool ShmRmaEngine::ready(int src) {
  Armed& a = armed_[src];
  if (!a.on) return false;
  // Acquire: pairs with the sender's release increment; what it counted is visible below.
  if (__atomic_load_n(&peers_[rank_].counters[src], __ATOMIC_ACQUIRE) < a.total) return false;
  memcpy(a.dst, peers_[rank_].windows[kRmaControl] + a.off, a.bytes);
  a.on = false;
  arm_order_[src].store(0, std::memory_order_release);
  return true;
}

int ShmRmaEngine::peer_pid(int peer) const { return peer >= 0 && peer < int(peers_.size()) ? peers_[peer].pid : 0; }

bool ShmRmaEngine::peer_alive(int peer) const { return process_alive(peer_pid(peer)); }

std::string ShmRmaEngine::describe_peer(int peer) const { return describe_rank_process(peer, peer_pid(peer)); }

}  // namespace portep
