// Helpers shared by the CUDA bindings: raw pointers from Python ints, CUDA errors as Python exceptions.
#pragma once

#include <stdint.h>

#include <stdexcept>
#include <string>

#include "../../gpu_kernels/cuda/api.h"

namespace portep::bind {

inline void check(int err, const char* what) {
  if (err) throw std::runtime_error(std::string(what) + ": " + portep::cuda::cuda_error_string(err));
}

template <class T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

}  // namespace portep::bind
