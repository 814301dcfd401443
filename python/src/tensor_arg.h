// Torch tensors as the native operations take them. This module does not link libtorch, so a tensor is read through
// its Python attributes: where its bytes are and how many, after checking its device, contiguity and dtype. Python
// passes tensors, never addresses. The host backend's operations check every row they touch against the tensor's
// size (row_kernels.h); the GPU kernels' bindings check entry counts (check_entries).
#pragma once

#include <pybind11/pybind11.h>
#include <stdint.h>

#include <cstring>
#include <string>
#include <utility>
#include <vector>

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

// A Python attribute name made once (interned, never freed: bindings read tensors until the process exits).
inline py::handle interned(const char* name) {
  PyObject* s = PyUnicode_InternFromString(name);
  if (!s) throw py::error_already_set();
  return s;
}

// The names of the tensor attributes the bindings read, made once.
struct TensorAttrs {
  py::handle is_cuda, is_cpu, get_device, is_contiguous, dtype, numel, data_ptr, element_size;
};
inline const TensorAttrs& tensor_attrs() {
  static const TensorAttrs names{interned("is_cuda"),       interned("is_cpu"),      interned("get_device"),
                                 interned("is_contiguous"), interned("dtype"),       interned("numel"),
                                 interned("data_ptr"),      interned("element_size")};
  return names;
}

// torch.<name>, a dtype object (torch's dtypes are singletons, so a tensor's dtype is compared by identity), made once
// per name; null where torch has no such attribute (the dtype is then compared by name).
inline PyObject* torch_dtype(const char* name) {
  static std::vector<std::pair<std::string, PyObject*>>* known = new std::vector<std::pair<std::string, PyObject*>>();
  for (const auto& [n, dt] : *known)
    if (n == name) return dt;
  PyObject* dt = nullptr;
  if (PyObject* torch = PyImport_ImportModule("torch")) {
    dt = PyObject_GetAttrString(torch, name);
    Py_DECREF(torch);
  }
  if (!dt) PyErr_Clear();
  known->emplace_back(name, dt);
  return dt;
}

// t is on `device` ("cuda" or "cpu"), at `index` where index >= 0: read from is_cuda / is_cpu and get_device(), which
// make no object (t.device makes a torch.device on every read; this runs for every tensor of every call).
inline bool on_device(const py::handle& t, const char* device, int index) {
  const TensorAttrs& a = tensor_attrs();
  if (!t.attr(std::strcmp(device, "cuda") == 0 ? a.is_cuda : a.is_cpu).cast<bool>()) return false;
  return index < 0 || t.attr(a.get_device)().cast<int>() == index;
}

// `t` (None allowed where `optional`) as a contiguous tensor of torch.<dtype> (dtype null: any) on `device` ("cuda" or
// "cpu"), and where index >= 0 that device's index; `name` in errors.
inline TensorArg tensor_arg(const py::handle& t, const char* name, const char* dtype, const char* device,
                            int index = -1, bool optional = false) {
  const TensorAttrs& a = tensor_attrs();
  TensorArg h;
  if (t.is_none()) {
    if (optional) return h;
    throw py::value_error(std::string(name) + ": a tensor is needed, got None");
  }
  if (!on_device(t, device, index))
    throw py::value_error(std::string(name) + ": a tensor on " + device +
                          (index >= 0 ? ":" + std::to_string(index) : std::string()) + " is needed, got one on " +
                          std::string(py::str(t.attr("device"))));
  if (!t.attr(a.is_contiguous)().cast<bool>()) throw py::value_error(std::string(name) + ": must be contiguous");
  if (dtype) {
    const py::object dt = t.attr(a.dtype);
    PyObject* want = torch_dtype(dtype);
    if (dt.ptr() != want && std::string(py::str(dt)) != std::string("torch.") + dtype)
      throw py::value_error(std::string(name) + ": dtype " + std::string(py::str(dt)) + ", expected torch." + dtype);
  }
  h.numel = t.attr(a.numel)().cast<int64_t>();
  h.span = ByteSpan{reinterpret_cast<uint8_t*>(t.attr(a.data_ptr)().cast<uintptr_t>()),
                    h.numel * t.attr(a.element_size)().cast<int64_t>()};
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
    return checked(arg(t, name, dtype, optional), name, n, want, false).template as<T>();
  }
  // Any dtype, counted in bytes (rows of x, 4-byte scales of float32 or int32).
  template <class T>
  T* bytes(py::handle t, const char* name, int64_t n, bool optional = true) {
    return checked(arg(t, name, nullptr, optional), name, n, Entries::kExactly, true).template as<T>();
  }

 private:
  // t as tensor_arg reads it on device_, which the first tensor given names where it is -1 (any GPU until then)
  TensorArg arg(py::handle t, const char* name, const char* dtype, bool optional) {
    TensorArg h = tensor_arg(t, name, dtype, "cuda", device_, optional);
    if (device_ < 0 && h.present) device_ = t.attr(tensor_attrs().get_device)().cast<int>();
    return h;
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
