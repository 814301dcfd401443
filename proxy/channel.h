// A Channel: one transport, the two registered regions (data bytes and 64-bit signal slots) and the proxy
// group that serves them. Construction is local; connect() takes every rank's endpoint description (the
// Python layer exchanges them over torch.distributed).
//
// Signal slots: uint64 slot (src, stream) = src * num_streams + stream. Its low 32 bits count the writes of
// that stream that are in place; each final signal adds kSignalFinalMark.
#pragma once

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "proxy/proxy.h"
#include "transport/transport_factory.h"

namespace portep {

// Why a wait on a signal slot gave up, besides the peer statuses of peer_status.h: the caller's timeout passed.
constexpr uint32_t kWaitTimedOut = 100;

struct ChannelOptions {
  TransportSpec transport;
  ProxyConfig proxy;
  uint64_t data_bytes = 1 << 20;
};

class Channel {
 public:
  explicit Channel(const ChannelOptions& o);
  ~Channel();

  std::string endpoint_blob();
  void connect(const std::vector<std::string>& blobs);
  void bootstrap_done();  // every rank connected: start proxies, release names
  void destroy();         // stop proxies, unmap everything; idempotent

  // Host producer calls (one caller thread at a time per cached-tail set; traffic generators keep their own).
  void write(int dst, uint64_t local_off, uint64_t remote_off, uint64_t bytes, uint32_t stream);
  void signal(int dst, uint32_t stream, bool final_signal);
  void quiet();
  void barrier();
  // Waits until the low 32 bits of slot (src, stream) reach at least `count`; returns the slot value.
  uint64_t wait_signal(int src, uint32_t stream, uint64_t count, double timeout_s);

  // dst's data region when this process can store into it directly (same host), else nullptr.
  uint8_t* peer_data(int dst) const;
  uint64_t peer_data_bytes(int dst) const;
  // Adds units (+ the final mark) to slot (this rank, stream) of dst with a release atomic on its mapped signal
  // region: everything this thread stored into dst's memory before is visible once the slot shows the units.
  void direct_signal(int dst, uint32_t stream, uint64_t units, bool final_signal);
  // Waits for slot (src, stream) and takes what it was waiting for out of it (adds commute, so units a peer
  // adds meanwhile stay): with need_final, all units and one final mark once a final mark is there; else
  // exactly min_units once that many are there. Returns the units taken.
  uint64_t consume_signal(int src, uint32_t stream, uint64_t min_units, bool need_final, double timeout_s);
  // consume_signal for a final signal, without raising: kPeerOk with *units taken, else why the wait gave up
  // (kWaitTimedOut, or src's peer status: it left, its process is gone, it refused the call).
  uint32_t try_consume_final(int src, uint32_t stream, double timeout_s, uint64_t* units);
  // Raises the error of a wait on src that gave up for `why` (try_consume_final's), naming the rank.
  [[noreturn]] void raise_wait_failure(int src, uint32_t why, double timeout_s, const std::string& what) const;
  // The status streams (peer_watch.h; ChannelOptions.proxy.status_stream >= 0): tell every rank, this one included,
  // of an event of this rank's; a peer's status (kPeerOk while it answers); events src announced so far.
  void announce(StatusEvent kind);
  uint32_t peer_status(int peer) const;
  uint64_t status_events(int src, StatusEvent kind) const;

  uint8_t* data() const { return data_; }
  // Where kernels address this rank's region (GPU channels), else nullptr.
  void* device_address(RegionId region) const {
    return transport_ ? transport_->region_device_address(region) : nullptr;
  }
  uint64_t data_bytes() const { return opts_.data_bytes; }
  uint64_t* signals() const { return signals_; }
  uint64_t signal_slots() const { return uint64_t(opts_.proxy.num_ranks) * opts_.proxy.num_streams; }
  ProxyGroup& proxies();
  const ChannelOptions& options() const { return opts_; }
  TransportProps transport_props() const { return transport_->props(); }
  // What keeps this Channel's memory (its regions and its mappings of the peers') mapped: a holder outlives
  // destroy(), which then stops the proxies but leaves the memory until the last holder lets go.
  std::shared_ptr<const Transport> memory_owner() const { return transport_; }
  std::string describe_peer(int peer) const {
    if (!transport_) throw std::runtime_error("channel was destroyed");
    return transport_->describe_peer(peer);
  }
  bool alive() const { return proxies_ != nullptr; }

  void encode_or_throw(const CmdFields& f, TransferCmd* out) const;

 private:
  void check_peer_stream(const char* peer_name, int peer, uint32_t stream) const;
  uint64_t* slot(int src, uint32_t stream) const;  // checked
  template <class Ready>
  uint32_t wait_slot_for(int src, uint32_t stream, double timeout_s, Ready ready, uint64_t* value);
  template <class Ready, class Failure>
  uint64_t wait_slot(int src, uint32_t stream, double timeout_s, Ready ready, Failure failure);
  uint64_t take(int src, uint32_t stream, uint64_t value, uint64_t min_units, bool need_final);

  ChannelOptions opts_;
  std::shared_ptr<Transport> transport_;  // shared with the leases (memory_owner) that keep its memory mapped
  std::unique_ptr<ProxyGroup> proxies_;
  uint8_t* data_ = nullptr;
  uint64_t* signals_ = nullptr;
  std::vector<uint64_t> cached_tails_;
};

}  // namespace portep
