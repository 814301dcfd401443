// Creating a transport by name at run time, and what this build can create.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "transport/transport.h"

namespace portep {

constexpr int kEmulatedDevice = -2;
constexpr int kEmulatedDeviceWithoutRdma = -3;  // emulated GPU memory no NIC can register (verbs only)

struct TransportSpec {
  std::string name = "shm";  // "shm" or "shm-unordered"
  int rank = 0;
  int num_ranks = 1;
  int num_channels = 1;
  uint32_t window = 64;  // unordered delivery window per (channel, peer)
  uint64_t seed = 0;
  // nccl: libnccl files to try (a wheel's), see nccl::open_library.
  std::vector<std::string> nccl_libraries;
  // Debug only: nccl-emulated trusts a record on sight (proves the tests can fail).
  bool skip_ordering = false;
  // >= 0: the data region is memory of this GPU (shm: CUDA IPC, copy-engine copies; nccl: ncclMemAlloc);
  // kEmulatedDevice: host memory behind the same GPU path (copies on worker threads);
  // kEmulatedDeviceWithoutRdma: the same, but memory a NIC cannot register (verbs' staging).
  int device = -1;
};

std::unique_ptr<Transport> make_transport(const TransportSpec& spec);

struct TransportInfo {
  std::string name;
  bool built;
  bool ordered;  // what the transport guarantees on every device (by_device: on most; props() says)
  bool remote_atomics;
  std::string reason;      // why not built / not usable
  bool usable = true;      // built, and what it needs at run time loads here (libibverbs)
  bool by_device = false;  // ordered / remote_atomics are the device's: a Channel's props() say what holds
  std::string note{};      // how the device decides
};
std::vector<TransportInfo> transport_catalog();

}  // namespace portep
