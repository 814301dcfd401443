// The native module portep._C: thin pybind11 glue over the C++ core. No libtorch: raw memory is exposed as
// memoryviews, so one build serves every torch version (and none).
#include <pybind11/pybind11.h>

namespace py = pybind11;

void bind_channel(py::module_& m);
void bind_build_info(py::module_& m);
void bind_layouts(py::module_& m);
void bind_reduce(py::module_& m);
void bind_lockstep(py::module_& m);
#ifdef PORTEP_WITH_GPU
void bind_mapped_host(py::module_& m);
void bind_cuda_ll(py::module_& m);
void bind_cuda_ht(py::module_& m);
void bind_nccl_device(py::module_& m);
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "portep native core";
  bind_channel(m);
  bind_build_info(m);
  bind_layouts(m);
  bind_reduce(m);
  bind_lockstep(m);
#ifdef PORTEP_WITH_GPU
  bind_mapped_host(m);
  bind_cuda_ll(m);
  bind_cuda_ht(m);
  bind_nccl_device(m);
#endif
}
