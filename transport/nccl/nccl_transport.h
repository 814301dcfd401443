// The nccl transport: the proxies' writes as one-sided puts into registered windows (ncclPutSignal), their
// immediates as records in the receiver's control window (nccl_records.h), ordering from the one-sided API's own
// guarantee (a counted signal means the earlier puts of its lane have landed). The operations come from an
// RmaEngine: NCCL's host API, or its shared-memory emulation (transport "nccl-emulated"), on which this protocol
// runs in CI.
//
// All channels share one lane per peer (NCCL: one stream), so a receiver can tie a record to the count of signals
// from its source. Ordered (per channel and peer, posting order holds), no remote atomics: the proxies tag writes
// with immediates. Threads: a channel's calls come from its proxy thread; lanes (send side) and sources (receive
// side) are shared by all channels and locked.
#pragma once

#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport/device_memory.h"
#include "transport/nccl/nccl_records.h"
#include "transport/nccl/rma_engine.h"
#include "transport/transport.h"

namespace portep {

class NcclTransport final : public Transport {
 public:
  // trust_on_sight: debug only, a record counts as delivered when seen, before its signals (proves tests can fail).
  // device: set where kernels poll the signal region (it is then mapped into the GPU).
  NcclTransport(std::string name, int rank, int num_ranks, int num_channels, std::unique_ptr<RmaEngine> engine,
                std::shared_ptr<DeviceMemory> device = nullptr, bool trust_on_sight = false);
  ~NcclTransport() override;

  TransportProps props() const override;
  void* alloc_region(RegionId region, size_t bytes) override;
  std::string endpoint_blob() override;
  void connect(const std::vector<std::string>& blobs) override;
  void bootstrap_done() override { engine_->bootstrap_done(); }
  bool post_write(int channel, int peer, uint64_t local_off, uint64_t remote_off, uint32_t bytes, const uint32_t* imm,
                  uint64_t wr_id) override;
  bool post_atomic_add(int channel, int peer, uint64_t remote_off, uint64_t value, uint64_t wr_id) override;
  int poll_send(int channel, uint64_t* wr_ids, int max) override;
  int poll_recv(int channel, RecvNotice* out, int max) override;
  std::string describe_peer(int peer) const override;
  bool peer_alive(int peer) const override;
  void* region_device_address(RegionId region) const override;
  TransportBacklog backlog(int channel) const override;

 private:
  struct Lane {  // this rank's sends to one peer
    std::mutex mu;
    uint64_t puts = 0;          // puts made to the peer (data, records, credits)
    uint64_t records_sent = 0;  // records put into the peer's ring
    uint64_t acked = 0;         // records the peer has consumed (its credit)
  };
  struct Source {  // what this rank receives from one source
    std::mutex mu;
    bool armed = false;
    uint64_t armed_total = 0;  // signals the armed wait is for
    uint64_t counted = 0;      // signals counted when the last armed wait completed
    uint64_t next_seq = 1;     // the next record expected
    uint64_t credited = 0;     // records consumed as of the last credit put
    std::vector<char> mirror;  // the inbox as last copied to the host
  };
  struct Pending {
    int peer;
    uint64_t ticket, wr_id;
  };
  struct Channel {
    std::deque<Pending> pending;  // posted, not yet locally complete (this channel's thread only)
    std::mutex mu;
    std::deque<RecvNotice> notices;  // delivered records of this channel, from any source's processing
  };

  void receive(int src);  // with the source's lock held
  void send_credit(int src, uint64_t consumed);
  void check_peer(int peer, const char* what) const;
  void check_range(int peer, uint64_t off, uint64_t bytes, bool remote, const char* what) const;

  std::string name_;
  int rank_, num_ranks_, num_channels_;
  std::unique_ptr<RmaEngine> engine_;
  std::shared_ptr<DeviceMemory> device_;
  bool trust_on_sight_;
  void* signal_region_ = nullptr;  // page-aligned host memory, mapped into the GPU where device_ is set
  void* signal_device_ = nullptr;
  size_t data_bytes_ = 0;
  std::vector<uint64_t> peer_data_bytes_;
  std::vector<std::unique_ptr<Lane>> lanes_;
  std::vector<std::unique_ptr<Source>> sources_;
  std::vector<std::unique_ptr<Channel>> channels_;
  bool connected_ = false;
};

}  // namespace portep
