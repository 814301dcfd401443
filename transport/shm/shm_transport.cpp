#include "transport/shm/shm_transport.h"

#include "transport/endpoint_text.h"
#include "transport/shm/peer_process.h"

#include <string.h>
#include <unistd.h>

#include <stdio.h>

namespace portep {

namespace {
const char* kRegionTags[kNumRegions] = {"data", "signal"};

const char kIpcPrefix[] = "ipc:";

}  // namespace

ShmTransport::ShmTransport(const ShmOptions& o) : o_(o) {
  if (o.num_ranks < 1 || o.rank < 0 || o.rank >= o.num_ranks)
    throw TransportError("shm: rank " + std::to_string(o.rank) + " is outside 0.." + std::to_string(o.num_ranks - 1));
  if (o.num_channels < 1) throw TransportError("shm: num_channels must be >= 1");
  if (!o.ordered && o.window < 1) throw TransportError("shm: unordered window must be >= 1");
  inbox_ = ShmSegment::create("inbox", size_t(o.num_ranks) * o.num_channels * kRingBytes);
}

ShmTransport::~ShmTransport() {
  if (o_.device) {
    o_.device->synchronize();  // copies in flight finish before the memory they touch goes away
    for (int p = 0; p < int(peers_.size()); ++p)
      if (p != o_.rank && peers_[p].data) o_.device->close_peer_region(peers_[p].data);
    if (device_signal_) o_.device->unmap_host(regions_[kRegionSignal].data());
    o_.device->free_region(device_data_);
  }
}

TransportProps ShmTransport::props() const {
  return TransportProps{o_.ordered ? "shm" : "shm-unordered", o_.ordered, o_.ordered, true};
}

void* ShmTransport::alloc_region(RegionId region, size_t bytes) {
  if (connected_) throw TransportError("shm: regions must be allocated before connect()");
  if (bytes == 0) bytes = 64;  // a zero-size object cannot be mapped
  if (o_.device && region == kRegionData) {
    device_data_ = o_.device->alloc_region(bytes);
    device_data_bytes_ = bytes;
    return device_data_;
  }
  regions_[region] = ShmSegment::create(kRegionTags[region], bytes);
  if (o_.device && region == kRegionSignal) device_signal_ = o_.device->map_host(regions_[region].data(), bytes);
  return regions_[region].data();
}

std::string ShmTransport::endpoint_blob() {
  std::string out = std::to_string(getpid()) + "\n";
  if (o_.device) {  // the data region travels as an IPC handle
    const std::string handle = o_.device->export_region(device_data_);
    out += kIpcPrefix + hex_encode(handle.data(), handle.size()) + "\n" + std::to_string(device_data_bytes_) + "\n";
  } else {
    out += regions_[kRegionData].name() + "\n" + std::to_string(regions_[kRegionData].size()) + "\n";
  }
  out += regions_[kRegionSignal].name() + "\n" + std::to_string(regions_[kRegionSignal].size()) + "\n";
  out += inbox_.name() + "\n" + std::to_string(inbox_.size()) + "\n";
  return out;
}

void ShmTransport::connect(const std::vector<std::string>& blobs) {
  if (int(blobs.size()) != o_.num_ranks)
    throw TransportError("shm: connect got " + std::to_string(blobs.size()) + " endpoints for " +
                         std::to_string(o_.num_ranks) + " ranks");
  if (!(o_.device ? device_data_ : regions_[kRegionData].data()) || !regions_[kRegionSignal].data())
    throw TransportError("shm: allocate the data and signal regions before connect()");
  peers_.clear();
  peers_.resize(size_t(o_.num_ranks));
  std::vector<ShmSegment> peer_inboxes(o_.num_ranks);
  for (int p = 0; p < o_.num_ranks; ++p) {
    auto f = split_lines(blobs[p]);
    if (f.size() != 7) throw TransportError("shm: malformed endpoint description from rank " + std::to_string(p));
    Peer& peer = peers_[p];
    peer.pid = std::stoi(f[0]);
    const bool peer_on_device = f[1].rfind(kIpcPrefix, 0) == 0;
    if (peer_on_device != bool(o_.device))
      throw TransportError("shm: rank " + std::to_string(p) + " has its data in " + (peer_on_device ? "GPU" : "host") +
                           " memory and this rank in " + (o_.device ? "GPU" : "host") +
                           " memory; every rank of a "
                           "channel must use the same kind");
    if (p == o_.rank) {
      peer.data = static_cast<char*>(o_.device ? device_data_ : regions_[kRegionData].data());
      peer.signal = static_cast<char*>(regions_[kRegionSignal].data());
    } else {
      if (peer_on_device)
        peer.data =
            static_cast<char*>(o_.device->open_peer_region(hex_decode(f[1].substr(sizeof(kIpcPrefix) - 1), "shm")));
      else
        peer.maps.push_back(ShmSegment::open(f[1], std::stoull(f[2])));
      peer.maps.push_back(ShmSegment::open(f[3], std::stoull(f[4])));
      const size_t inbox_bytes = std::stoull(f[6]);
      if (inbox_bytes != inbox_.size())  // rings sit at (source rank, channel): both sides must count alike
        throw TransportError("shm: rank " + std::to_string(p) + " has a notification inbox of " +
                             std::to_string(inbox_bytes) + " bytes, this rank " + std::to_string(inbox_.size()) + " (" +
                             std::to_string(o_.num_channels) +
                             " channels): every rank of a channel must run the same number of proxy threads");
      peer_inboxes[p] = ShmSegment::open(f[5], inbox_bytes);
      if (!peer_on_device) peer.data = static_cast<char*>(peer.maps[0].data());
      peer.signal = static_cast<char*>(peer.maps.back().data());
    }
    peer.data_bytes = std::stoull(f[2]);
    peer.signal_bytes = std::stoull(f[4]);
  }
  channels_.clear();
  channels_.resize(size_t(o_.num_channels));
  for (int c = 0; c < o_.num_channels; ++c) {
    Channel& ch = channels_[c];
    for (int p = 0; p < o_.num_ranks; ++p) {
      // My ring inside peer p's inbox: index (source = me, channel c).
      char* base = static_cast<char*>(p == o_.rank ? inbox_.data() : peer_inboxes[p].data());
      Lane lane;
      lane.ring = NotifyRingProducer(NotifyRingView::at(base + (size_t(o_.rank) * o_.num_channels + c) * kRingBytes));
      lane.rng.seed(o_.seed * 1000003u + uint64_t(o_.rank) * 7919u + uint64_t(c) * 131u + uint64_t(p));
      ch.lanes.push_back(std::move(lane));
      char* mine = static_cast<char*>(inbox_.data()) + (size_t(p) * o_.num_channels + c) * kRingBytes;
      ch.inboxes.emplace_back(NotifyRingView::at(mine));
    }
  }
  for (int p = 0; p < o_.num_ranks; ++p)
    if (p != o_.rank) peers_[p].maps.push_back(std::move(peer_inboxes[p]));
  connected_ = true;
}

void ShmTransport::bootstrap_done() {
  if (o_.device) o_.device->release_names();
  for (auto& r : regions_) r.stop_sharing();
  inbox_.stop_sharing();
}

void ShmTransport::check_channel_peer(int channel, int peer) const {
  if (!connected_) throw TransportError("shm: post before connect()");
  if (channel < 0 || channel >= o_.num_channels || peer < 0 || peer >= o_.num_ranks)
    throw TransportError("shm: channel " + std::to_string(channel) + " / peer " + std::to_string(peer) +
                         " out of range (" + std::to_string(o_.num_channels) + " channels, " +
                         std::to_string(o_.num_ranks) + " ranks)");
}

void ShmTransport::check_range(int peer, bool signal_region, uint64_t off, uint64_t bytes, const char* what) const {
  const size_t limit =
      peer == -1 ? local_data_bytes() : (signal_region ? peers_[peer].signal_bytes : peers_[peer].data_bytes);
  if (off > limit || bytes > limit - off)
    throw TransportError(std::string("shm: ") + what + " [" + std::to_string(off) + ", +" + std::to_string(bytes) +
                         ") is outside the registered region of " + std::to_string(limit) + " bytes" +
                         (peer >= 0 ? " on rank " + std::to_string(peer) : std::string(" of this rank")));
}

bool ShmTransport::post_write(int channel, int peer, uint64_t local_off, uint64_t remote_off, uint32_t bytes,
                              const uint32_t* imm, uint64_t wr_id) {
  check_channel_peer(channel, peer);
  check_range(-1, false, local_off, bytes, "local write source");
  check_range(peer, false, remote_off, bytes, "remote write target");
  Op op{false, imm != nullptr, imm ? *imm : 0u, bytes, local_off, remote_off, 0, wr_id};
  if (o_.ordered) return deliver(channel, peer, op);
  Lane& lane = channels_[channel].lanes[peer];
  if (lane.pending.size() >= o_.window) return false;
  lane.pending.push_back(op);
  return true;
}

bool ShmTransport::post_atomic_add(int channel, int peer, uint64_t remote_off, uint64_t value, uint64_t wr_id) {
  check_channel_peer(channel, peer);
  if (!o_.ordered) throw TransportError("shm-unordered has no remote atomics; the proxy must emulate them");
  if (remote_off % 8)
    throw TransportError("shm: atomic target offset " + std::to_string(remote_off) + " is not 8-byte aligned");
  check_range(peer, true, remote_off, 8, "atomic target");
  return deliver(channel, peer, Op{true, false, 0, 8, 0, remote_off, value, wr_id});
}

size_t ShmTransport::local_data_bytes() const { return o_.device ? device_data_bytes_ : regions_[kRegionData].size(); }

bool ShmTransport::deliver(int channel, int peer, const Op& op) {
  // GPU memory: a copy goes to the copy engine, and so does whatever follows a copy still in flight (in issue
  // order). An atomic or a notification with nothing before it is delivered at once, without a CUDA call.
  if (o_.device && ((!op.atomic && op.bytes) || !channels_[channel].device_ops.empty())) {
    issue_device_op(channel, peer, op);
    return true;
  }
  if (!op.atomic && op.bytes)
    memcpy(peers_[peer].data + op.remote_off, static_cast<char*>(regions_[kRegionData].data()) + op.local_off,
           op.bytes);
  // If the receiver's ring is full the op stays posted and is delivered again later (placing the same bytes
  // twice is harmless).
  return notify(channel, peer, op);
}

bool ShmTransport::notify(int channel, int peer, const Op& op) {
  Channel& ch = channels_[channel];
  if (op.atomic) {
    // Release: every write delivered to the peer before (host stores, or copies this thread saw complete) is
    // visible before the new value.
    __atomic_fetch_add(reinterpret_cast<uint64_t*>(peers_[peer].signal + op.remote_off), op.value, __ATOMIC_RELEASE);
  } else if (op.has_imm && !ch.lanes[peer].ring.push(op.imm)) {  // the ring's release store follows the bytes
    return false;
  }
  ch.done.push_back(op.wr_id);
  return true;
}

void ShmTransport::issue_device_op(int channel, int peer, const Op& op) {
  Channel& ch = channels_[channel];
  if (!op.atomic && op.bytes)
    o_.device->copy_async(channel, peers_[peer].data + op.remote_off, static_cast<char*>(device_data_) + op.local_off,
                          op.bytes);
  ch.device_ops.push_back(DeviceOp{op, peer, kUnrecorded});
}

void ShmTransport::retire_device_ops(int channel) {
  Channel& ch = channels_[channel];
  if (!ch.device_ops.empty() && ch.device_ops.back().ticket == kUnrecorded) {
    const uint64_t ticket = o_.device->record(channel);  // one event covers every op issued since the last one
    for (auto it = ch.device_ops.rbegin(); it != ch.device_ops.rend() && it->ticket == kUnrecorded; ++it)
      it->ticket = ticket;
  }
  // In issue order: an atomic or a notification never overtakes an earlier copy of this channel.
  ch.ring_full = false;
  while (!ch.device_ops.empty()) {
    DeviceOp& d = ch.device_ops.front();
    if (!o_.device->done(channel, d.ticket)) return;
    if (!notify(channel, d.peer, d.op)) {
      ch.ring_full = true;
      return;
    }
    ch.device_ops.pop_front();
  }
}

TransportBacklog ShmTransport::backlog(int channel) const {
  TransportBacklog b;
  if (channel < 0 || channel >= int(channels_.size())) return b;
  const Channel& ch = channels_[size_t(channel)];
  for (const Lane& lane : ch.lanes) b.queued += lane.pending.size();
  b.copying = ch.device_ops.size() - (ch.ring_full ? 1 : 0);
  b.notify_full = ch.ring_full ? 1 : 0;
  return b;
}

void ShmTransport::deliver_some(int channel, int peer) {
  Lane& lane = channels_[channel].lanes[peer];
  // A small share per poll keeps ops waiting long enough to be overtaken by many later ones.
  size_t n = (lane.pending.size() + 7) / 8;
  for (size_t i = 0; i < n && !lane.pending.empty(); ++i) {
    size_t k = lane.rng() % lane.pending.size();
    if (!deliver(channel, peer, lane.pending[k])) return;  // receiver's ring full: try again later
    lane.pending[k] = lane.pending.back();
    lane.pending.pop_back();
  }
}

int ShmTransport::poll_send(int channel, uint64_t* wr_ids, int max) {
  check_channel_peer(channel, 0);
  Channel& ch = channels_[channel];
  if (!o_.ordered)
    for (int p = 0; p < o_.num_ranks; ++p)
      if (!ch.lanes[p].pending.empty()) deliver_some(channel, p);
  if (o_.device) retire_device_ops(channel);
  int n = 0;
  while (n < max && !ch.done.empty()) {
    wr_ids[n++] = ch.done.back();
    ch.done.pop_back();
  }
  return n;
}

int ShmTransport::poll_recv(int channel, RecvNotice* out, int max) {
  check_channel_peer(channel, 0);
  Channel& ch = channels_[channel];
  uint32_t buf[256];
  int n = 0;
  for (int i = 0; i < o_.num_ranks && n < max; ++i) {
    uint32_t src = (ch.next_source + i) % o_.num_ranks;
    int got = ch.inboxes[src].pop(buf, std::min(max - n, 256));
    for (int k = 0; k < got; ++k) out[n++] = RecvNotice{src, buf[k]};
  }
  ch.next_source = (ch.next_source + 1) % o_.num_ranks;
  return n;
}

int ShmTransport::peer_pid(int peer) const { return peer >= 0 && peer < int(peers_.size()) ? peers_[peer].pid : 0; }

bool ShmTransport::peer_alive(int peer) const { return process_alive(peer_pid(peer)); }

std::string ShmTransport::describe_peer(int peer) const { return describe_rank_process(peer, peer_pid(peer)); }

void* ShmTransport::peer_region(int peer, RegionId region) const {
  if (!connected_ || peer < 0 || peer >= o_.num_ranks) return nullptr;
  return region == kRegionData ? peers_[peer].data : peers_[peer].signal;
}

void* ShmTransport::region_device_address(RegionId region) const {
  return region == kRegionData ? device_data_ : device_signal_;
}

size_t ShmTransport::peer_region_bytes(int peer, RegionId region) const {
  if (!connected_ || peer < 0 || peer >= o_.num_ranks) return 0;
  return region == kRegionData ? peers_[peer].data_bytes : peers_[peer].signal_bytes;
}

}  // namespace portep
