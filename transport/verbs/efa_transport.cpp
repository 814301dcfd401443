// EFA SRD transport (see efa_transport.h). Reviewed against efadv(7), efadv_create_qp_ex(3),
// efadv_query_device(3) and efadv_query_ah(3) of rdma-core 44; compiled in CI, not run there (no EFA device).
#include "transport/verbs/efa_transport.h"

#include <arpa/inet.h>
#include <stdlib.h>
#include <infiniband/efadv.h>

#include <unordered_map>
#include <vector>

#include "transport/verbs/gpu_data_region.h"
#include "transport/verbs/verbs_common.h"

namespace portep {

using namespace verbs;

namespace {

// Bits of efadv_device_attr.device_caps, as rdma-core's efadv.h numbers them (older headers lack the later ones).
constexpr uint32_t kCapsRnrRetry = 1u << 1;   // EFADV_DEVICE_ATTR_CAPS_RNR_RETRY
constexpr uint32_t kCapsRdmaWrite = 1u << 3;  // EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE
constexpr uint32_t kQkey = 0x11111111;        // SRD QPs of one job agree on a qkey; any non-reserved value works
constexpr uint8_t kRnrRetryForever = 7;       // the proxies' timeouts bound the wait instead

// libefa's functions, loaded with libibverbs at run time (verbs_library.h).
struct EfaApi {
  int (*query_device)(ibv_context* ctx, efadv_device_attr* attr, uint32_t inlen);
  ibv_qp* (*create_qp_ex)(ibv_context* ctx, ibv_qp_init_attr_ex* attr, efadv_qp_init_attr* efa_attr, uint32_t inlen);
  int (*query_ah)(ibv_ah* ah, efadv_ah_attr* attr, uint32_t inlen);
};

// The loaded libefa, or null with *why (its name and dlerror(), or the missing symbol).
const EfaApi* loaded_efa(std::string* why) {
  static const std::pair<EfaApi, std::string> loaded = [] {
    EfaApi api{};
    std::string error;
    ibv_loadable(&error);  // libefa's provider needs libibverbs loaded first
    const std::string name = efa_library_name();
    void* handle = error.empty() ? load_library_once(name, &error) : nullptr;
    if (handle) {
      api.query_device = reinterpret_cast<decltype(api.query_device)>(find_symbol(handle, "efadv_query_device"));
      api.create_qp_ex = reinterpret_cast<decltype(api.create_qp_ex)>(find_symbol(handle, "efadv_create_qp_ex"));
      api.query_ah = reinterpret_cast<decltype(api.query_ah)>(find_symbol(handle, "efadv_query_ah"));
      if (!api.query_device || !api.create_qp_ex || !api.query_ah)
        error = name + " lacks efadv_query_device, efadv_create_qp_ex or efadv_query_ah";
    }
    return std::make_pair(api, error);
  }();
  if (why) *why = loaded.second;
  return loaded.second.empty() ? &loaded.first : nullptr;
}

const EfaApi& efa_api() {
  std::string why;
  const EfaApi* efa = loaded_efa(&why);
  if (!efa) throw TransportError("efa: " + why);
  return *efa;
}

struct SrdChannel {
  ibv_cq* send_cq = nullptr;
  ibv_cq* recv_cq = nullptr;
  ibv_qp* qp = nullptr;
  ibv_qp_ex* qpx = nullptr;
  uint32_t outstanding = 0;  // signaled writes not yet completed
};

struct SrdPeer {
  ibv_ah* ah = nullptr;
  std::vector<uint32_t> qpn;  // the peer's QP of each channel
};

uint64_t sender_key(uint32_t ahn, uint32_t qpn) { return uint64_t(ahn) << 32 | qpn; }

uint32_t parse_qpn(const std::string& s, int peer) {
  char* end = nullptr;
  const unsigned long v = strtoul(s.c_str(), &end, 10);
  if (s.empty() || *end || v > 0xffffff)
    throw TransportError("efa: malformed QP number '" + s + "' from rank " + std::to_string(peer));
  return uint32_t(v);
}

class EfaTransport final : public Transport {
 public:
  EfaTransport(const VerbsOptions& o, ibv_context* ctx, int port, const std::string& dev_name,
               const efadv_device_attr& efa)
      : o_(o), ctx_(ctx), port_(port), dev_name_(dev_name), efa_(efa) {
    try {
      setup();
    } catch (...) {
      teardown();
      throw;
    }
  }

  ~EfaTransport() override { teardown(); }

  TransportProps props() const override { return TransportProps{"efa-srd", false, false}; }

  void* alloc_region(RegionId region, size_t bytes) override {
    if (connected_) throw TransportError("efa: regions must be allocated before connect()");
    Region& r = regions_[region];
    r.bytes = bytes ? bytes : 64;
    const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;  // no reads: not every EFA has them
    if (on_device(region)) {  // as RC does (verbs_common.h); SRD has no atomics, so signals are immediates anyway
      gpu_data_.allocate(pd_, &r, o_.device.get(), access, o_.gpudirect);
      return r.addr;
    }
    r.addr = alloc_pages(r.bytes);
    register_region(pd_, &r, access);
    if (o_.device && region == kRegionSignal) device_signal_ = o_.device->map_host(r.addr, r.bytes);
    return r.addr;
  }

  void* region_device_address(RegionId region) const override {
    return o_.device ? gpu_data_.kernel_address(region, regions_[kRegionData], device_signal_) : nullptr;
  }
  void make_writes_visible(int) override { gpu_data_.flush_nic_writes(); }

  // Lines: gid, then per region "addr rkey bytes", then the QP number of each channel.
  std::string endpoint_blob() override {
    std::string out = hex_encode(&gid_, sizeof(gid_)) + "\n";
    for (auto& r : regions_) out += region_line(r);
    for (auto& ch : channels_) out += std::to_string(ch.qp->qp_num) + "\n";
    return out;
  }

  void connect(const std::vector<std::string>& blobs) override {
    check_connect_inputs(blobs.size(), o_.num_ranks, regions_, "efa");
    remotes_.assign(size_t(o_.num_ranks), RemoteRegions{});
    peers_.assign(size_t(o_.num_ranks), SrdPeer{});
    for (int p = 0; p < o_.num_ranks; ++p) {
      const std::vector<std::string> f = split_lines(blobs[p]);
      if (f.size() != size_t(1 + kNumRegions + o_.num_channels))
        throw TransportError("efa: malformed endpoint description from rank " + std::to_string(p));
      ibv_gid gid;
      unhex(f[0], &gid, sizeof(gid));
      for (int r = 0; r < kNumRegions; ++r) parse_region_line(f[1 + r], &remotes_[p], r, p);
      SrdPeer& peer = peers_[p];
      peer.ah = create_ah(gid, p);
      efadv_ah_attr ah_attr{};
      if (int e = efa_api().query_ah(peer.ah, &ah_attr, sizeof(ah_attr))) fail("efadv_query_ah", e);
      for (int c = 0; c < o_.num_channels; ++c) {
        peer.qpn.push_back(parse_qpn(f[1 + kNumRegions + c], p));
        // A receive completion carries the AH number this rank created for the sender and its QP number.
        senders_[sender_key(ah_attr.ahn, peer.qpn.back())] = p;
      }
    }
    connected_ = true;
  }

  bool post_write(int channel, int peer, uint64_t local_off, uint64_t remote_off, uint32_t bytes, const uint32_t* imm,
                  uint64_t wr_id) override {
    if (!connected_) throw TransportError("efa: post before connect()");
    SrdChannel& ch = at(channel);
    check_peer(peer);
    check_range(regions_[kRegionData], remotes_[size_t(peer)], kRegionData, peer, local_off, remote_off, bytes);
    if (bytes > efa_.max_rdma_size)
      throw TransportError("efa: a write of " + std::to_string(bytes) + " bytes exceeds the device's max_rdma_size " +
                           std::to_string(efa_.max_rdma_size));
    if (ch.outstanding >= o_.max_send_wr) return false;
    const uint64_t remote_addr = remotes_[size_t(peer)].addr[kRegionData] + remote_off;
    const uint32_t rkey = remotes_[size_t(peer)].rkey[kRegionData];
    ibv_wr_start(ch.qpx);
    ch.qpx->wr_id = wr_id;
    ch.qpx->wr_flags = IBV_SEND_SIGNALED;
    if (imm)
      ibv_wr_rdma_write_imm(ch.qpx, rkey, remote_addr, htonl(*imm));
    else
      ibv_wr_rdma_write(ch.qpx, rkey, remote_addr);
    if (bytes)
      ibv_wr_set_sge(ch.qpx, regions_[kRegionData].mr->lkey,
                     reinterpret_cast<uintptr_t>(regions_[kRegionData].addr) + local_off, bytes);
    else
      ibv_wr_set_sge_list(ch.qpx, 0, nullptr);
    ibv_wr_set_ud_addr(ch.qpx, peers_[size_t(peer)].ah, peers_[size_t(peer)].qpn[size_t(channel)], kQkey);
    const int e = ibv_wr_complete(ch.qpx);
    if (e == ENOMEM) return false;  // the send queue is full right now
    if (e) fail("ibv_wr_complete (RDMA write to rank " + std::to_string(peer) + ")", e);
    ++ch.outstanding;
    return true;
  }

  bool post_atomic_add(int, int, uint64_t, uint64_t, uint64_t) override {
    throw TransportError(
        "efa: SRD has no remote atomics; the proxy must emulate them (props().remote_atomics "
        "is false)");
  }

  int poll_send(int channel, uint64_t* wr_ids, int max) override {
    SrdChannel& ch = at(channel);
    ibv_wc wc[kPollBatch];
    const int n = poll_cq(ch.send_cq, max, wc, "ibv_poll_cq (send)");
    for (int i = 0; i < n; ++i) {
      check_send_completion(wc[i], "efa", "a write on channel", channel);
      --ch.outstanding;
      wr_ids[i] = wc[i].wr_id;
    }
    return n;
  }

  int poll_recv(int channel, RecvNotice* out, int max) override {
    SrdChannel& ch = at(channel);
    ibv_wc wc[kPollBatch];
    const int n = poll_cq(ch.recv_cq, max, wc, "ibv_poll_cq (recv)");
    for (int i = 0; i < n; ++i) {
      check_imm_receive(wc[i], "efa", "on channel", channel);
      auto it = senders_.find(sender_key(wc[i].slid, wc[i].src_qp));
      if (it == senders_.end())
        throw TransportError("efa: an immediate from an unknown sender (AH " + std::to_string(wc[i].slid) + ", QP " +
                             std::to_string(wc[i].src_qp) + ")");
      out[i] = RecvNotice{uint32_t(it->second), ntohl(wc[i].imm_data)};
      post_recvs(ch.qp, 1);
    }
    return n;
  }

  std::string describe_peer(int peer) const override {
    return "rank " + std::to_string(peer) + " (EFA SRD over " + dev_name_ + ":" + std::to_string(port_) +
           (o_.device ? ", GPU data region: " + gpu_data_.how() : std::string()) + ")";
  }

 private:
  void setup() {
    if (!(efa_.device_caps & kCapsRdmaWrite))
      throw TransportError("efa: " + dev_name_ + " reports no RDMA write (efadv device_caps 0x" +
                           hex_encode(&efa_.device_caps, sizeof(efa_.device_caps)) +
                           "): portep needs an EFA device and an rdma-core whose efadv reports "
                           "EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE");
    if (verbs::ibv().query_port(ctx_, uint8_t(port_), &port_attr_)) fail("ibv_query_port", errno);
    if (verbs::ibv().query_device(ctx_, &dev_attr_)) fail("ibv_query_device", errno);
    if (verbs::ibv().query_gid(ctx_, uint8_t(port_), o_.gid_index, &gid_)) fail("ibv_query_gid", errno);
    pd_ = verbs::ibv().alloc_pd(ctx_);
    if (!pd_) fail("ibv_alloc_pd", errno);
    channels_.resize(size_t(o_.num_channels));
    for (auto& ch : channels_) build_channel(&ch);
  }

  void build_channel(SrdChannel* ch) {
    // Queue depths within the device's limits, and never deeper than a CQ can hold (no CQ overflow).
    const uint64_t cqe_limit = uint64_t(dev_attr_.max_cqe > 0 ? dev_attr_.max_cqe : 1);
    auto cap = [cqe_limit](uint64_t want, uint64_t device_max) {
      const uint64_t v = want < device_max ? want : device_max;
      return uint32_t(v < cqe_limit ? v : cqe_limit);
    };
    const uint32_t send_wr = cap(o_.max_send_wr, efa_.max_sq_wr);
    const uint32_t recv_wr = cap(uint64_t(o_.recv_depth) * uint64_t(o_.num_ranks), efa_.max_rq_wr);
    if (o_.max_send_wr > send_wr) o_.max_send_wr = send_wr;  // the in-flight window follows the queue
    ch->send_cq = verbs::ibv().create_cq(ctx_, int(send_wr), nullptr, nullptr, 0);
    ch->recv_cq = verbs::ibv().create_cq(ctx_, int(recv_wr), nullptr, nullptr, 0);
    if (!ch->send_cq || !ch->recv_cq) fail("ibv_create_cq", errno);
    ibv_qp_init_attr_ex a{};
    a.qp_type = IBV_QPT_DRIVER;
    a.send_cq = ch->send_cq;
    a.recv_cq = ch->recv_cq;
    a.cap.max_send_wr = send_wr;
    a.cap.max_recv_wr = recv_wr;
    a.cap.max_send_sge = 1;
    a.cap.max_recv_sge = 1;
    a.pd = pd_;
    a.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
    a.send_ops_flags = IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM;
    efadv_qp_init_attr e{};
    e.driver_qp_type = EFADV_QP_DRIVER_TYPE_SRD;
    ch->qp = efa_api().create_qp_ex(ctx_, &a, &e, sizeof(e));
    if (!ch->qp) fail("efadv_create_qp_ex (SRD)", errno);
    ch->qpx = verbs::ibv().qp_to_qp_ex(ch->qp);
    if (!ch->qpx) throw TransportError("efa: ibv_qp_to_qp_ex gave no extended QP");
    bring_up(ch->qp);
    post_recvs(ch->qp, recv_wr);
  }

  // SRD QPs go INIT (port, pkey, qkey) -> RTR -> RTS like UD ones; no remote address is bound.
  void bring_up(ibv_qp* qp) {
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = uint8_t(port_);
    a.qkey = kQkey;
    if (int e = verbs::ibv().modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY))
      fail("ibv_modify_qp to INIT", e);
    a = ibv_qp_attr{};
    a.qp_state = IBV_QPS_RTR;
    if (int e = verbs::ibv().modify_qp(qp, &a, IBV_QP_STATE)) fail("ibv_modify_qp to RTR", e);
    a = ibv_qp_attr{};
    a.qp_state = IBV_QPS_RTS;
    a.sq_psn = 0;
    int mask = IBV_QP_STATE | IBV_QP_SQ_PSN;
    if (efa_.device_caps & kCapsRnrRetry) {
      a.rnr_retry = kRnrRetryForever;
      mask |= IBV_QP_RNR_RETRY;
    }
    if (int e = verbs::ibv().modify_qp(qp, &a, mask)) fail("ibv_modify_qp to RTS", e);
  }

  ibv_ah* create_ah(const ibv_gid& gid, int peer) {
    ibv_ah_attr a{};
    a.is_global = 1;
    a.grh.dgid = gid;
    a.grh.sgid_index = uint8_t(o_.gid_index);
    a.port_num = uint8_t(port_);
    ibv_ah* ah = verbs::ibv().create_ah(pd_, &a);
    if (!ah) fail("ibv_create_ah for rank " + std::to_string(peer), errno);
    return ah;
  }

  SrdChannel& at(int channel) {
    if (channel < 0 || channel >= o_.num_channels)
      throw TransportError("efa: channel " + std::to_string(channel) + " out of range");
    return channels_[size_t(channel)];
  }

  void check_peer(int peer) const {
    if (peer < 0 || peer >= o_.num_ranks) throw TransportError("efa: peer " + std::to_string(peer) + " out of range");
  }

  void teardown() {
    for (auto& p : peers_)
      if (p.ah) verbs::ibv().destroy_ah(p.ah);
    peers_.clear();
    for (auto& ch : channels_) {
      if (ch.qp) verbs::ibv().destroy_qp(ch.qp);
      if (ch.send_cq) verbs::ibv().destroy_cq(ch.send_cq);
      if (ch.recv_cq) verbs::ibv().destroy_cq(ch.recv_cq);
    }
    channels_.clear();
    if (device_signal_) o_.device->unmap_host(regions_[kRegionSignal].addr);
    device_signal_ = nullptr;
    for (int i = 0; i < kNumRegions; ++i) {
      if (on_device(RegionId(i)))
        gpu_data_.release(&regions_[i]);
      else
        release_region(&regions_[i]);
    }
    if (pd_) verbs::ibv().dealloc_pd(pd_);
    pd_ = nullptr;
    if (ctx_) verbs::ibv().close_device(ctx_);
    ctx_ = nullptr;
  }

  bool on_device(RegionId region) const { return o_.device && region == kRegionData; }

  VerbsOptions o_;
  ibv_context* ctx_;
  int port_;
  std::string dev_name_;
  efadv_device_attr efa_;
  ibv_port_attr port_attr_{};
  ibv_device_attr dev_attr_{};
  ibv_gid gid_{};
  ibv_pd* pd_ = nullptr;
  Region regions_[kNumRegions];
  std::vector<SrdChannel> channels_;
  std::vector<SrdPeer> peers_;
  std::vector<RemoteRegions> remotes_;
  std::unordered_map<uint64_t, int> senders_;  // (AH number, QP number) of a receive completion -> rank
  void* device_signal_ = nullptr;              // the signal region as kernels address it (GPU data only)
  GpuDataRegion gpu_data_;                     // how the data region is placed and registered (GPU data only)
  bool connected_ = false;
};

}  // namespace

bool is_efa_device(ibv_context* ctx) {
  const EfaApi* efa = loaded_efa(nullptr);
  efadv_device_attr a{};
  return efa && efa->query_device(ctx, &a, sizeof(a)) == 0;
}

std::string efa_library_status() {
  std::string why;
  const std::string name = efa_library_name();
  return loaded_efa(&why) ? name + ": " + library_path(load_library_once(name, nullptr))
                          : name + ": not loadable: " + why;
}

std::unique_ptr<Transport> make_efa_transport(const VerbsOptions& o, ibv_context* ctx, int port,
                                              const std::string& dev_name) {
  efadv_device_attr a{};
  if (int e = efa_api().query_device(ctx, &a, sizeof(a))) {
    verbs::ibv().close_device(ctx);
    fail("efadv_query_device on " + dev_name, e);
  }
  return std::make_unique<EfaTransport>(o, ctx, port, dev_name, a);
}

}  // namespace portep
