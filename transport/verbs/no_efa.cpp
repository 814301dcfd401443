// Builds with libibverbs but without efadv (libefa): no device is taken for EFA, so `verbs` runs RC everywhere.
#include "transport/verbs/efa_transport.h"
#include "transport/verbs/verbs_library.h"

namespace portep {

bool is_efa_device(ibv_context*) { return false; }

std::string efa_library_status() { return "libefa: not used (this build has no efadv.h, so no EFA transport)"; }

std::unique_ptr<Transport> make_efa_transport(const VerbsOptions&, ibv_context* ctx, int, const std::string& dev_name) {
  verbs::ibv().close_device(ctx);
  throw TransportError("efa: this build has no efadv (libefa); rebuild with rdma-core's libefa to use " + dev_name);
}

}  // namespace portep
