#include "transport/verbs/verbs_transport.h"

#include <arpa/inet.h>
#include <errno.h>
#include <infiniband/verbs.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <unordered_map>

#include "transport/verbs/efa_transport.h"
#include "transport/verbs/gpu_data_region.h"
#include "transport/verbs/verbs_choices.h"
#include "transport/verbs/verbs_common.h"
#include "transport/shm/shm_segment.h"

namespace portep {

using namespace verbs;

namespace {

// This host and this boot: ranks that print the same can map each other's shared memory.
constexpr char kNoSegment[] = "-";  // a region in private pages: not mappable by peers

std::string host_identity() {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  char boot[64] = {};  // stdio, not iostreams (iostreams in this library crashed next to torch's C++ runtime)
  if (FILE* f = fopen("/proc/sys/kernel/random/boot_id", "r")) {
    if (!fgets(boot, sizeof(boot), f)) boot[0] = 0;
    fclose(f);
  }
  boot[strcspn(boot, "\r\n")] = 0;  // the id must stay one line of the endpoint blob
  char ipc_ns[128] = {};            // containers on one host with separate IPC namespaces cannot share memory
  const ssize_t n = readlink("/proc/self/ns/ipc", ipc_ns, sizeof(ipc_ns) - 1);
  if (n > 0) ipc_ns[n] = 0;
  std::string id = std::string(host) + "/" + boot + "/" + ipc_ns;
  for (char& ch : id)
    if (ch == '\n' || ch == '\r') ch = '_';
  return id;
}

// NCCL_IB_HCA syntax: optional '^' (exclude the list), optional '=' (exact names, else prefixes), then
// comma-separated "device[:port]".
struct HcaFilter {
  bool exclude = false, exact = false;
  std::vector<std::pair<std::string, int>> items;  // port 0 = any
};

HcaFilter parse_hca(std::string s) {
  HcaFilter f;
  if (!s.empty() && s[0] == '^') f.exclude = true, s.erase(0, 1);
  if (!s.empty() && s[0] == '=') f.exact = true, s.erase(0, 1);
  size_t start = 0;
  while (start < s.size()) {
    size_t end = s.find(',', start);
    if (end == std::string::npos) end = s.size();
    std::string item = s.substr(start, end - start);
    const size_t colon = item.find(':');
    const int port = colon == std::string::npos ? 0 : atoi(item.c_str() + colon + 1);
    if (!item.empty()) f.items.emplace_back(item.substr(0, colon), port);
    start = end + 1;
  }
  return f;
}

bool hca_allows(const HcaFilter& f, const std::string& dev, int port) {
  if (f.items.empty()) return true;
  bool listed = false;
  for (auto& [name, p] : f.items) {
    const bool name_ok = f.exact ? dev == name : dev.compare(0, name.size(), name) == 0;
    if (name_ok && (p == 0 || p == port)) listed = true;
  }
  return listed != f.exclude;
}

int env_int(const char* name, int fallback) {
  const char* v = getenv(name);
  return v && *v ? atoi(v) : fallback;
}

struct Qp {
  ibv_qp* qp = nullptr;
  uint32_t outstanding = 0;     // signaled sends not yet completed
  uint64_t bytes = 0;           // their bytes
  std::vector<uint32_t> sizes;  // ring of the outstanding sends' bytes, oldest at `first` (RC completes in order)
  uint32_t first = 0;
};

struct VerbsChannel {
  ibv_cq* send_cq = nullptr;
  ibv_cq* recv_cq = nullptr;
  std::vector<std::vector<Qp>> qps;  // [peer][stripe]
  std::vector<uint32_t> next_stripe;
};

class VerbsTransport final : public Transport {
 public:
  VerbsTransport(const VerbsOptions& o, ibv_context* ctx, int port, const std::string& dev_name)
      : o_(o), ctx_(ctx), port_(port), dev_name_(dev_name) {
    if (verbs::ibv().query_port(ctx_, uint8_t(port_), &port_attr_)) fail("ibv_query_port", errno);
    if (verbs::ibv().query_device(ctx_, &dev_attr_)) fail("ibv_query_device", errno);
    const GidChoice gid = choose_gid(ctx_, dev_name_, port_, port_attr_, o_.gid_index, o_.gid_index_explicit);
    o_.gid_index = gid.index;
    gid_ = gid.gid;
    gid_how_ = gid.how;
    const bool broadcom = is_broadcom(dev_attr_, dev_name_);
    if (!o_.max_inflight_bytes) o_.max_inflight_bytes = broadcom ? kBroadcomInflightBytes : kUnlimitedBytes;
    if (!o_.max_inflight_msgs) o_.max_inflight_msgs = broadcom ? kBroadcomInflightMsgs : o_.max_send_wr;
    if (o_.max_inflight_msgs > o_.max_send_wr) o_.max_inflight_msgs = o_.max_send_wr;
    atomics_ = dev_attr_.atomic_cap != IBV_ATOMIC_NONE;
    pd_ = verbs::ibv().alloc_pd(ctx_);
    if (!pd_) fail("ibv_alloc_pd", errno);
    scratch_.bytes = 4096;
    scratch_.addr = alloc_pages(scratch_.bytes);
    register_region(pd_, &scratch_, IBV_ACCESS_LOCAL_WRITE);
    build_channels();
  }

  ~VerbsTransport() override {
    for (auto& ch : channels_) {
      for (auto& peer : ch.qps)
        for (auto& q : peer)
          if (q.qp) verbs::ibv().destroy_qp(q.qp);
      if (ch.send_cq) verbs::ibv().destroy_cq(ch.send_cq);
      if (ch.recv_cq) verbs::ibv().destroy_cq(ch.recv_cq);
    }
    if (device_signal_) o_.device->unmap_host(regions_[kRegionSignal].addr);
    for (int i = 0; i < kNumRegions; ++i) {
      if (on_device(RegionId(i))) {
        gpu_data_.release(&regions_[i]);
        continue;
      }
      if (regions_[i].mr) verbs::ibv().dereg_mr(regions_[i].mr);
      if (!segments_[i].data() && regions_[i].addr) munmap(regions_[i].addr, regions_[i].bytes);  // private pages
    }
    release_region(&scratch_);
    if (pd_) verbs::ibv().dealloc_pd(pd_);
    verbs::ibv().close_device(ctx_);
  }

  TransportProps props() const override {
    const bool ordered = o_.qps_per_peer == 1;
    // With GPU data no native atomics: a NIC's atomic on the host signal could be seen by a kernel before the
    // NIC's writes into GPU memory; through immediates the receiving proxy flushes them first.
    return TransportProps{ordered ? "verbs" : "verbs-striped", ordered, ordered && atomics_ && !o_.device};
  }

  void* alloc_region(RegionId region, size_t bytes) override {
    if (connected_) throw TransportError("verbs: regions must be allocated before connect()");
    Region& r = regions_[region];
    r.bytes = bytes ? bytes : 64;
    if (on_device(region)) {
      gpu_data_.allocate(pd_, &r, o_.device.get(),
                         IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ, o_.gpudirect);
      return r.addr;
    }
    // Shared memory, so that ranks on this host can also map it (node views for normal mode). A memfd, so a
    // container's small /dev/shm (often 64 MiB) does not bound it.
    segments_[region] = ShmSegment::create(region == kRegionData ? "verbs-data" : "verbs-signal", r.bytes);
    r.addr = segments_[region].data();
    register_region(
        pd_, &r, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC);
    if (o_.device && region == kRegionSignal) device_signal_ = o_.device->map_host(r.addr, r.bytes);
    return r.addr;
  }

  void* region_device_address(RegionId region) const override {
    return o_.device ? gpu_data_.kernel_address(region, regions_[kRegionData], device_signal_) : nullptr;
  }
  void make_writes_visible(int) override { gpu_data_.flush_nic_writes(); }

  // Lines: lid, gid, then per region "addr rkey bytes", then the QP numbers of (channel, peer, stripe).
  std::string endpoint_blob() override {
    std::string out = std::to_string(port_attr_.lid) + "\n" + hex_encode(&gid_, sizeof(gid_)) + "\n";
    for (auto& r : regions_) out += region_line(r);
    out += host_identity() + "\n" + segment_name(kRegionData) + " " + segment_name(kRegionSignal) + "\n";
    for (auto& ch : channels_)
      for (auto& peer : ch.qps)
        for (auto& q : peer) out += std::to_string(q.qp->qp_num) + "\n";
    return out;
  }

  void connect(const std::vector<std::string>& blobs) override {
    check_connect_inputs(blobs.size(), o_.num_ranks, regions_, "verbs");
    remotes_.assign(size_t(o_.num_ranks), RemoteRegions{});
    peer_maps_.clear();
    peer_maps_.resize(size_t(o_.num_ranks));
    for (int p = 0; p < o_.num_ranks; ++p) {
      const std::vector<std::string> f = split_lines(blobs[p]);
      const size_t qps = size_t(o_.num_channels) * o_.num_ranks * o_.qps_per_peer;
      if (f.size() != 6 + qps)
        throw TransportError("verbs: malformed endpoint description from rank " + std::to_string(p));
      const uint16_t lid = uint16_t(std::stoul(f[0]));
      ibv_gid gid;
      unhex(f[1], &gid, sizeof(gid));
      for (int r = 0; r < kNumRegions; ++r) parse_region_line(f[2 + r], &remotes_[p], r, p);
      for (int c = 0; c < o_.num_channels; ++c)
        for (int s = 0; s < o_.qps_per_peer; ++s) {
          // Peer p's QP for (channel c, peer = me, stripe s) is the other end of mine for (c, p, s).
          const size_t index = (size_t(c) * o_.num_ranks + o_.rank) * o_.qps_per_peer + s;
          connect_qp(channels_[c].qps[p][s].qp, uint32_t(std::stoul(f[6 + index])), lid, gid);
        }
      if (p != o_.rank && f[4] == host_identity()) map_peer(p, f[5]);
    }
    connected_ = true;
  }

  bool post_write(int channel, int peer, uint64_t local_off, uint64_t remote_off, uint32_t bytes, const uint32_t* imm,
                  uint64_t wr_id) override {
    check_range(peer, kRegionData, local_off, remote_off, bytes);
    Qp& q = pick(channel, peer);
    if (!room(q, bytes)) return false;
    ibv_sge sge{reinterpret_cast<uintptr_t>(regions_[kRegionData].addr) + local_off, bytes,
                regions_[kRegionData].mr->lkey};
    ibv_send_wr wr{};
    wr.wr_id = wr_id;
    wr.sg_list = bytes ? &sge : nullptr;
    wr.num_sge = bytes ? 1 : 0;
    wr.opcode = imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
    if (imm) wr.imm_data = htonl(*imm);
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.rdma.remote_addr = remotes_[peer].addr[kRegionData] + remote_off;
    wr.wr.rdma.rkey = remotes_[peer].rkey[kRegionData];
    return post(q, &wr, bytes, "RDMA write", peer);
  }

  bool post_atomic_add(int channel, int peer, uint64_t remote_off, uint64_t value, uint64_t wr_id) override {
    if (!props().remote_atomics)
      throw TransportError("verbs: " + props().name + " on " + dev_name_ +
                           " has no remote atomics here; the proxy "
                           "must emulate them");
    if (remote_off % 8)
      throw TransportError("verbs: atomic target offset " + std::to_string(remote_off) + " is not 8-byte aligned");
    check_range(peer, kRegionSignal, 0, remote_off, 8);
    Qp& q = pick(channel, peer);
    if (!room(q, 8)) return false;
    ibv_sge sge{reinterpret_cast<uintptr_t>(scratch_.addr) + 8 * uint64_t(channel % 512), 8, scratch_.mr->lkey};
    ibv_send_wr wr{};
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.atomic.remote_addr = remotes_[peer].addr[kRegionSignal] + remote_off;
    wr.wr.atomic.rkey = remotes_[peer].rkey[kRegionSignal];
    wr.wr.atomic.compare_add = value;
    return post(q, &wr, 8, "atomic add", peer);
  }

  int poll_send(int channel, uint64_t* wr_ids, int max) override {
    ibv_wc wc[kPollBatch];
    const int n = poll_cq(at(channel).send_cq, max, wc, "ibv_poll_cq (send)");
    for (int i = 0; i < n; ++i) {
      auto [peer, qp] = owner(wc[i].qp_num);
      if (wc[i].status == IBV_WC_RETRY_EXC_ERR) retry_exceeded(wc[i], peer);
      check_send_completion(wc[i], "verbs", "a write or atomic to rank", peer);
      qp->bytes -= qp->sizes[qp->first];
      qp->first = (qp->first + 1) % uint32_t(qp->sizes.size());
      --qp->outstanding;
      wr_ids[i] = wc[i].wr_id;
    }
    return n;
  }

  int poll_recv(int channel, RecvNotice* out, int max) override {
    ibv_wc wc[kPollBatch];
    const int n = poll_cq(at(channel).recv_cq, max, wc, "ibv_poll_cq (recv)");
    for (int i = 0; i < n; ++i) {
      auto [peer, qp] = owner(wc[i].qp_num);
      check_imm_receive(wc[i], "verbs", "from rank", peer);
      out[i] = RecvNotice{uint32_t(peer), ntohl(wc[i].imm_data)};
      post_recvs(qp->qp, 1);
    }
    return n;
  }

  // Every peer has mapped this rank's segments: they need not be open to peers any longer.
  void bootstrap_done() override {
    for (auto& seg : segments_) seg.stop_sharing();
  }

  void* peer_region(int peer, RegionId region) const override { return mapped(peer, region).first; }
  size_t peer_region_bytes(int peer, RegionId region) const override { return mapped(peer, region).second; }

  std::string describe_peer(int peer) const override {
    return "rank " + std::to_string(peer) + " (verbs RC over " + dev_name_ + ":" + std::to_string(port_) + ", " +
           gid_how_ + ", " + caps() + ", " + std::to_string(deferred_.load(std::memory_order_relaxed)) +
           " posts deferred by them" + (o_.device ? ", GPU data region: " + gpu_data_.how() : std::string()) + ")";
  }

 private:
  bool on_device(RegionId region) const { return o_.device && region == kRegionData; }

  // Where peer's region is mapped in this process and its size ({nullptr, 0}: not mapped here).
  std::pair<void*, size_t> mapped(int peer, RegionId region) const {
    if (!connected_ || peer < 0 || peer >= o_.num_ranks) return {nullptr, 0};
    if (peer == o_.rank) return {regions_[region].addr, regions_[region].bytes};
    const ShmSegment& seg = peer_maps_[size_t(peer)][region];
    return {seg.data(), seg.size()};
  }

  std::string segment_name(RegionId region) const {
    return segments_[region].data() ? segments_[region].name() : std::string(kNoSegment);
  }

  // Maps a same-host peer's data and signal segments ("data_name signal_name" from its blob). A peer whose
  // memory cannot be mapped here stays reachable through RDMA only (normal mode then says what is missing).
  void map_peer(int p, const std::string& names) {
    const size_t space = names.find(' ');
    if (space == std::string::npos)
      throw TransportError("verbs: malformed segment names from rank " + std::to_string(p));
    const std::string data = names.substr(0, space), signal = names.substr(space + 1);
    if (data == kNoSegment || signal == kNoSegment) return;
    try {
      peer_maps_[size_t(p)][kRegionData] = ShmSegment::open(data, remotes_[p].bytes[kRegionData]);
      peer_maps_[size_t(p)][kRegionSignal] = ShmSegment::open(signal, remotes_[p].bytes[kRegionSignal]);
    } catch (const TransportError&) {
      peer_maps_[size_t(p)] = {};
    }
  }

  void build_channels() {
    const int cqe_limit = dev_attr_.max_cqe;
    auto clamp = [cqe_limit](long v) { return int(v < cqe_limit ? v : cqe_limit); };
    channels_.resize(size_t(o_.num_channels));
    for (int c = 0; c < o_.num_channels; ++c) {
      VerbsChannel& ch = channels_[c];
      const long per = long(o_.num_ranks) * o_.qps_per_peer;
      ch.send_cq = verbs::ibv().create_cq(ctx_, clamp(per * o_.max_send_wr), nullptr, nullptr, 0);
      ch.recv_cq = verbs::ibv().create_cq(ctx_, clamp(per * o_.recv_depth), nullptr, nullptr, 0);
      if (!ch.send_cq || !ch.recv_cq) fail("ibv_create_cq", errno);
      ch.qps.assign(size_t(o_.num_ranks), std::vector<Qp>(size_t(o_.qps_per_peer)));
      ch.next_stripe.assign(size_t(o_.num_ranks), 0);
      for (int p = 0; p < o_.num_ranks; ++p)
        for (int s = 0; s < o_.qps_per_peer; ++s) {
          ibv_qp_init_attr a{};
          a.send_cq = ch.send_cq;
          a.recv_cq = ch.recv_cq;
          a.qp_type = IBV_QPT_RC;
          a.cap.max_send_wr = o_.max_send_wr;
          a.cap.max_recv_wr = o_.recv_depth;
          a.cap.max_send_sge = 1;
          a.cap.max_recv_sge = 1;
          ibv_qp* qp = verbs::ibv().create_qp(pd_, &a);
          if (!qp) fail("ibv_create_qp", errno);
          ch.qps[p][s].qp = qp;
          ch.qps[p][s].sizes.assign(o_.max_send_wr, 0);
          owners_[qp->qp_num] = {p, &ch.qps[p][s]};
        }
    }
  }

  void connect_qp(ibv_qp* qp, uint32_t remote_qpn, uint16_t remote_lid, const ibv_gid& remote_gid) {
    const int rd_atomic = dev_attr_.max_qp_rd_atom < 16 ? dev_attr_.max_qp_rd_atom : 16;
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = uint8_t(port_);
    a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
    if (int e = verbs::ibv().modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
      fail("ibv_modify_qp to INIT", e);
    post_recvs(qp, o_.recv_depth);
    a = ibv_qp_attr{};
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = port_attr_.active_mtu;
    a.dest_qp_num = remote_qpn;
    a.rq_psn = 0;
    a.max_dest_rd_atomic = uint8_t(rd_atomic);
    a.min_rnr_timer = 12;
    a.ah_attr.dlid = remote_lid;
    a.ah_attr.sl = uint8_t(o_.service_level);
    a.ah_attr.port_num = uint8_t(port_);
    if (port_attr_.link_layer == IBV_LINK_LAYER_ETHERNET || remote_lid == 0) {  // RoCE: routed by GID
      a.ah_attr.is_global = 1;
      a.ah_attr.grh.dgid = remote_gid;
      a.ah_attr.grh.sgid_index = uint8_t(o_.gid_index);
      a.ah_attr.grh.hop_limit = 64;
      a.ah_attr.grh.traffic_class = uint8_t(o_.traffic_class);
    }
    if (int e = verbs::ibv().modify_qp(qp, &a,
                                       IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                           IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
      fail("ibv_modify_qp to RTR", e);
    a = ibv_qp_attr{};
    a.qp_state = IBV_QPS_RTS;
    a.timeout = uint8_t(o_.ack_timeout);
    a.retry_cnt = uint8_t(o_.retry_cnt);
    a.rnr_retry = 7;  // receiver not ready: retry forever (the proxies' timeouts bound the wait)
    a.sq_psn = 0;
    a.max_rd_atomic = uint8_t(rd_atomic);
    if (int e = verbs::ibv().modify_qp(qp, &a,
                                       IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                           IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
      fail("ibv_modify_qp to RTS", e);
  }

  // Whether a send of `bytes` may go on q now. The caps hold it back until completions make room, except on an
  // idle QP: a message larger than the byte cap then goes alone.
  bool room(const Qp& q, uint64_t bytes) {
    if (q.outstanding >= o_.max_send_wr) return false;
    if (q.outstanding == 0) return true;
    if (q.outstanding < o_.max_inflight_msgs && q.bytes <= o_.max_inflight_bytes &&
        bytes <= o_.max_inflight_bytes - q.bytes)
      return true;
    deferred_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }

  bool post(Qp& q, ibv_send_wr* wr, uint32_t bytes, const char* what, int peer) {
    ibv_send_wr* bad = nullptr;
    const int e = ibv_post_send(q.qp, wr, &bad);
    if (e == ENOMEM) return false;  // the send queue is full right now
    if (e) fail(std::string("ibv_post_send (") + what + " to rank " + std::to_string(peer) + ")", e);
    q.sizes[(q.first + q.outstanding) % uint32_t(q.sizes.size())] = bytes;
    q.bytes += bytes;
    ++q.outstanding;
    return true;
  }

  std::string caps() const {
    const std::string bytes =
        o_.max_inflight_bytes == kUnlimitedBytes ? "unlimited" : std::to_string(o_.max_inflight_bytes);
    return "per-QP in-flight caps: PORTEP_IB_MAX_INFLIGHT_BYTES=" + bytes +
           ", PORTEP_IB_MAX_INFLIGHT_MSGS=" + std::to_string(o_.max_inflight_msgs);
  }

  [[noreturn]] void retry_exceeded(const ibv_wc& wc, int peer) const {
    throw TransportError("verbs: a write or atomic to rank " + std::to_string(peer) +
                         " failed: transport retry counter exceeded (IBV_WC_RETRY_EXC_ERR, vendor error " +
                         std::to_string(wc.vendor_err) + ", PORTEP_IB_RETRY_CNT=" + std::to_string(o_.retry_cnt) +
                         ", PORTEP_IB_TIMEOUT=" + std::to_string(o_.ack_timeout) +
                         ": the peer stopped acknowledging, "
                         "it is gone or the fabric dropped too much, as under incast); lower the " +
                         caps() + " on " + dev_name_);
  }

  Qp& pick(int channel, int peer) {
    if (!connected_) throw TransportError("verbs: post before connect()");
    VerbsChannel& ch = at(channel);
    if (peer < 0 || peer >= o_.num_ranks) throw TransportError("verbs: peer " + std::to_string(peer) + " out of range");
    // Striping: consecutive posts of a (channel, peer) go round-robin over its QPs.
    const uint32_t s = ch.next_stripe[peer]++ % uint32_t(o_.qps_per_peer);
    return ch.qps[peer][s];
  }

  VerbsChannel& at(int channel) {
    if (channel < 0 || channel >= o_.num_channels)
      throw TransportError("verbs: channel " + std::to_string(channel) + " out of range");
    return channels_[size_t(channel)];
  }

  std::pair<int, Qp*> owner(uint32_t qp_num) const {
    auto it = owners_.find(qp_num);
    if (it == owners_.end()) throw TransportError("verbs: completion for unknown QP " + std::to_string(qp_num));
    return it->second;
  }

  void check_range(int peer, RegionId region, uint64_t local_off, uint64_t remote_off, uint64_t bytes) const {
    verbs::check_range(regions_[region], remotes_.at(size_t(peer)), region, peer, local_off, remote_off, bytes);
  }

  VerbsOptions o_;
  ibv_context* ctx_;
  int port_;
  std::string dev_name_;
  ibv_port_attr port_attr_{};
  ibv_device_attr dev_attr_{};
  ibv_gid gid_{};
  std::string gid_how_;
  std::atomic<uint64_t> deferred_{0};  // posts the in-flight caps held back (retries count again)
  bool atomics_ = false;
  ibv_pd* pd_ = nullptr;
  Region regions_[kNumRegions];
  ShmSegment segments_[kNumRegions];                            // this rank's regions
  std::vector<std::array<ShmSegment, kNumRegions>> peer_maps_;  // same-host peers' regions, mapped here
  Region scratch_;                                              // where fetch-and-add results land (never read)
  void* device_signal_ = nullptr;  // the signal region as kernels address it (GPU data only)
  GpuDataRegion gpu_data_;         // how the data region is placed and registered (GPU data only)
  std::vector<VerbsChannel> channels_;
  std::vector<RemoteRegions> remotes_;
  std::unordered_map<uint32_t, std::pair<int, Qp*>> owners_;  // qp_num -> (peer, QP)
  bool connected_ = false;
};

// The first (device, port) the filter allows whose port is ACTIVE.
ibv_context* open_device(const std::string& hca, int* port, std::string* name, std::string* why) {
  int n = 0;
  ibv_device** list = verbs::ibv().get_device_list(&n);
  if (!list) {  // no RDMA in this kernel: NULL with ENOSYS, not an empty list
    *why = std::string("no RDMA devices (ibv_get_device_list: ") + strerror(errno) + ")";
    return nullptr;
  }
  const HcaFilter filter = parse_hca(hca);
  ibv_context* found = nullptr;
  std::string seen;
  for (int i = 0; i < n && !found; ++i) {
    const std::string dev = verbs::ibv().get_device_name(list[i]);
    ibv_context* ctx = verbs::ibv().open_device(list[i]);
    if (!ctx) continue;
    ibv_device_attr attr{};
    if (verbs::ibv().query_device(ctx, &attr) == 0)
      for (int p = 1; p <= attr.phys_port_cnt && !found; ++p) {
        ibv_port_attr pa{};
        if (verbs::ibv().query_port(ctx, uint8_t(p), &pa) || !hca_allows(filter, dev, p)) continue;
        seen +=
            (seen.empty() ? "" : ", ") + dev + ":" + std::to_string(p) + (pa.state == IBV_PORT_ACTIVE ? "" : " (down)");
        if (pa.state == IBV_PORT_ACTIVE) found = ctx, *port = p, *name = dev;
      }
    if (!found) verbs::ibv().close_device(ctx);
  }
  verbs::ibv().free_device_list(list);
  if (!found)
    *why = n == 0 ? "no RDMA devices" : "no active port matches PORTEP_IB_HCA='" + hca + "' (ports: " + seen + ")";
  return found;
}

}  // namespace

VerbsOptions verbs_options_from_env(const std::string& name, int rank, int num_ranks, int num_channels) {
  VerbsOptions o;
  o.rank = rank;
  o.num_ranks = num_ranks;
  o.num_channels = num_channels;
  const char* hca = getenv("PORTEP_IB_HCA");
  o.hca = hca ? hca : "";
  o.gid_index_explicit = getenv("PORTEP_IB_GID_INDEX") && *getenv("PORTEP_IB_GID_INDEX");
  o.gid_index = int(env_strict("PORTEP_IB_GID_INDEX", 0, 255, 0));
  o.service_level = env_int("PORTEP_IB_SL", 0);
  o.traffic_class = env_int("PORTEP_IB_TC", 0);
  o.qps_per_peer = env_int("PORTEP_IB_QPS_PER_PEER", name == "verbs-striped" ? 4 : 1);
  o.max_send_wr = uint32_t(env_int("PORTEP_IB_MAX_SEND_WR", 256));
  o.max_inflight_bytes = env_strict("PORTEP_IB_MAX_INFLIGHT_BYTES", 1, kMaxInflightBytesKnob, 0);
  o.max_inflight_msgs = uint32_t(env_strict("PORTEP_IB_MAX_INFLIGHT_MSGS", 1, kMaxInflightMsgsKnob, 0));
  o.retry_cnt = int(env_strict("PORTEP_IB_RETRY_CNT", 0, 7, 7));
  o.ack_timeout = int(env_strict("PORTEP_IB_TIMEOUT", 1, 31, 14));
  o.gpudirect = env_int("PORTEP_IB_GPUDIRECT", 1) != 0;
  if (name == "verbs" && o.qps_per_peer != 1)
    throw TransportError("transport 'verbs' keeps RC order with one QP per peer; PORTEP_IB_QPS_PER_PEER=" +
                         std::to_string(o.qps_per_peer) + " needs transport 'verbs-striped'");
  if (o.qps_per_peer < 1 || o.qps_per_peer > 64)
    throw TransportError("PORTEP_IB_QPS_PER_PEER=" + std::to_string(o.qps_per_peer) + " must be in 1..64");
  return o;
}

std::unique_ptr<Transport> make_verbs_transport(const VerbsOptions& o, std::string* why) {
  if (!verbs::ibv_loadable(why)) return nullptr;
  int port = 0;
  std::string name;
  ibv_context* ctx = open_device(o.hca, &port, &name, why);
  if (!ctx) return nullptr;
  if (is_efa_device(ctx)) return make_efa_transport(o, ctx, port, name);  // SRD: the EFA transport
  return std::make_unique<VerbsTransport>(o, ctx, port, name);
}

bool verbs_built(std::string* why) {
  if (why) why->clear();
  return true;
}

bool verbs_loadable(std::string* why) { return verbs::ibv_loadable(why); }

std::vector<std::string> nic_library_summary() {
  std::string why;
  const std::string name = verbs::ibverbs_library_name();
  std::vector<std::string> out;
  out.push_back(verbs::ibv_loadable(&why) ? name + ": " + verbs::library_path(verbs::load_library_once(name, nullptr))
                                          : name + ": not loadable: " + why);
  out.push_back(efa_library_status());
  return out;
}

std::vector<std::string> verbs_device_summary() {
  std::string why;
  if (!verbs::ibv_loadable(&why)) return {"none: " + why};
  int n = 0;
  ibv_device** list = verbs::ibv().get_device_list(&n);
  if (!list) return {std::string("none: ibv_get_device_list: ") + strerror(errno)};
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i) {
    ibv_context* ctx = verbs::ibv().open_device(list[i]);
    if (!ctx) continue;
    ibv_device_attr attr{};
    if (verbs::ibv().query_device(ctx, &attr) == 0)
      for (int p = 1; p <= attr.phys_port_cnt; ++p) {
        ibv_port_attr pa{};
        if (verbs::ibv().query_port(ctx, uint8_t(p), &pa)) continue;
        ibv_gid gid{};
        const bool has_gid = verbs::ibv().query_gid(ctx, uint8_t(p), 0, &gid) == 0;
        const std::string dev = verbs::ibv().get_device_name(list[i]);
        out.push_back(dev + ":" + std::to_string(p) + " " + (pa.state == IBV_PORT_ACTIVE ? "active" : "down") +
                      ", link " + (pa.link_layer == IBV_LINK_LAYER_ETHERNET ? "Ethernet (RoCE)" : "InfiniBand") +
                      ", atomics " + (attr.atomic_cap == IBV_ATOMIC_NONE ? "no" : "yes") + ", GID[0] " +
                      (has_gid ? hex_encode(&gid, sizeof(gid)) : std::string("?")) + ", lid " + std::to_string(pa.lid) +
                      (is_efa_device(ctx) ? ", EFA (SRD transport)" : ""));
      }
    verbs::ibv().close_device(ctx);
  }
  verbs::ibv().free_device_list(list);
  if (out.empty()) out.push_back("none: no RDMA devices");
  return out;
}

}  // namespace portep
