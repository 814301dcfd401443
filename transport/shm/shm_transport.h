// The shm transport: processes of one host, host memory in POSIX shared memory.
//
// GPU memory (options.device set): the data region is device memory shared through IPC; a write is a copy
// on the channel's copy-engine stream, and its notification (or a later atomic add) is delivered only once
// that copy has completed, so the receiver never sees a signal before the bytes. The signal region stays in
// shared host memory, mapped into the GPU so kernels can poll it.
//
// ordered mode:   a post is carried out at once by the posting thread (memcpy or atomic add, then the
//                 notification), so one (channel, peer) delivers in posting order. Native atomics.
// unordered mode: posts wait in a per-(channel, peer) window and are carried out in a seeded random order,
//                 data placement and notification together, like EFA SRD: nothing is ordered and there are
//                 no remote atomics, so the proxies must use the ordering protocols.
#pragma once

#include <deque>
#include <memory>
#include <random>
#include <vector>

#include "transport/shm/notify_ring.h"
#include "transport/device_memory.h"
#include "transport/transport.h"
#include "transport/shm/shm_segment.h"

namespace portep {

struct ShmOptions {
  int rank = 0;
  int num_ranks = 1;
  int num_channels = 1;
  bool ordered = true;
  uint32_t window = 64;                  // unordered: posts held per (channel, peer) before one must be delivered
  uint64_t seed = 0;                     // unordered: delivery order
  std::shared_ptr<DeviceMemory> device;  // set: the data region is GPU memory
};

class ShmTransport final : public Transport {
 public:
  explicit ShmTransport(const ShmOptions& o);
  ~ShmTransport() override;

  TransportBacklog backlog(int channel) const override;
  TransportProps props() const override;
  void* alloc_region(RegionId region, size_t bytes) override;
  std::string endpoint_blob() override;
  void connect(const std::vector<std::string>& blobs) override;
  void bootstrap_done() override;
  bool post_write(int channel, int peer, uint64_t local_off, uint64_t remote_off, uint32_t bytes, const uint32_t* imm,
                  uint64_t wr_id) override;
  bool post_atomic_add(int channel, int peer, uint64_t remote_off, uint64_t value, uint64_t wr_id) override;
  int poll_send(int channel, uint64_t* wr_ids, int max) override;
  int poll_recv(int channel, RecvNotice* out, int max) override;
  std::string describe_peer(int peer) const override;
  bool peer_alive(int peer) const override;
  void* peer_region(int peer, RegionId region) const override;
  size_t peer_region_bytes(int peer, RegionId region) const override;
  void* region_device_address(RegionId region) const override;

 private:
  struct Op {
    bool atomic;
    bool has_imm;
    uint32_t imm;
    uint32_t bytes;
    uint64_t local_off, remote_off, value, wr_id;
  };
  struct Peer {
    int pid = 0;
    char* data = nullptr;
    char* signal = nullptr;
    size_t data_bytes = 0, signal_bytes = 0;
    std::vector<ShmSegment> maps;  // empty for this rank (its own segments are used directly)
  };
  struct Lane {  // one (channel, peer) connection as seen by the sender
    NotifyRingProducer ring;
    std::vector<Op> pending;  // unordered mode only
    std::mt19937_64 rng;
  };
  struct DeviceOp {  // GPU memory: an op waiting for its copy (and every earlier one) to complete
    Op op;
    int peer;
    uint64_t ticket;  // kUnrecorded until the next record() covers it
  };
  static constexpr uint64_t kUnrecorded = ~0ull;
  struct Channel {
    std::deque<DeviceOp> device_ops;          // issue order
    std::vector<Lane> lanes;                  // by peer
    std::vector<NotifyRingConsumer> inboxes;  // by source
    std::vector<uint64_t> done;               // local completions not yet polled
    uint32_t next_source = 0;                 // round-robin start for poll_recv fairness
    bool ring_full = false;                   // the oldest finished copy's notification found no room
  };

  int peer_pid(int peer) const;  // 0 where not known
  bool deliver(int channel, int peer, const Op& op);
  bool notify(int channel, int peer, const Op& op);  // the atomic or notification half of deliver
  void issue_device_op(int channel, int peer, const Op& op);
  void retire_device_ops(int channel);
  size_t local_data_bytes() const;
  void deliver_some(int channel, int peer);
  void check_range(int peer, bool signal_region, uint64_t off, uint64_t bytes, const char* what) const;
  void check_channel_peer(int channel, int peer) const;

  ShmOptions o_;
  ShmSegment regions_[kNumRegions];
  void* device_data_ = nullptr;  // GPU memory: this rank's data region
  size_t device_data_bytes_ = 0;
  void* device_signal_ = nullptr;  // GPU memory: the signal region's address for kernels
  ShmSegment inbox_;
  std::vector<Peer> peers_;
  std::vector<Channel> channels_;
  bool connected_ = false;
};

}  // namespace portep
