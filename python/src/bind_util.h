// Helpers shared by the CUDA bindings: raw pointers from Python ints, CUDA errors as Python exceptions.
#pragma once

#include <stdint.h>

#include <stdexcept>
#include <string>

#include "gpu_kernels/cuda/api.h"
#include "gpu_kernels/cuda/ll_api.h"

namespace portep::bind {

inline void check(int err, const char* what) {
  if (err) throw std::runtime_error(std::string(what) + ": " + portep::cuda::cuda_error_string(err));
}

template <class T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

// Device FIFOs for kernels (the LL and HT kernels of one Buffer share one set).
class PyFifoSet {
 public:
  PyFifoSet(int count, uint32_t capacity) {
    check(portep::cuda::alloc_device_fifo_set(count, capacity, &set_), "device FIFOs");
  }
  ~PyFifoSet() { portep::cuda::free_device_fifo_set(&set_); }
  PyFifoSet(const PyFifoSet&) = delete;
  PyFifoSet& operator=(const PyFifoSet&) = delete;
  portep::cuda::DeviceFifoSet set_;
};

}  // namespace portep::bind
