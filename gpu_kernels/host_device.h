// PORTEP_HOST_DEVICE: a function that host code (g++) and kernels (nvcc, hipcc) both call, defined once in a header.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define PORTEP_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define PORTEP_HOST_DEVICE inline
#endif
