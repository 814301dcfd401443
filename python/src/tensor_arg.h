// Torch tensors as the native operations take them. This module does not link libtorch, so a tensor is read through
// its Python attributes: where its bytes are and how many, after checking its device, contiguity and dtype. Python
// passes tensors, never addresses. The host backend's operations check every row they touch against the tensor's
// size (row_kernels.h); the GPU kernels' bindings check entry counts (check_entries).
#pragma once

#include <pybind11/pybind11.h>
#include <stdint.h>

#include <string>

#include "gpu_kernels/host/row_kernels.h"

namespace portep::bind {

namespace py = pybind11;

struct TensorArg {
  ByteSpan span{nullptr, 0};
  int64_t numel = 0;
  bool present = false;  // false for None
  template <class T>
  T* as() const {
    return reinterpret_cast<T*>(span.data);
  }
};

// `t` (None allowed where `optional`) as a contiguous tensor of torch.<dtype> (dtype null: any) on `device`, a
// torch device type, and where index >= 0 that device's index; `name` in errors.
inline TensorArg tensor_arg(const py::handle& t, const char* name, const char* dtype, const char* device,
                            int index = -1, bool optional = false) {
  TensorArg h;
  if (t.is_none()) {
    if (optional) return h;
    throw py::value_error(std::string(name) + ": a tensor is needed, got None");
  }
  const py::object dev = t.attr("device");
  const std::string type = py::str(dev.attr("type"));
  const py::object at = dev.attr("index");
  if (type != device || (index >= 0 && (at.is_none() || at.cast<int>() != index)))
    throw py::value_error(std::string(name) + ": a tensor on " + device +
                          (index >= 0 ? ":" + std::to_string(index) : std::string()) + " is needed, got one on " +
                          std::string(py::str(dev)));
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

// A contiguous CPU tensor (the host backend's operations).
inline TensorArg host_tensor(const py::handle& t, const char* name, const char* dtype, bool optional = false) {
  return tensor_arg(t, name, dtype, "cpu", -1, optional);
}

// An index or value array of at least (kExactly: exactly) n entries (`name` in errors).
enum class Entries { kAtLeast, kExactly };
inline void check_entries(const TensorArg& h, int64_t n, const char* name, Entries want = Entries::kAtLeast) {
  if (h.present && (want == Entries::kExactly ? h.numel != n : h.numel < n))
    throw py::value_error(std::string(name) + ": " + std::to_string(h.numel) + " entries, " +
                          (want == Entries::kExactly ? "exactly " : "") + std::to_string(n) + " needed");
}

// The GPU tensors of one native operation, as the GPU kernels' bindings take them: each checked as tensor_arg checks
// it (on GPU `device`, or where that is -1 on the GPU of the first tensor given) and for its count of entries or
// bytes; errors name the operation and the argument. None is accepted only where `optional`.
class GpuTensors {
 public:
  explicit GpuTensors(const char* op, int device = -1) : op_(op), device_(device) {}

  template <class T>
  T* entries(py::handle t, const char* name, const char* dtype, int64_t n, Entries want = Entries::kExactly,
             bool optional = true) {
    return checked(tensor_arg(t, name, dtype, "cuda", device(t), optional), name, n, want, false).template as<T>();
  }
  // Any dtype, counted in bytes (rows of x, 4-byte scales of float32 or int32).
  template <class T>
  T* bytes(py::handle t, const char* name, int64_t n, bool optional = true) {
    return checked(tensor_arg(t, name, nullptr, "cuda", device(t), optional), name, n, Entries::kExactly, true)
        .template as<T>();
  }

 private:
  int device(py::handle t) {
    if (device_ < 0 && !t.is_none()) {
      const py::object index = t.attr("device").attr("index");
      if (!index.is_none()) device_ = index.cast<int>();
    }
    return device_;  // -1 (any) until the first tensor names it
  }
  TensorArg checked(const TensorArg& h, const char* name, int64_t n, Entries want, bool in_bytes) const {
    const int64_t have = in_bytes ? h.span.bytes : h.numel;
    if (h.present && (want == Entries::kExactly ? have != n : have < n))
      throw py::value_error(std::string(op_) + ": " + name + ": " + std::to_string(have) +
                            (in_bytes ? " bytes, " : " entries, ") +
                            (want == Entries::kExactly ? "exactly " : "at least ") + std::to_string(n) + " needed");
    return h;
  }
  const char* op_;
  int device_;
};

}  // namespace portep::bind
