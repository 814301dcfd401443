#include "transport/transport_factory.h"

#include "transport/nccl/nccl_rma_engine.h"
#include "transport/nccl/nccl_transport.h"
#include "transport/nccl/shm_rma_engine.h"
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
  if (s.name == "nccl-emulated") {
    if (s.device != -1)
      throw TransportError("nccl-emulated: device=" + std::to_string(s.device) +
                           ": the emulation of NCCL's one-sided API keeps its windows in host memory");
    return std::make_unique<NcclTransport>(s.name, s.rank, s.num_ranks, s.num_channels,
                                           std::make_unique<ShmRmaEngine>(s.rank, s.num_ranks, s.seed), nullptr,
                                           s.skip_ordering);
  }
  if (s.name == "nccl") {
    std::string why;
    auto engine = make_nccl_rma_engine(s.rank, s.num_ranks, s.device, s.nccl_libraries, &why);
    if (!engine) throw TransportError("nccl: " + why);
    return std::make_unique<NcclTransport>(s.name, s.rank, s.num_ranks, s.num_channels, std::move(engine),
                                           device_memory_for(s));
  }
  throw TransportError("unknown transport '" + s.name +
                       "' (known: shm, shm-unordered, verbs, verbs-striped, nccl-emulated)");
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
  TransportInfo nccl{"nccl", nccl_rma_built(), true, false, nccl_rma_built() ? "" : "this build has no CUDA runtime"};
  nccl.note = "NCCL's one-sided API (ncclPutSignal, NCCL >= 2.29.2) on GPU memory, found at run time";
  TransportInfo shm{"shm", true, true, true, ""}, shm_unordered{"shm-unordered", true, false, false, ""};
  TransportInfo emulated{"nccl-emulated", true, true, false, ""};
  emulated.note = "the nccl transport's protocol over an emulation of NCCL's one-sided API in shared memory (tests)";
  return {shm, shm_unordered, verbs, striped, nccl, emulated};
}

}  // namespace portep
