// What the RC transport chooses from the device at run time: the source GID (index) and the per-QP in-flight
// caps, plus the strict parsing of the knobs that override them.
#pragma once

#include <ctype.h>
#include <errno.h>
#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <string>

#include "transport/transport.h"

namespace portep::verbs {

// The decimal value of environment variable `name` in lo..hi, or fallback when it is unset or empty.
inline uint64_t env_strict(const char* name, uint64_t lo, uint64_t hi, uint64_t fallback) {
  const char* v = getenv(name);
  if (!v || !*v) return fallback;
  bool digits = true;
  for (const char* p = v; *p; ++p) digits = digits && isdigit(static_cast<unsigned char>(*p));
  errno = 0;
  const unsigned long long x = digits ? strtoull(v, nullptr, 10) : 0;
  if (!digits || errno == ERANGE || x < lo || x > hi)
    throw TransportError(std::string(name) + "='" + v + "' must be a decimal integer in " + std::to_string(lo) + ".." +
                         std::to_string(hi));
  return x;
}

constexpr uint64_t kUnlimitedBytes = UINT64_MAX;
constexpr uint64_t kMaxInflightBytesKnob = 1ull << 40;
constexpr uint64_t kMaxInflightMsgsKnob = 1u << 16;
// Broadcom (Thor-2, bnxt_re) under incast: a QP with more than ~1.5 MiB in flight can run its transport retry
// counter out (IBV_WC_RETRY_EXC_ERR). The byte cap bounds that exposure; the message cap bounds the work requests
// a go-back-N retransmission replays while still letting small low-latency messages pipeline.
constexpr uint64_t kBroadcomInflightBytes = 1536ull << 10;
constexpr uint32_t kBroadcomInflightMsgs = 4;
constexpr uint32_t kBroadcomVendorId = 0x14e4;

inline bool is_broadcom(const ibv_device_attr& attr, const std::string& dev_name) {
  return attr.vendor_id == kBroadcomVendorId || dev_name.compare(0, 7, "bnxt_re") == 0;
}

struct GidChoice {
  int index = 0;
  ibv_gid gid{};
  std::string how;  // "GID index 1 (RoCE v2, index 0 is unusable: all-zero)" for describe_peer
};

// The GID's type from sysfs ("RoCE v2", "IB/RoCE v1"), or "" where the kernel does not say.
inline std::string gid_type(const std::string& dev, int port, int index) {
  const std::string path =
      "/sys/class/infiniband/" + dev + "/ports/" + std::to_string(port) + "/gid_attrs/types/" + std::to_string(index);
  char buf[64] = {};
  FILE* f = fopen(path.c_str(), "r");
  if (!f) return "";
  if (!fgets(buf, sizeof(buf), f)) buf[0] = 0;
  fclose(f);
  buf[strcspn(buf, "\r\n")] = 0;
  return buf;
}

// Why GID `index` of the port cannot be used, or "" when it can (then *gid holds it).
inline std::string gid_problem(ibv_context* ctx, int port, int index, ibv_gid* gid) {
  if (verbs::ibv().query_gid(ctx, uint8_t(port), index, gid)) return std::string("ibv_query_gid: ") + strerror(errno);
  static const ibv_gid zero{};
  if (memcmp(gid, &zero, sizeof(zero)) == 0) return "all-zero";
  return "";
}

inline bool ipv4_mapped(const ibv_gid& g) {
  static const uint8_t prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return memcmp(g.raw, prefix, sizeof(prefix)) == 0;
}

// The configured index when it is usable; an explicit one that is not is an error. Otherwise the usable GID of the
// port that RoCE v2 and an IPv4-mapped address prefer (lowest index among equals).
inline GidChoice choose_gid(ibv_context* ctx, const std::string& dev, int port, const ibv_port_attr& pa, int configured,
                            bool explicit_index) {
  GidChoice c;
  c.index = configured;
  const std::string problem = gid_problem(ctx, port, configured, &c.gid);
  auto describe = [&](int i, const ibv_gid& g) {
    const std::string type = gid_type(dev, port, i);
    return "GID index " + std::to_string(i) + " (" + (type.empty() ? "type not reported" : type) +
           (ipv4_mapped(g) ? ", IPv4-mapped" : "") + ")";
  };
  if (problem.empty()) {
    c.how = describe(configured, c.gid);
    return c;
  }
  const std::string where = dev + ":" + std::to_string(port);
  if (explicit_index)
    throw TransportError("verbs: PORTEP_IB_GID_INDEX=" + std::to_string(configured) + " is unusable on " + where +
                         " (" + problem + "); unset it to let the transport pick a usable GID");
  const int entries = pa.gid_tbl_len < 256 ? pa.gid_tbl_len : 256;  // sgid_index is 8 bits
  int best = -1, best_score = -1;
  ibv_gid best_gid{};
  for (int i = 0; i < entries; ++i) {
    ibv_gid g{};
    if (i == configured || !gid_problem(ctx, port, i, &g).empty()) continue;
    const int score = 2 * (gid_type(dev, port, i) == "RoCE v2") + ipv4_mapped(g);
    if (score > best_score) best = i, best_score = score, best_gid = g;
  }
  if (best < 0)
    throw TransportError("verbs: " + where + " has no usable GID (index " + std::to_string(configured) + ": " +
                         problem + "; the other " + std::to_string(entries > 0 ? entries - 1 : 0) +
                         " entries are empty or unreadable)");
  c.index = best;
  c.gid = best_gid;
  c.how = describe(best, best_gid) + ", index " + std::to_string(configured) + " is unusable: " + problem;
  return c;
}

}  // namespace portep::verbs
