// The GPU runtime API for portep's host entry points (kernel launches, allocations, error codes): CUDA's runtime
// under nvcc, HIP's under hipcc, behind CUDA's names. Sources include this instead of <cuda_runtime.h>; device
// code takes everything vendor-specific from portability.cuh. Only the names portep uses are mapped.
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

#else

#include <cuda_runtime.h>

#endif

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

}  // namespace portep::cuda
