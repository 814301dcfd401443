#include "transport/transport_factory.h"

#include "transport/shm/shm_transport.h"
#include "transport/verbs/verbs_transport.h"

namespace portep {

namespace {

// The data region's GPU memory for spec.device (null: host memory).
std::unique_ptr<DeviceMemory> device_memory_for(const TransportSpec& s) {
  if (s.device == kEmulatedDevice || s.device == kEmulatedDeviceWithoutRdma)
    return make_emulated_device_memory(s.num_channels, s.seed, s.device == kEmulatedDevice);
  if (s.device < 0) return nullptr;
  std::string why;
  auto device = make_gpu_device_memory(s.device, s.num_channels, &why);
  if (!device) throw TransportError(s.name + " on GPU " + std::to_string(s.device) + ": " + why);
  return device;
}

}  // namespace

std::unique_ptr<Transport> make_transport(const TransportSpec& s) {
  if (s.name == "shm" || s.name == "shm-unordered") {
    ShmOptions o;
    o.rank = s.rank;
    o.num_ranks = s.num_ranks;
    o.num_channels = s.num_channels;
    o.ordered = s.name == "shm";
    o.window = s.window;
    o.seed = s.seed;
    if (s.device == kEmulatedDeviceWithoutRdma)
      throw TransportError(s.name + ": device=" + std::to_string(s.device) +
                           " (emulated GPU memory no NIC can "
                           "register) is for the verbs transports only");
    o.device = device_memory_for(s);
    return std::make_unique<ShmTransport>(o);
  }
  if (s.name == "verbs" || s.name == "verbs-striped") {
    VerbsOptions o = verbs_options_from_env(s.name, s.rank, s.num_ranks, s.num_channels);
    o.device = device_memory_for(s);
    std::string why;
    auto t = make_verbs_transport(o, &why);
    if (!t) throw TransportError(s.name + ": " + why);
    return t;
  }
  if (s.name == "nccl")
    throw TransportError(
        "nccl: the nccl transport is not implemented in this version (python -m portep.doctor "
        "shows the NCCL library found)");
  throw TransportError("unknown transport '" + s.name + "' (known: shm, shm-unordered, verbs, verbs-striped)");
}

std::vector<TransportInfo> transport_catalog() {
  std::string build_why, load_why;
  const bool built = verbs_built(&build_why);
  const bool loadable = built && verbs_loadable(&load_why);
  TransportInfo verbs{"verbs", built, true, true, built ? load_why : build_why};
  verbs.usable = loadable;
  verbs.by_device = true;
  verbs.note = "RC: ordered, remote atomics where the device has them; an EFA device gives SRD (unordered, no atomics)";
  TransportInfo striped{"verbs-striped", built, false, false, verbs.reason};  // striped RC or SRD: never ordered
  striped.usable = loadable;
  TransportInfo nccl{"nccl", false, false, false, "not implemented in this version"};
  nccl.usable = false;
  TransportInfo shm{"shm", true, true, true, ""}, shm_unordered{"shm-unordered", true, false, false, ""};
  return {shm, shm_unordered, verbs, striped, nccl};
}

}  // namespace portep
