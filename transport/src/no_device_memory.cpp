// Builds without a CUDA runtime: channels on a GPU are not available, and say why.
#include "portep/device_memory.h"

namespace portep {

std::unique_ptr<DeviceMemory> make_cuda_device_memory(int, int, std::string* why) {
  if (why) *why = "this build has no CUDA runtime (nvcc was not found when portep was built)";
  return nullptr;
}

}  // namespace portep
