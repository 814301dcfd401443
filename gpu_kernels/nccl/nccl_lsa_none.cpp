// The NCCL device path where the build has no NCCL device headers (or is a HIP build: RCCL's device API is another):
// every use is refused, saying why (PORTEP_NCCL_DEVICE_REASON, from CMake).
#include <stdexcept>
#include <string>

#include "gpu_kernels/nccl/nccl_lsa.h"

namespace portep::cuda {

int nccl_device_headers_version(std::string* why) {
  if (why) *why = PORTEP_NCCL_DEVICE_REASON;
  return 0;
}

std::string nccl_device_mismatch(int) {
  return std::string("this build has no NCCL device path: ") + PORTEP_NCCL_DEVICE_REASON;
}

std::unique_ptr<NcclLsa> NcclLsa::create(const NcclLsaSetup&) {
  throw std::runtime_error(std::string("NCCL device path: ") + nccl_device_mismatch(0));
}

}  // namespace portep::cuda
