// The GPU runtime API for portep's host entry points (kernel launches, allocations, error codes): CUDA's runtime
// under nvcc, HIP's under hipcc, behind CUDA's names. The kernel sources include this instead of <cuda_runtime.h>
// (only they: launch_kernel launches with <<<>>>); device code takes everything vendor-specific from
// portability.cuh. Only the names portep uses are mapped.
#pragma once

#if defined(__HIPCC__)

#include <hip/hip_runtime.h>

#define cudaError_t hipError_t
#define cudaSuccess hipSuccess
#define cudaErrorInvalidValue hipErrorInvalidValue
#define cudaErrorTimeout hipErrorLaunchTimeOut
#define cudaGetLastError hipGetLastError
#define cudaGetErrorString hipGetErrorString
#define cudaGetDeviceCount hipGetDeviceCount
#define cudaDeviceSynchronize hipDeviceSynchronize
#define cudaStream_t hipStream_t
#define cudaStreamCreateWithFlags hipStreamCreateWithFlags
#define cudaStreamNonBlocking hipStreamNonBlocking
#define cudaFuncAttributes hipFuncAttributes
#define cudaFuncGetAttributes hipFuncGetAttributes
#define cudaFuncSetAttribute hipFuncSetAttribute
#define cudaFuncAttributeMaxDynamicSharedMemorySize hipFuncAttributeMaxDynamicSharedMemorySize
#define cudaMalloc hipMalloc
#define cudaFree hipFree
#define cudaMemset hipMemset
#define cudaMemsetAsync hipMemsetAsync
#define cudaMemcpy hipMemcpy
#define cudaMemcpyHostToDevice hipMemcpyHostToDevice
#define cudaMemcpyDeviceToHost hipMemcpyDeviceToHost
#define cudaMemcpyDefault hipMemcpyDefault
#define cudaHostAlloc hipHostMalloc
#define cudaHostAllocMapped hipHostMallocMapped
#define cudaHostAllocPortable hipHostMallocPortable
#define cudaHostGetDevicePointer hipHostGetDevicePointer
#define cudaFreeHost hipHostFree
#define cudaErrorNotSupported hipErrorNotSupported
#define cudaStreamIsCapturing hipStreamIsCapturing
#define cudaStreamCaptureStatus hipStreamCaptureStatus
#define cudaStreamCaptureStatusNone hipStreamCaptureStatusNone

#else

#include <cuda.h>  // the driver's types only: its entry point is looked up at run time, nothing links libcuda
#include <cuda_runtime.h>

#endif

#include <atomic>
#include <type_traits>

// Defined while a source is compiled for the GPU (nvcc's and hipcc's device passes), not in the host pass.
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
#define PORTEP_DEVICE_PASS 1
#endif

namespace portep::cuda {

// Loads the module of `kernel` now (CUDA loads modules lazily, at a kernel's first launch otherwise).
template <class Kernel>
inline cudaError_t load_kernel(Kernel* kernel) {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(kernel));
}

// Lets `kernel` launch with up to `bytes` of dynamic shared memory.
template <class Kernel>
inline cudaError_t allow_dynamic_smem(Kernel* kernel, int bytes) {
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), cudaFuncAttributeMaxDynamicSharedMemorySize,
                              bytes);
}

// launch_kernel<K>(grid, block, smem, stream, args...): K<<<grid, block, smem, stream>>>(args...), returning the
// launch's error. On CUDA it launches through the driver's cuLaunchKernel with K's function handle cached per
// device: the runtime's launch finds the kernel's handle again on every call, which cost 0.5 to 1 us of host time
// per launch on the H200 machine measured (docs/design.md §6, "The hot path"), a large part of a low-latency call's
// budget. A driver launch that fails (no handle, another context current, the driver entry point missing) is done
// again through the runtime, which then reports the error as it always did; nothing was queued by the failed one.
// HIP launches through its runtime.

#if !defined(__HIPCC__)

namespace launch_detail {

using DriverLaunch = CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                  CUstream, void**, void**);
constexpr int kMaxDevices = 64;  // devices past it launch through the runtime

inline DriverLaunch driver_launch() {
  static const DriverLaunch fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuLaunchKernel", &p, 12000, cudaEnableDefault, &found);
#else
    const cudaError_t e = cudaGetDriverEntryPoint("cuLaunchKernel", &p, cudaEnableDefault, &found);
#endif
    if (e != cudaSuccess || found != cudaDriverEntryPointSuccess) {
      if (e != cudaSuccess) (void)cudaGetLastError();  // this lookup's own error: the runtime launch then serves
      p = nullptr;
    }
    return reinterpret_cast<DriverLaunch>(p);
  }();
  return fn;
}

template <auto K>
std::atomic<CUfunction>& handle_slot(int device) {      // K's handle on each device, null until looked up
  static std::atomic<CUfunction> handles[kMaxDevices];  // zero-initialised; racing writers store the same handle
  return handles[device];
}

// K's handle in the current device's primary context, or null (then the runtime launches).
template <auto K>
CUfunction function_of(int device) {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  CUfunction f = handle_slot<K>(device).load(std::memory_order_acquire);
  if (f) return f;
  cudaFunction_t g = nullptr;
  if (cudaGetFuncBySymbol(&g, reinterpret_cast<const void*>(K)) != cudaSuccess) {
    (void)cudaGetLastError();  // the runtime launch reports why the kernel cannot run
    return nullptr;
  }
  f = reinterpret_cast<CUfunction>(g);
  handle_slot<K>(device).store(f, std::memory_order_release);
  return f;
}

// Launched K through the driver (false: nothing was queued, the runtime launches).
template <auto K, class... Params>
bool driver_launched(dim3 grid, dim3 block, size_t smem, cudaStream_t stream, const Params&... args) {
  int device = -1;
  const DriverLaunch launch = driver_launch();
  if (!launch || cudaGetDevice(&device) != cudaSuccess) return false;
  CUfunction f = function_of<K>(device);
  if (!f) return false;
  void* params[] = {const_cast<Params*>(&args)..., nullptr};
  if (launch(f, grid.x, grid.y, grid.z, block.x, block.y, block.z, unsigned(smem), reinterpret_cast<CUstream>(stream),
             params, nullptr) == CUDA_SUCCESS)
    return true;
  handle_slot<K>(device).store(nullptr, std::memory_order_relaxed);  // e.g. a reset device: look it up again
  return false;
}

}  // namespace launch_detail

#endif

template <auto K, class... Params>
cudaError_t launch_kernel(dim3 grid, dim3 block, size_t smem, cudaStream_t stream, const Params&... args) {
  static_assert(std::is_same_v<decltype(K), void (*)(Params...)>, "arguments must have the kernel's parameter types");
#if !defined(__HIPCC__)
  if (launch_detail::driver_launched<K>(grid, block, smem, stream, args...)) return cudaSuccess;
#endif
  K<<<grid, block, smem, stream>>>(args...);
  return cudaGetLastError();
}

}  // namespace portep::cuda
