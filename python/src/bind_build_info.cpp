// What this build contains and what the CUDA runtime reports, for `python -m portep.doctor`.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "portep/transport_factory.h"

#ifdef PORTEP_WITH_CUDA
#include "../../gpu_kernels/cuda/api.h"
#endif

namespace py = pybind11;

void bind_build_info(py::module_& m) {
  m.def("build_info", [] {
    py::dict d;
    d["version"] = PORTEP_VERSION;
    d["compiler"] = __VERSION__;
#ifdef PORTEP_WITH_CUDA
    d["cuda_built"] = true;
    d["cuda_reason"] = "";
#else
    d["cuda_built"] = false;
    d["cuda_reason"] = PORTEP_CUDA_REASON;
#endif
    return d;
  });
  m.def("cuda_devices", []() -> py::tuple {
#ifdef PORTEP_WITH_CUDA
    int count = 0;
    int err = portep::cuda::cuda_device_count(&count);
    return py::make_tuple(err == 0 ? count : 0, err == 0 ? std::string() : std::string(portep::cuda::cuda_error_string(err)));
#else
    return py::make_tuple(0, std::string("CUDA kernels not built: ") + PORTEP_CUDA_REASON);
#endif
  });
  m.def("transport_catalog", [] {
    py::list out;
    for (auto& t : portep::transport_catalog()) {
      py::dict d;
      d["name"] = t.name;
      d["built"] = t.built;
      d["ordered"] = t.ordered;
      d["remote_atomics"] = t.remote_atomics;
      if (!t.built) d["reason"] = t.reason;
      out.append(d);
    }
    return out;
  });
}
