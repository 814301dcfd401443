// A byte range of native memory that keeps that memory alive while Python holds it (torch.frombuffer and
// __cuda_array_interface__ views keep their source object): a view used after its owner closed (Channel.destroy(),
// NcclLsa.close()) reads memory that is still there instead of unmapped pages. bind_channel.cpp registers the class.
#pragma once

#include <pybind11/pybind11.h>
#include <stdint.h>

#include <memory>

namespace portep::bind {

namespace py = pybind11;

struct RegionLease {
  std::shared_ptr<const void> owner;  // whatever frees the memory once the last holder lets go
  uint8_t* data;
  size_t bytes;
  bool device;  // GPU memory: torch views it through __cuda_array_interface__, host memory through the buffer protocol
};

// CUDA's array interface (version 3) of a device lease, so that torch.as_tensor(lease, device=...) views the memory
// and keeps the lease; a host lease has none (AttributeError), so torch takes its buffer protocol instead.
inline py::dict cuda_array_interface(const RegionLease& l) {
  if (!l.device) throw py::attribute_error("__cuda_array_interface__: this lease is host memory");
  py::dict d;
  d["shape"] = py::make_tuple(py::int_(l.bytes));
  d["typestr"] = "|u1";
  d["data"] = py::make_tuple(py::int_(reinterpret_cast<uintptr_t>(l.data)), false);
  d["version"] = 3;
  d["strides"] = py::none();
  return d;
}

}  // namespace portep::bind
