// A CUDA driver function through the runtime's entry-point lookup, so that nothing links libcuda.
#pragma once

#include <cuda_runtime.h>

namespace portep {

// The driver's `name` as of CUDA `version` (e.g. 11070), or nullptr where this driver lacks it (the lookup's error
// is cleared, so that it does not surface later as another call's).
inline void* cuda_driver_entry(const char* name, unsigned version) {
  void* fn = nullptr;
  bool found = false;
#if CUDART_VERSION >= 12050
  cudaDriverEntryPointQueryResult status{};
  found = cudaGetDriverEntryPointByVersion(name, &fn, version, cudaEnableDefault, &status) == cudaSuccess &&
          status == cudaDriverEntryPointSuccess;
#elif CUDART_VERSION >= 12000
  (void)version;
  cudaDriverEntryPointQueryResult status{};
  found = cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault, &status) == cudaSuccess &&
          status == cudaDriverEntryPointSuccess;
#else
  (void)version;
  found = cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault) == cudaSuccess;
#endif
  if (!found || !fn) {
    cudaGetLastError();
    return nullptr;
  }
  return fn;
}

}  // namespace portep
