// Pieces the RC (verbs_transport.cpp) and EFA SRD (efa_transport.cpp) transports share: registered regions,
// the peers' region descriptions in the endpoint blob, completion polling and error text.
#pragma once

#include <errno.h>
#include <infiniband/verbs.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <string>

#include "transport/endpoint_text.h"
#include "transport/transport.h"
#include "transport/verbs/verbs_library.h"

namespace portep::verbs {

constexpr int kPollBatch = 64;

[[noreturn]] inline void fail(const std::string& what, int err) {
  throw TransportError("verbs: " + what + ": " + strerror(err));
}

struct Region {
  void* addr = nullptr;
  size_t bytes = 0;
  ibv_mr* mr = nullptr;
};

struct RemoteRegions {
  uint64_t addr[kNumRegions] = {};
  uint32_t rkey[kNumRegions] = {};
  uint64_t bytes[kNumRegions] = {};
};

inline void* alloc_pages(size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) fail("mmap of " + std::to_string(bytes) + " bytes", errno);
  return p;
}

inline void register_region(ibv_pd* pd, Region* r, int access) {
  r->mr = verbs::ibv().reg_mr(pd, r->addr, r->bytes, access);
  if (!r->mr) fail("ibv_reg_mr of " + std::to_string(r->bytes) + " bytes", errno);
}

inline void release_region(Region* r) {
  if (r->mr) verbs::ibv().dereg_mr(r->mr);
  if (r->addr) munmap(r->addr, r->bytes);
  *r = Region{};
}

// One line per region of the endpoint blob: "addr rkey bytes".
inline std::string region_line(const Region& r) {
  return std::to_string(reinterpret_cast<uintptr_t>(r.addr)) + " " + std::to_string(r.mr ? r.mr->rkey : 0) + " " +
         std::to_string(r.bytes) + "\n";
}

inline void parse_region_line(const std::string& line, RemoteRegions* out, int region, int peer) {
  if (sscanf(line.c_str(), "%lu %u %lu", &out->addr[region], &out->rkey[region], &out->bytes[region]) != 3)
    throw TransportError("verbs: malformed region description from rank " + std::to_string(peer));
}

inline void unhex(const std::string& s, void* out, size_t n) {
  const std::string bytes = hex_decode(s, "verbs");
  if (bytes.size() != n) throw TransportError("verbs: malformed endpoint description (hex field)");
  memcpy(out, bytes.data(), n);
}

// Up to min(max, kPollBatch) completions into wc.
inline int poll_cq(ibv_cq* cq, int max, ibv_wc* wc, const char* what) {
  const int n = ibv_poll_cq(cq, max < kPollBatch ? max : kPollBatch, wc);
  if (n < 0) fail(what, errno);
  return n;
}

// Receives kept posted for write-with-immediate notifications (no buffers: the immediate is the message).
inline void post_recvs(ibv_qp* qp, uint32_t n) {
  for (uint32_t i = 0; i < n; ++i) {
    ibv_recv_wr wr{};
    ibv_recv_wr* bad = nullptr;
    if (int e = ibv_post_recv(qp, &wr, &bad)) fail("ibv_post_recv", e);
  }
}

// connect() needs one endpoint description per rank and both regions registered.
inline void check_connect_inputs(size_t num_blobs, int num_ranks, const Region* regions, const char* transport) {
  if (num_blobs != size_t(num_ranks))
    throw TransportError(std::string(transport) + ": wrong number of endpoint descriptions");
  for (int r = 0; r < kNumRegions; ++r)
    if (!regions[r].mr)
      throw TransportError(std::string(transport) + ": allocate the data and signal regions before connect()");
}

// Throws for a failed send completion, naming it "<transport>: <what> <id>" (text built only then). A failed
// completion's opcode is undefined: only its status, QP and wr_id say anything.
inline void check_send_completion(const ibv_wc& wc, const char* transport, const char* what, int id) {
  if (wc.status != IBV_WC_SUCCESS)
    throw TransportError(std::string(transport) + ": " + what + " " + std::to_string(id) +
                         " failed: " + verbs::ibv().wc_status_str(wc.status) + " (vendor error " +
                         std::to_string(wc.vendor_err) + ")");
}

// A receive completion must be a successful RDMA write with immediate.
inline void check_imm_receive(const ibv_wc& wc, const char* transport, const char* from, int id) {
  if (wc.status != IBV_WC_SUCCESS)
    throw TransportError(std::string(transport) + ": a receive " + from + " " + std::to_string(id) +
                         " failed: " + verbs::ibv().wc_status_str(wc.status));
  if (wc.opcode != IBV_WC_RECV_RDMA_WITH_IMM || !(wc.wc_flags & IBV_WC_WITH_IMM))
    throw TransportError(std::string(transport) + ": unexpected receive completion " + from + " " + std::to_string(id));
}

inline void check_range(const Region& local, const RemoteRegions& remote, int region, int peer, uint64_t local_off,
                        uint64_t remote_off, uint64_t bytes) {
  if (local_off + bytes > local.bytes || remote_off + bytes > remote.bytes[region])
    throw TransportError("verbs: range [" + std::to_string(remote_off) + ", +" + std::to_string(bytes) +
                         ") is outside the registered region of rank " + std::to_string(peer) + " (or [" +
                         std::to_string(local_off) + ", +" + std::to_string(bytes) + ") outside this rank's)");
}

}  // namespace portep::verbs
