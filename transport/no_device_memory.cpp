// Builds without a GPU runtime (neither CUDA nor HIP): channels on a GPU are not available, and say why.
#include "transport/device_memory.h"

namespace portep {

std::unique_ptr<DeviceMemory> make_gpu_device_memory(int, int, std::string* why) {
  if (why) *why = "this build has no GPU runtime (neither nvcc nor ROCm was found when portep was built)";
  return nullptr;
}

}  // namespace portep
