#include "transport/nccl/nccl_transport.h"

#include <stdlib.h>
#include <string.h>

#include <algorithm>

#include "transport/endpoint_text.h"

namespace portep {

namespace w = nccl_wire;

NcclTransport::NcclTransport(std::string name, int rank, int num_ranks, int num_channels,
                             std::unique_ptr<RmaEngine> engine, std::shared_ptr<DeviceMemory> device,
                             bool trust_on_sight)
    : name_(std::move(name)),
      rank_(rank),
      num_ranks_(num_ranks),
      num_channels_(num_channels),
      engine_(std::move(engine)),
      device_(std::move(device)),
      trust_on_sight_(trust_on_sight) {
  if (num_ranks < 1 || rank < 0 || rank >= num_ranks)
    throw TransportError(name_ + ": rank " + std::to_string(rank) + " is outside 0.." + std::to_string(num_ranks - 1));
  if (num_channels < 1 || num_channels > w::kMaxChannels)
    throw TransportError(name_ + ": num_channels=" + std::to_string(num_channels) + " must be in 1.." +
                         std::to_string(w::kMaxChannels) + " (records carry the channel in 8 bits)");
  engine_->alloc_window(kRmaControl, w::control_window_bytes(num_ranks));
  for (int p = 0; p < num_ranks; ++p) {
    lanes_.push_back(std::make_unique<Lane>());
    sources_.push_back(std::make_unique<Source>());
    sources_.back()->mirror.assign(w::kInboxBytes, 0);
  }
  for (int c = 0; c < num_channels; ++c) channels_.push_back(std::make_unique<Channel>());
}

NcclTransport::~NcclTransport() {
  engine_.reset();  // its streams stop before the memory they may touch goes
  if (signal_device_) device_->unmap_host(signal_region_);
  free(signal_region_);
}

TransportProps NcclTransport::props() const { return TransportProps{name_, true, false, false}; }

void* NcclTransport::alloc_region(RegionId region, size_t bytes) {
  if (connected_) throw TransportError(name_ + ": regions must be allocated before connect()");
  if (region == kRegionData) {
    data_bytes_ = bytes;
    return engine_->alloc_window(kRmaData, bytes);
  }
  // Only this rank's proxies write the signal region (every signal travels as a record): host memory of this
  // process, which kernels poll through a mapping.
  if (signal_region_) throw TransportError(name_ + ": the signal region is allocated once");
  const size_t size = (bytes + 4095) / 4096 * 4096 + 4096;
  signal_region_ = aligned_alloc(4096, size);
  if (!signal_region_)
    throw TransportError(name_ + ": no memory for a signal region of " + std::to_string(size) + " bytes");
  memset(signal_region_, 0, size);
  if (device_) signal_device_ = device_->map_host(signal_region_, size);
  return signal_region_;
}

std::string NcclTransport::endpoint_blob() { return std::to_string(data_bytes_) + "\n" + engine_->endpoint_blob(); }

void NcclTransport::connect(const std::vector<std::string>& blobs) {
  if (int(blobs.size()) != num_ranks_)
    throw TransportError(name_ + ": connect got " + std::to_string(blobs.size()) + " endpoints for " +
                         std::to_string(num_ranks_) + " ranks");
  std::vector<std::string> engine_blobs;
  peer_data_bytes_.clear();
  for (int p = 0; p < num_ranks_; ++p) {
    const size_t cut = blobs[p].find('\n');
    if (cut == std::string::npos)
      throw TransportError(name_ + ": malformed endpoint description from rank " + std::to_string(p));
    peer_data_bytes_.push_back(std::stoull(blobs[p].substr(0, cut)));
    engine_blobs.push_back(blobs[p].substr(cut + 1));
  }
  engine_->connect(engine_blobs);
  connected_ = true;
}

void NcclTransport::check_peer(int peer, const char* what) const {
  if (!connected_) throw TransportError(name_ + ": " + what + " before connect()");
  if (peer < 0 || peer >= num_ranks_)
    throw TransportError(name_ + ": " + what + " to rank " + std::to_string(peer) + " of " +
                         std::to_string(num_ranks_));
}

void NcclTransport::check_range(int peer, uint64_t off, uint64_t bytes, bool remote, const char* what) const {
  const uint64_t size = remote ? peer_data_bytes_[peer] : data_bytes_;
  if (off > size || bytes > size - off)
    throw TransportError(name_ + ": " + what + " of " + std::to_string(bytes) + " bytes at offset " +
                         std::to_string(off) + " overruns " +
                         (remote ? "rank " + std::to_string(peer) + "'s" : std::string("this rank's")) +
                         " data region of " + std::to_string(size) + " bytes");
}

bool NcclTransport::post_write(int channel, int peer, uint64_t local_off, uint64_t remote_off, uint32_t bytes,
                               const uint32_t* imm, uint64_t wr_id) {
  check_peer(peer, "write");
  if (channel < 0 || channel >= num_channels_)
    throw TransportError(name_ + ": channel " + std::to_string(channel) + " of " + std::to_string(num_channels_));
  check_range(peer, local_off, bytes, false, "write source");
  check_range(peer, remote_off, bytes, true, "write");
  Lane& lane = *lanes_[peer];
  std::lock_guard<std::mutex> lock(lane.mu);
  if (imm && lane.records_sent - lane.acked >= w::kRecordSlots) return false;  // the peer's ring is full
  if (bytes) {
    engine_->put_signal(peer, kRmaData, local_off, remote_off, bytes);
    ++lane.puts;
  }
  if (imm) {
    const uint64_t seq = ++lane.records_sent;
    uint64_t words[2];
    w::words_of(w::encode(*imm, seq, ++lane.puts, channel), words);
    const uint64_t staging = w::outbox_offset(num_ranks_, peer) + w::kOutboxRecord;
    engine_->write_words(peer, kRmaControl, staging, words, 2);
    engine_->put_signal(peer, kRmaControl, staging, w::slot_offset(rank_, seq), w::kRecordBytes);
  }
  channels_[channel]->pending.push_back(Pending{peer, engine_->mark(peer), wr_id});
  return true;
}

bool NcclTransport::post_atomic_add(int, int peer, uint64_t, uint64_t, uint64_t) {
  throw TransportError(name_ + ": no remote atomics (add to rank " + std::to_string(peer) +
                       "): the one-sided API has none; the proxies signal with immediates on this transport");
}

int NcclTransport::poll_send(int channel, uint64_t* wr_ids, int max) {
  auto& pending = channels_[channel]->pending;
  int n = 0;
  while (n < max && !pending.empty()) {
    const Pending& p = pending.front();
    std::lock_guard<std::mutex> lock(lanes_[p.peer]->mu);
    if (!engine_->complete(p.peer, p.ticket)) break;  // a lane completes in order; later posts wait behind this one
    wr_ids[n++] = p.wr_id;
    pending.pop_front();
  }
  return n;
}

int NcclTransport::poll_recv(int channel, RecvNotice* out, int max) {
  if (!connected_) return 0;
  for (int p = 0; p < num_ranks_; ++p) {  // lanes whose puts no completion of this channel waits for move on too
    std::unique_lock<std::mutex> lock(lanes_[p]->mu, std::try_to_lock);
    if (lock.owns_lock()) engine_->drive(p);
  }
  for (int s = 0; s < num_ranks_; ++s) {
    std::unique_lock<std::mutex> lock(sources_[s]->mu, std::try_to_lock);
    if (lock.owns_lock()) receive(s);  // another channel's thread is at it
  }
  Channel& ch = *channels_[channel];
  std::lock_guard<std::mutex> lock(ch.mu);
  int n = 0;
  while (n < max && !ch.notices.empty()) {
    out[n++] = ch.notices.front();
    ch.notices.pop_front();
  }
  return n;
}

// Delivers the records of src that the last copy of its inbox shows and its counted signals cover, returns credit
// once a quarter of the ring was consumed, and arms the next copy: after the signals that the first record seen but
// not yet trusted needs (its put was made, so they come), else at once. Never a wait for a put not yet seen: NCCL
// would hold this rank's own puts behind it.
void NcclTransport::receive(int src) {
  Source& s = *sources_[src];
  uint64_t want = 0;
  if (s.armed) {
    if (!engine_->ready(src)) return;
    s.armed = false;
    s.counted = std::max(s.counted, s.armed_total);
    uint64_t credit;
    memcpy(&credit, s.mirror.data(), sizeof(credit));
    {
      Lane& lane = *lanes_[src];
      std::lock_guard<std::mutex> lock(lane.mu);
      if (credit > lane.acked && credit <= lane.records_sent) lane.acked = credit;
    }
    for (;;) {
      w::Record rec;
      memcpy(&rec, s.mirror.data() + (w::slot_offset(src, s.next_seq) - w::inbox_offset(src)), sizeof(rec));
      if (!w::holds(rec, s.next_seq)) break;
      if (!trust_on_sight_ && !w::counted(rec, s.counted)) {
        want = s.counted + uint32_t(rec.put_count - uint32_t(s.counted));
        break;
      }
      const int c = w::channel_of(rec);
      if (c >= num_channels_)
        throw TransportError(name_ + ": a record from " + engine_->describe_peer(src) + " names channel " +
                             std::to_string(c) + " of " + std::to_string(num_channels_));
      {
        std::lock_guard<std::mutex> lock(channels_[c]->mu);
        channels_[c]->notices.push_back(RecvNotice{uint32_t(src), rec.imm});
      }
      ++s.next_seq;
    }
    const uint64_t consumed = s.next_seq - 1;
    if (consumed - s.credited >= w::kRecordSlots / 4) {
      send_credit(src, consumed);
      s.credited = consumed;
    }
  }
  s.armed_total = trust_on_sight_ ? 0 : want ? want : s.counted;
  engine_->arm(src, s.armed_total, w::inbox_offset(src), w::kInboxBytes, s.mirror.data());
  s.armed = true;
}

void NcclTransport::send_credit(int src, uint64_t consumed) {
  Lane& lane = *lanes_[src];
  std::lock_guard<std::mutex> lock(lane.mu);
  const uint64_t staging = w::outbox_offset(num_ranks_, src) + w::kOutboxCredit;
  engine_->write_words(src, kRmaControl, staging, &consumed, 1);
  engine_->put_signal(src, kRmaControl, staging, w::inbox_offset(rank_), sizeof(consumed));
  ++lane.puts;
}

std::string NcclTransport::describe_peer(int peer) const { return engine_->describe_peer(peer); }

bool NcclTransport::peer_alive(int peer) const { return engine_->peer_alive(peer); }

void* NcclTransport::region_device_address(RegionId region) const {
  return region == kRegionData ? engine_->data_device_address() : signal_device_;
}

TransportBacklog NcclTransport::backlog(int channel) const {
  TransportBacklog b;
  if (channel >= 0 && channel < num_channels_) b.copying = channels_[channel]->pending.size();
  return b;
}

}  // namespace portep
