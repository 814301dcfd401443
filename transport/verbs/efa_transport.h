// The EFA transport: AWS EFA's Scalable Reliable Datagram (SRD) queue pairs through efadv, chosen at run time
// when the device that `verbs` / `verbs-striped` opens is an EFA device.
//
// SRD is reliable but unordered and has no remote atomics, so the transport reports ordered = false and
// remote_atomics = false: the proxies tag writes with immediates and emulate signals (docs/design.md §5), as they do
// over striped RC. One SRD QP per proxy channel reaches every peer through an address handle; a peer's
// immediates land on the receiver's QP of the same channel, and the receive completion's (AH number, source
// QP) names the sender. Writes and write-with-immediate go through the ibv_wr_* API with pre-posted receives
// (no unsolicited-write-receive: the efadv.h this is built against may predate it). RDMA write on EFA needs a
// device and an rdma-core whose efadv reports EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE; without it construction fails
// with that reason.
#pragma once

#include <infiniband/verbs.h>

#include <memory>
#include <string>

#include "transport/verbs/verbs_transport.h"

namespace portep {

// True when ctx is an EFA device (efadv answers for it). False in builds without efadv or where libefa is missing.
bool is_efa_device(ibv_context* ctx);

// The library EFA needs at run time: "<name>: <path>" when loaded, else "<name>: not loadable: <why>" (or why this
// build has no EFA transport).
std::string efa_library_status();

// The SRD transport on ctx (owned from here on, closed on destruction or failure). Throws TransportError.
std::unique_ptr<Transport> make_efa_transport(const VerbsOptions& o, ibv_context* ctx, int port,
                                              const std::string& dev_name);

}  // namespace portep
