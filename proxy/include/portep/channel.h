// A Channel: one transport, the two registered regions (data bytes and 64-bit signal slots) and the proxy
// group that serves them. Construction is local; connect() takes every rank's endpoint description (the
// Python layer exchanges them over torch.distributed).
//
// Signal slots: uint64 slot (src, stream) = src * num_streams + stream. Its low 32 bits count the writes of
// that stream that are in place; each final signal adds kSignalFinalMark.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "portep/proxy.h"
#include "portep/transport_factory.h"

namespace portep {

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

  uint8_t* data() const { return data_; }
  uint64_t data_bytes() const { return opts_.data_bytes; }
  uint64_t* signals() const { return signals_; }
  uint64_t signal_slots() const { return uint64_t(opts_.proxy.num_ranks) * opts_.proxy.num_streams; }
  ProxyGroup& proxies();
  const ChannelOptions& options() const { return opts_; }
  TransportProps transport_props() const { return transport_->props(); }
  bool alive() const { return proxies_ != nullptr; }

  void encode_or_throw(const CmdFields& f, TransferCmd* out) const;

 private:
  ChannelOptions opts_;
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<ProxyGroup> proxies_;
  uint8_t* data_ = nullptr;
  uint64_t* signals_ = nullptr;
  std::vector<uint64_t> cached_tails_;
};

}  // namespace portep
