// The transport interface: the one small contract every way of moving bytes between ranks implements
// (shm today; verbs RC/EFA SRD and NCCL later, each a new file). Proxies choose their protocol from
// props() at run time, never from the transport's name.
//
// Threading contract: "channel" c is used by exactly one proxy thread, so every per-channel call
// (post_*, poll_*) for one c comes from one thread and needs no locking. Every posting call is non-blocking:
// it returns false when the transport has no room now, and the caller makes progress (poll_*) and retries
// under its own timeout. A failed completion or an unusable peer throws TransportError.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace portep {

struct TransportProps {
  std::string name;
  bool ordered;         // writes, write-with-imm and atomics on one (channel, peer) land in posting order
  bool remote_atomics;  // post_atomic_add is available
  // A producer may store a WRITE's bytes into peer_region() itself and post the WRITE placed (kFlagPlaced): the
  // transport then carries only its notification. Where the transport would copy on this host anyway (shm), that
  // saves the copy, and on GPUs the proxies then make no CUDA call, so nothing the application does with CUDA
  // (a pageable copy, a kernel's first launch, a stream sharing a hardware queue) can hold them up.
  bool placed_writes = false;
};

enum RegionId : int { kRegionData = 0, kRegionSignal = 1, kNumRegions = 2 };

struct RecvNotice {
  uint32_t src;  // rank the write-with-imm came from
  uint32_t imm;
};

class TransportError : public std::runtime_error {
 public:
  explicit TransportError(const std::string& what) : std::runtime_error(what) {}
};

// Where a channel's posted operations wait, for error messages (read by the channel's own proxy thread).
struct TransportBacklog {
  uint64_t queued = 0;       // posted, not yet handed to the wire or the copy engine (unordered windows)
  uint64_t copying = 0;      // handed to a copy engine, completion not yet seen
  uint64_t notify_full = 0;  // 1 when the oldest completed copy waits for room in the receiver's ring
};

class Transport {
 public:
  virtual ~Transport() = default;

  virtual TransportProps props() const = 0;

  // Memory that peers may write into. Called before endpoint_blob(); the transport owns the memory.
  virtual void* alloc_region(RegionId region, size_t bytes) = 0;

  // Bootstrap: this rank's description (opaque bytes) and the connection to all ranks' descriptions,
  // indexed by rank. bootstrap_done() is called once every rank has connected (after a group barrier).
  virtual std::string endpoint_blob() = 0;
  virtual void connect(const std::vector<std::string>& blobs) = 0;
  virtual void bootstrap_done() {}

  // Copy bytes from this rank's data region to peer's data region; with imm, the peer's poll_recv on the
  // same channel later yields {this rank, *imm}, after the bytes are in place. bytes may be 0 (imm only).
  virtual bool post_write(int channel, int peer, uint64_t local_off, uint64_t remote_off, uint32_t bytes,
                          const uint32_t* imm, uint64_t wr_id) = 0;
  // Atomically add value to the 64-bit word at remote_off in peer's signal region (props().remote_atomics).
  virtual bool post_atomic_add(int channel, int peer, uint64_t remote_off, uint64_t value, uint64_t wr_id) = 0;

  // Local completions of earlier posts on channel (their wr_ids, any order); also drives progress.
  virtual int poll_send(int channel, uint64_t* wr_ids, int max) = 0;
  // Write-with-imm notifications that arrived for this rank on channel.
  virtual int poll_recv(int channel, RecvNotice* out, int max) = 0;

  // A short description of peer's state for error messages (e.g. "pid 123 exited").
  virtual std::string describe_peer(int peer) const = 0;
  // False once the transport knows the peer's process is gone (shm: it checks the process); true where it cannot
  // tell. Any thread may call it.
  virtual bool peer_alive(int peer) const { return true; }

  // The peer's region mapped into this process when it is reachable by plain loads and stores (shm: every
  // rank of the host), else nullptr. Callers that store into it directly publish either with a release atomic on
  // the peer's signal region, or (props().placed_writes) with placed WRITEs and a signal through the proxies.
  virtual void* peer_region(int peer, RegionId region) const { return nullptr; }
  virtual size_t peer_region_bytes(int peer, RegionId region) const { return 0; }
  // Where kernels address this rank's region when the transport keeps it GPU-visible, else nullptr.
  virtual void* region_device_address(RegionId region) const { return nullptr; }
  // Only from the thread that drives `channel` (its poll_send / poll_recv caller).
  virtual TransportBacklog backlog(int channel) const { return {}; }
  // Called by channel's proxy thread after poll_recv returned notices, before it publishes their signals: a
  // NIC's writes into GPU memory need a flush before kernels may read them.
  virtual void make_writes_visible(int channel) { (void)channel; }
};

}  // namespace portep
