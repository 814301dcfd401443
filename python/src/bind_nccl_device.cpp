// The NCCL device path (gpu_kernels/nccl/nccl_lsa.h) as portep._C.NcclLsa (GPU builds). It owns the communicator,
// the window and the device communicator; Python passes tensors and gets the window back as a lease.
#ifdef PORTEP_WITH_GPU
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "gpu_kernels/nccl/nccl_lsa.h"
#include "python/src/region_lease.h"
#include "python/src/tensor_arg.h"

namespace py = pybind11;
using portep::bind::GpuTensors;
using portep::cuda::NcclLsa;

namespace {

// A Python NcclLsa: the native one until close(); a lease of its window keeps all of it (window, communicator) until
// the lease goes too.
class PyNcclLsa {
 public:
  explicit PyNcclLsa(const portep::cuda::NcclLsaSetup& s) : lsa_(NcclLsa::create(s)) {}

  NcclLsa& get(const char* what) const {
    if (!lsa_) throw std::runtime_error(std::string("NcclLsa.") + what + ": closed");
    return *lsa_;
  }
  portep::bind::RegionLease region_lease() const {
    NcclLsa& l = get("region_lease");
    return {lsa_, static_cast<uint8_t*>(l.region()), size_t(l.bytes()), true};
  }
  void close() { lsa_.reset(); }

 private:
  std::shared_ptr<NcclLsa> lsa_;
};

}  // namespace

void bind_nccl_device(py::module_& m) {
  py::class_<PyNcclLsa>(m, "NcclLsa", "the NCCL device path of one rank (gpu_kernels/nccl/nccl_lsa.h)")
      .def(py::init([](int rank, int num_ranks, int device, uint64_t nbytes, py::bytes unique_id, double timeout_s,
                       std::vector<std::string> candidates, bool gin) {
             portep::cuda::NcclLsaSetup s;
             s.rank = rank;
             s.num_ranks = num_ranks;
             s.device = device;
             s.bytes = nbytes;
             s.unique_id = unique_id;
             s.timeout_s = timeout_s;
             s.library_candidates = std::move(candidates);
             s.gin = gin;
             py::gil_scoped_release unlocked;  // collective: the ranks' other threads go on meanwhile
             return std::make_unique<PyNcclLsa>(s);
           }),
           py::arg("rank"), py::arg("num_ranks"), py::arg("device"), py::arg("nbytes"), py::arg("unique_id"),
           py::arg("timeout_s"), py::arg("candidates"), py::arg("gin") = false,
           "collective over the ranks of unique_id (nccl_unique_id on one rank): communicator, window of nbytes "
           "(a multiple of 16) and device communicator (with a GIN context and signal where gin), each step within "
           "timeout_s")
      .def("region_lease", &PyNcclLsa::region_lease, "the window (uint8 [nbytes] on the GPU) as a lease for torch")
      .def_property_readonly("num_ranks", [](const PyNcclLsa& p) { return p.get("num_ranks").num_ranks(); })
      .def_property_readonly("lsa_rank", [](const PyNcclLsa& p) { return p.get("lsa_rank").lsa_rank(); })
      .def_property_readonly("lsa_size", [](const PyNcclLsa& p) { return p.get("lsa_size").lsa_size(); })
      .def(
          "lsa_peers", [](const PyNcclLsa& p) { return p.get("lsa_peers").lsa_peers(); },
          "the ranks whose windows this rank's kernels reach by stores (itself included)")
      .def(
          "peer_table",
          [](const PyNcclLsa& p, py::handle table) {
            NcclLsa& l = p.get("peer_table");
            GpuTensors t("NcclLsa.peer_table");
            l.peer_table(
                t.entries<uint64_t>(table, "table", "int64", l.num_ranks(), portep::bind::Entries::kExactly, false));
          },
          py::arg("table"),
          "table (int64 [num_ranks] on the GPU) gets each rank's window as kernels here reach it, 0 else")
      .def(
          "put",
          [](const PyNcclLsa& p, int peer, uint64_t offset, py::handle src, uintptr_t stream) {
            NcclLsa& l = p.get("put");
            GpuTensors t("NcclLsa.put");
            const int64_t n = src.attr("numel")().cast<int64_t>() * src.attr("element_size")().cast<int64_t>();
            l.put(peer, offset, t.bytes<const void>(src, "src", n, false), uint64_t(n),
                  reinterpret_cast<void*>(stream));
          },
          py::arg("peer"), py::arg("offset"), py::arg("src"), py::arg("stream"),
          "a kernel on stream stores src's bytes into peer's window from offset (both multiples of 16)")
      .def(
          "barrier",
          [](const PyNcclLsa& p, uintptr_t stream) { p.get("barrier").barrier(reinterpret_cast<void*>(stream)); },
          py::arg("stream"), "NCCL's LSA barrier on stream")
      .def(
          "gin_put",
          [](const PyNcclLsa& p, int peer, uint64_t offset, uint64_t src_offset, uint64_t nbytes, uintptr_t stream) {
            p.get("gin_put").gin_put(peer, offset, src_offset, nbytes, reinterpret_cast<void*>(stream));
          },
          py::arg("peer"), py::arg("offset"), py::arg("src_offset"), py::arg("nbytes"), py::arg("stream"),
          "GIN: a kernel on stream puts nbytes of this window from src_offset into peer's window at offset, then "
          "signals peer")
      .def(
          "gin_wait",
          [](const PyNcclLsa& p, uint64_t count, uintptr_t stream) {
            p.get("gin_wait").gin_wait(count, reinterpret_cast<void*>(stream));
          },
          py::arg("count"), py::arg("stream"), "GIN: a kernel on stream waits for count signals to this rank")
      .def("close", &PyNcclLsa::close,
           "no further use; the communicator and the window are freed once no lease of the window is held either");
}
#endif
