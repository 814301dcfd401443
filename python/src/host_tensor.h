// CPU torch tensors as the host backend's native operations take them. This module does not link libtorch, so a
// tensor is read through its Python attributes: where its bytes are and how many, after checking that it is a
// contiguous CPU tensor of the expected dtype. Python passes tensors, never addresses; the operations check every
// row they touch against the tensor's size (row_kernels.h).
#pragma once

#include <pybind11/pybind11.h>
#include <stdint.h>

#include <string>

#include "gpu_kernels/host/row_kernels.h"

namespace portep::bind {

namespace py = pybind11;

struct HostTensor {
  ByteSpan span{nullptr, 0};
  int64_t numel = 0;
  bool present = false;  // false for None
  template <class T>
  T* as() const {
    return reinterpret_cast<T*>(span.data);
  }
};

// `t` (None allowed where `optional`) as a contiguous CPU tensor of torch.<dtype> (dtype null: any); `name` in errors.
inline HostTensor host_tensor(const py::handle& t, const char* name, const char* dtype, bool optional = false) {
  HostTensor h;
  if (t.is_none()) {
    if (optional) return h;
    throw py::value_error(std::string(name) + ": a tensor is needed, got None");
  }
  const std::string device = py::str(t.attr("device").attr("type"));
  if (device != "cpu") throw py::value_error(std::string(name) + ": a CPU tensor is needed, got one on " + device);
  if (!t.attr("is_contiguous")().cast<bool>()) throw py::value_error(std::string(name) + ": must be contiguous");
  const std::string dt = py::str(t.attr("dtype"));
  if (dtype && dt != std::string("torch.") + dtype)
    throw py::value_error(std::string(name) + ": dtype " + dt + ", expected torch." + dtype);
  h.numel = t.attr("numel")().cast<int64_t>();
  h.span = ByteSpan{reinterpret_cast<uint8_t*>(t.attr("data_ptr")().cast<uintptr_t>()),
                    h.numel * t.attr("element_size")().cast<int64_t>()};
  h.present = true;
  return h;
}

// An index or value array of at least n entries (`name` in errors).
inline void check_entries(const HostTensor& h, int64_t n, const char* name) {
  if (h.present && h.numel < n)
    throw py::value_error(std::string(name) + ": " + std::to_string(h.numel) + " entries, " + std::to_string(n) +
                          " needed");
}

}  // namespace portep::bind
