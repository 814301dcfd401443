// The verbs transport: libibverbs RC queue pairs (ConnectX, Broadcom bnxt_re, irdma, soft-RoCE, ...).
//
// Per (proxy channel, peer) `qps_per_peer` RC QPs, connected through the bootstrap exchange. Writes are RDMA
// WRITE (with immediate when asked; receives are pre-posted and re-posted as they are consumed); signals are
// native fetch-and-add when the device reports atomics, else the proxy emulates them with immediates.
// One QP per peer keeps RC's order (props().ordered); several QPs ("striping") spread a stream over them, which
// delivers out of order like EFA SRD, so the transport then reports ordered = false and no atomics, and the
// proxies use the ordering protocols. On an EFA device both names build the EFA SRD transport instead
// (efa_transport.h).
//
// Knobs (environment, read at construction): PORTEP_IB_HCA (NCCL_IB_HCA syntax: "mlx5_0:1,mlx5_1", "^mlx5_2"
// excludes, "=" prefix for exact names), PORTEP_IB_GID_INDEX (default 0; when unset and GID 0 is unusable, the
// port's best usable GID, RoCE v2 first), PORTEP_IB_SL, PORTEP_IB_TC, PORTEP_IB_QPS_PER_PEER (striping;
// "verbs-striped" defaults to 4), PORTEP_IB_MAX_SEND_WR (in-flight operations per QP, default 256),
// PORTEP_IB_MAX_INFLIGHT_BYTES / PORTEP_IB_MAX_INFLIGHT_MSGS (per-QP caps on bytes and work requests in flight;
// defaults from the device: Broadcom 1.5 MiB and 4, else unlimited bytes and PORTEP_IB_MAX_SEND_WR; a message
// larger than the byte cap goes alone), PORTEP_IB_RETRY_CNT / PORTEP_IB_TIMEOUT (RC retries, default 7, and ACK
// timeout exponent, default 14, as NCCL_IB_RETRY_CNT / NCCL_IB_TIMEOUT), PORTEP_IB_GPUDIRECT (0: stage GPU data in host
// memory).
//
// GPU memory (VerbsOptions::device): see that field and gpu_data_region.h (dma-buf, then peer memory, then host
// staging). PORTEP_IB_GPUDIRECT=0 skips the first two.
#pragma once

#include <stdint.h>

#include <memory>
#include <string>
#include <vector>

#include "transport/device_memory.h"
#include "transport/transport.h"

namespace portep {

struct VerbsOptions {
  int rank = 0;
  int num_ranks = 1;
  int num_channels = 1;
  int qps_per_peer = 1;
  std::string hca;  // NCCL_IB_HCA syntax; empty: the first active port of the first device
  int gid_index = 0;
  bool gid_index_explicit = false;  // PORTEP_IB_GID_INDEX was set: an unusable index is an error, no fallback
  int service_level = 0;
  int traffic_class = 0;
  uint32_t max_send_wr = 256;
  uint64_t max_inflight_bytes = 0;  // per QP (RC transport); 0: chosen from the device
  uint32_t max_inflight_msgs = 0;   // per QP (RC transport); 0: chosen from the device
  int retry_cnt = 7;                // RC transport retries before IBV_WC_RETRY_EXC_ERR (PORTEP_IB_RETRY_CNT, 0..7)
  int ack_timeout = 14;             // RC local ACK timeout, 4.096 us * 2^value (PORTEP_IB_TIMEOUT, 1..31)
  uint32_t recv_depth = 512;        // receives kept posted per QP (write-with-immediate notifications)
  // The GPU whose kernels use the data region (null: a host-memory data region). Registered with
  // ibv_reg_dmabuf_mr on the GPU's dma-buf, else with ibv_reg_mr on the GPU pointer (nvidia-peermem / amdgpu
  // peer memory), else staged in pinned host memory mapped for kernels (gpu_data_region.h). The signal region
  // stays in host memory, mapped for kernels; signals then go through immediates so the receiving proxy can
  // flush the NIC's writes into GPU memory before it publishes them.
  std::shared_ptr<DeviceMemory> device;
  bool gpudirect = true;  // false: host staging without trying GPU memory (PORTEP_IB_GPUDIRECT=0)
};

// Options from the environment knobs above, for transport name "verbs" or "verbs-striped".
VerbsOptions verbs_options_from_env(const std::string& name, int rank, int num_ranks, int num_channels);

// The transport, or nullptr with *why set (built without libibverbs, no RDMA device, no active port, ...).
std::unique_ptr<Transport> make_verbs_transport(const VerbsOptions& o, std::string* why);

// Whether this build has the verbs transports (else *why says what was missing at build time).
bool verbs_built(std::string* why);

// Whether libibverbs loads on this machine (else *why names the library and says why); false where not built.
bool verbs_loadable(std::string* why);

// The NIC libraries the verbs transports load at run time, one line each ("libibverbs.so.1: /path" or
// "libibverbs.so.1: not loadable: ..."), for the doctor.
std::vector<std::string> nic_library_summary();

// What the devices here look like, one line each ("none: <why>" when there are none), for the doctor.
std::vector<std::string> verbs_device_summary();

}  // namespace portep
