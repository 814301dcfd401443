// The nccl transport's engine on NCCL itself (NCCL >= 2.29.2, one GPU per rank; several ranks on one GPU need
// NCCL >= 2.30.3): windows from ncclMemAlloc registered collectively with NCCL_WIN_COLL_SYMMETRIC, a lane is a CUDA
// stream per peer carrying ncclPutSignal, an armed receive is ncclWaitSignal then a copy of the inbox to pinned
// host memory on a stream per source. NCCL is looked up at run time (transport/nccl/nccl_library.h), never linked.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "transport/nccl/rma_engine.h"

namespace portep {

// nullptr with *why set where this build or machine cannot have it (no CUDA runtime in the build, no GPU, no NCCL
// library, an NCCL without the one-sided API).
std::unique_ptr<RmaEngine> make_nccl_rma_engine(int rank, int num_ranks, int device,
                                                const std::vector<std::string>& library_candidates, std::string* why);

// Whether this build has the engine (a CUDA runtime).
bool nccl_rma_built();

}  // namespace portep
