#include "portep/transport_factory.h"

#include "../shm/shm_transport.h"

namespace portep {

std::unique_ptr<Transport> make_transport(const TransportSpec& s) {
  if (s.name == "shm" || s.name == "shm-unordered") {
    ShmOptions o;
    o.rank = s.rank;
    o.num_ranks = s.num_ranks;
    o.num_channels = s.num_channels;
    o.ordered = s.name == "shm";
    o.window = s.window;
    o.seed = s.seed;
    if (s.device == kEmulatedDevice) o.device = make_emulated_device_memory(s.num_channels, s.seed);
    if (s.device >= 0) {
      std::string why;
      o.device = make_cuda_device_memory(s.device, s.num_channels, &why);
      if (!o.device) throw TransportError(s.name + " on GPU " + std::to_string(s.device) + ": " + why);
    }
    return std::make_unique<ShmTransport>(o);
  }
  throw TransportError("unknown transport '" + s.name + "' (this build has: shm, shm-unordered)");
}

std::vector<TransportInfo> transport_catalog() {
  return {
      {"shm", true, true, true, ""},
      {"shm-unordered", true, false, false, ""},
      {"verbs", false, false, false, "not implemented in this version (RC/EFA SRD transport is planned)"},
      {"nccl", false, false, false, "not implemented in this version"},
  };
}

}  // namespace portep
