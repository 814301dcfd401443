// What this build contains and what the CUDA runtime reports, for `python -m portep.doctor`.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "transport/nccl/nccl_library.h"
#include "transport/verbs/verbs_transport.h"
#include "transport/transport_factory.h"

#ifdef PORTEP_WITH_GPU
#include "gpu_kernels/cuda/api.h"
#include "gpu_kernels/nccl/nccl_lsa.h"
#endif

namespace py = pybind11;

void bind_build_info(py::module_& m) {
  m.def("build_info", [] {
    py::dict d;
    d["version"] = PORTEP_VERSION;
    d["compiler"] = __VERSION__;
    // The GPU kernels (the 'cuda' backend, which follows torch.cuda: CUDA, or HIP on a ROCm torch) and the runtime
    // they were built for; cuda_built / hip_built say which, each reason says why not.
    const std::string runtime = PORTEP_GPU_RUNTIME_NAME;
    const std::string reason = PORTEP_GPU_REASON;
    d["gpu_built"] = !runtime.empty();
    d["gpu_runtime"] = runtime;
    d["gpu_archs"] = std::string(PORTEP_GPU_ARCHS);
    d["gpu_reason"] = runtime.empty() ? reason : std::string();
    d["cuda_built"] = runtime == "cuda";
    d["cuda_reason"] = runtime == "cuda" ? std::string() : runtime == "hip" ? "built for HIP (ROCm) instead" : reason;
    d["hip_built"] = runtime == "hip";
    d["hip_reason"] = runtime == "hip" ? std::string() : runtime == "cuda" ? "built for CUDA instead" : reason;
    d["hip_version"] = std::string(PORTEP_HIP_VERSION);
    // portep._ll_torch, the LL hot path (python/src/ll_torch_path.cpp): the torch it was built against, or why not
    d["ll_fast_path_torch"] = std::string(PORTEP_TORCH_FAST_PATH_VERSION);
    d["ll_fast_path_reason"] = std::string(PORTEP_TORCH_FAST_PATH_REASON);
    // the NCCL device path (gpu_kernels/nccl/nccl_lsa.h): the NCCL release of the device headers built in, or why none
    std::string nccl_why = "no GPU kernels in this build";
#ifdef PORTEP_WITH_GPU
    const int headers = portep::cuda::nccl_device_headers_version(&nccl_why);
#else
    const int headers = 0;
#endif
    d["nccl_device_headers"] = headers;
    d["nccl_device_reason"] = headers ? std::string() : nccl_why;
    return d;
  });
  m.def("cuda_devices", []() -> py::tuple {
#ifdef PORTEP_WITH_GPU
    int count = 0;
    int err = portep::cuda::cuda_device_count(&count);
    return py::make_tuple(err == 0 ? count : 0,
                          err == 0 ? std::string() : std::string(portep::cuda::cuda_error_string(err)));
#else
    return py::make_tuple(0, std::string("GPU kernels not built: ") + PORTEP_GPU_REASON);
#endif
  });
  m.def(
      "verbs_devices", [] { return portep::verbs_device_summary(); },
      "libibverbs devices and ports, one line each ('none: ...' when there are none)");
  m.def("transport_catalog", [] {
    py::list out;
    for (auto& t : portep::transport_catalog()) {
      py::dict d;
      d["name"] = t.name;
      d["built"] = t.built;
      d["ordered"] = t.by_device ? py::object(py::str("by device")) : py::object(py::bool_(t.ordered));
      d["remote_atomics"] = t.by_device ? py::object(py::str("by device")) : py::object(py::bool_(t.remote_atomics));
      if (!t.note.empty()) d["note"] = t.note;
      if (t.built && !t.usable) d["usable"] = false;
      if (!t.built || !t.usable) d["reason"] = t.reason;
      out.append(d);
    }
    return out;
  });
  m.def(
      "nccl_probe",
      [](const std::vector<std::string>& candidates) {
        const portep::nccl::Probe p = portep::nccl::probe(candidates);
        py::dict d;
        d["loaded"] = p.loaded;
        d["path"] = p.path;
        d["version"] = p.version;
        d["version_text"] = p.version_text();
        d["missing"] = p.missing;
        d["error"] = p.error;
        d["host_rma"] = p.host_rma();
        d["summary"] = p.summary();
        return d;
      },
      py::arg("candidates"),
      "libnccl found at run time ($PORTEP_LIBNCCL, the one already loaded, else the first of candidates that loads, "
      "else libnccl.so.2): its version and whether it has the host one-sided API (NCCL >= 2.29.2)");
  m.def(
      "nccl_unique_id",
      [](const std::vector<std::string>& candidates) {
        std::string id;
        {
          py::gil_scoped_release unlocked;  // (loading NCCL and its bootstrap may take a while)
          id = portep::nccl::unique_id(candidates);
        }
        return py::bytes(id);
      },
      py::arg("candidates"), "a new ncclUniqueId (bytes) from the NCCL library found, as nccl_probe finds it");
  m.def(
      "nccl_device_mismatch",
      [](int version) {
#ifdef PORTEP_WITH_GPU
        return portep::cuda::nccl_device_mismatch(version);
#else
        return std::string("this build has no NCCL device path: no GPU kernels in this build");
#endif
      },
      py::arg("version"),
      "empty where an NCCL library of this version (ncclGetVersion's code) can run this build's NCCL device path, "
      "else why not");
  m.def(
      "nic_libraries", [] { return portep::nic_library_summary(); },
      "the NIC libraries the verbs transports load at run time, one line each, with where they were found or why not");
}
