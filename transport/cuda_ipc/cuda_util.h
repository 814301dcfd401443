// CUDA runtime helpers of the transports that use it: a driver function through the runtime's entry-point lookup
// (nothing links libcuda), and a guard that sets the device for one call.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "transport/transport.h"

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

// Sets `device` for one call from any thread and restores the caller's (torch keeps its own); a failure raises
// TransportError naming `who`, unless quiet (teardown: never throws, goes on on whatever device is current).
class CudaDeviceGuard {
 public:
  CudaDeviceGuard(int device, const char* who, bool quiet = false) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ == device) return;
    const cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess && !quiet)
      throw TransportError(std::string(who) + ": cudaSetDevice: " + cudaGetErrorString(e));
  }
  ~CudaDeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace portep
