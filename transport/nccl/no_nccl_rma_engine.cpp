// Builds without the CUDA runtime: the nccl transport's engine on NCCL is not there (nccl-emulated is).
#include "transport/nccl/nccl_rma_engine.h"

namespace portep {

bool nccl_rma_built() { return false; }

std::unique_ptr<RmaEngine> make_nccl_rma_engine(int, int, int, const std::vector<std::string>&, std::string* why) {
  *why =
      "this build of portep has no CUDA runtime (NCCL's one-sided API moves CUDA memory); nccl-emulated runs the "
      "transport's protocol over shared memory";
  return nullptr;
}

}  // namespace portep
