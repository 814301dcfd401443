// MappedHost (python/src/mapped_host.h) and what reads or wires its words: the kernels' error records, the peer
// watch's status mirror. Built with the GPU kernels only.
#ifdef PORTEP_WITH_GPU
#include <pybind11/pybind11.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "gpu_kernels/cuda/api.h"
#include "gpu_kernels/cuda/kernel_errors.h"
#include "gpu_kernels/cuda/ll_api.h"
#include "proxy/channel.h"
#include "python/src/bind_util.h"
#include "python/src/mapped_host.h"

namespace py = pybind11;

namespace portep::bind {

MappedHost::MappedHost(uint64_t bytes, bool emulated) : bytes_(bytes), emulated_(emulated) {
  if (bytes == 0) throw std::invalid_argument("MappedHost: bytes must be positive");
  if (emulated) {
    host_ = device_ = std::calloc(1, bytes);
    if (!host_) throw std::bad_alloc();
    return;
  }
  check(portep::cuda::host_alloc_mapped(&host_, &device_, bytes), "cudaHostAlloc (mapped host words)");
}

MappedHost::~MappedHost() {
  try {
    close();
  } catch (...) {  // a destructor reports nothing: close() explicitly to see a failure
  }
}

void MappedHost::close() {
  void* h = host_;
  host_ = device_ = nullptr;
  if (!h) return;
  if (emulated_) {
    std::free(h);
    return;
  }
  check(portep::cuda::host_free_mapped(h), "cudaFreeHost (mapped host words)");
}

void MappedHost::zero() {
  if (host_) std::memset(host_, 0, bytes_);
}

void* MappedHost::host(uint64_t need, const char* what) const {
  if (!host_) throw py::value_error(std::string(what) + ": the mapped host memory was closed");
  if (bytes_ < need)
    throw py::value_error(std::string(what) + ": " + std::to_string(bytes_) + " bytes of mapped host memory, " +
                          std::to_string(need) + " needed");
  return host_;
}

void* MappedHost::device(uint64_t need, const char* what) const {
  host(need, what);
  return device_;
}

}  // namespace portep::bind

using portep::bind::MappedHost;
using portep::cuda::KernelError;
using portep::cuda::kNumErrorWords;

void bind_mapped_host(py::module_& m) {
  py::class_<MappedHost>(m, "MappedHost",
                         "pinned host memory mapped into the GPU's address space, zeroed (python/src/mapped_host.h)")
      .def(py::init<uint64_t, bool>(), py::arg("bytes"), py::arg("emulated") = false)
      .def_property_readonly("nbytes", &MappedHost::bytes)
      .def_property_readonly("closed", &MappedHost::closed)
      .def("close", &MappedHost::close)
      .def("zero", &MappedHost::zero)
      .def(
          "store_u32",
          [](MappedHost& h, uint64_t index, uint32_t value) {
            auto* w = static_cast<uint32_t*>(h.host(4 * (index + 1), "store_u32"));
            __atomic_store_n(w + index, value, __ATOMIC_RELEASE);
          },
          py::arg("index"), py::arg("value"), "stores 32-bit word `index` (release)")
      .def(
          "load_u32",
          [](const MappedHost& h, uint64_t index) {
            const auto* w = static_cast<const uint32_t*>(h.host(4 * (index + 1), "load_u32"));
            return __atomic_load_n(w + index, __ATOMIC_ACQUIRE);
          },
          py::arg("index"), "32-bit word `index` (acquire)");
  m.def(
      "kernel_error_record",
      [](const MappedHost& records, uint32_t word) -> py::tuple {
        if (word >= kNumErrorWords)
          throw std::out_of_range("kernel_error_record: word " + std::to_string(word) + " is not 0 or 1");
        const auto* e =
            static_cast<const KernelError*>(records.host(sizeof(KernelError) * kNumErrorWords, "records")) + word;
        // The code is published last with a system-scope release store (kernel_errors.cuh): read it with acquire,
        // and the fields only after it, else a record read while a kernel fills it names fields not yet written.
        const uint32_t code = __atomic_load_n(&e->code, __ATOMIC_ACQUIRE);
        if (!code) return py::make_tuple(0u, 0u, 0u, 0u, int64_t{0});
        return py::make_tuple(code, e->rank, e->src, e->index, e->value);
      },
      py::arg("records"), py::arg("word"),
      "(code, rank, src, index, value) of the mapped record `word` (0: failures, 1: notices); code 0: none");
  m.def(
      "cuda_mirror_peer_status",
      [](portep::Channel& channel, MappedHost* words) {
        portep::PeerWatch* w = channel.proxies().peer_watch();
        if (!w) throw std::logic_error("cuda_mirror_peer_status: this Channel has no status streams");
        w->mirror_to(words
                         ? static_cast<uint32_t*>(words->host(4 * uint64_t(channel.options().proxy.num_ranks), "words"))
                         : nullptr);
      },
      py::arg("channel"), py::arg("words"), py::keep_alive<1, 2>(),
      "the peer watch writes each peer's status into words ([num_ranks] uint32 mapped host memory; None: stops)");
}
#endif
