// V2 combine's final sum (gpu_kernels/slot_sums.h) over torch tensors: the host loop for CPU tensors, the kernel on
// the caller's stream for GPU tensors.
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "gpu_kernels/host/slot_sums.h"
#include "python/src/tensor_arg.h"
#ifdef PORTEP_WITH_GPU
#include "gpu_kernels/cuda/api.h"
#endif

namespace py = pybind11;

namespace {

// The arguments from the tensors, each on `device` (a torch device type) with index `index` (-1: the CPU).
portep::SlotSumArgs slot_sum_args(py::handle rows, py::handle row_of_slot, py::handle bias0, py::handle bias1,
                                  py::handle out, const char* device, int index) {
  using portep::bind::check_entries;
  using portep::bind::Entries;
  using portep::bind::tensor_arg;
  const auto idx = tensor_arg(row_of_slot, "row_of_slot", "int64", device, index);
  const auto o = tensor_arg(out, "out", "bfloat16", device, index);
  const auto r = tensor_arg(rows, "rows", "bfloat16", device, index);
  const auto b0 = tensor_arg(bias0, "bias0", "bfloat16", device, index, true);
  const auto b1 = tensor_arg(bias1, "bias1", "bfloat16", device, index, true);
  const py::tuple shape = row_of_slot.attr("shape");
  const py::tuple out_shape = out.attr("shape");
  if (shape.size() != 2 || out_shape.size() != 2 || shape[0].cast<int64_t>() != out_shape[0].cast<int64_t>())
    throw py::value_error("slot sums: row_of_slot must be [T, K] and out [T, hidden]; got " +
                          std::string(py::str(shape)) + " and " + std::string(py::str(out_shape)));
  const int64_t T = shape[0].cast<int64_t>(), K = shape[1].cast<int64_t>(), H = out_shape[1].cast<int64_t>();
  if (K < 1 || K > portep::kSlotSumMaxTopk || H < 1)
    throw py::value_error("slot sums: row_of_slot has " + std::to_string(K) + " slots (1 to " +
                          std::to_string(portep::kSlotSumMaxTopk) + " allowed) and out " + std::to_string(H) +
                          " channels (at least 1)");
  const py::tuple row_shape = rows.attr("shape");
  if (row_shape.size() != 2 || row_shape[1].cast<int64_t>() != H)
    throw py::value_error("rows: shape " + std::string(py::str(row_shape)) + ", expected [C, " + std::to_string(H) +
                          "] (out's channels)");
  check_entries(b0, T * H, "bias0", Entries::kExactly);
  check_entries(b1, T * H, "bias1", Entries::kExactly);
  if (b1.present && !b0.present) throw py::value_error("bias1 without bias0");
  return portep::SlotSumArgs{r.as<const uint16_t>(),
                             r.numel / H,
                             idx.as<const int64_t>(),
                             b0.as<const uint16_t>(),
                             b1.as<const uint16_t>(),
                             o.as<uint16_t>(),
                             T,
                             int(K),
                             H};
}

void slot_sums(py::handle rows, py::handle row_of_slot, py::handle bias0, py::handle bias1, py::handle out,
               uintptr_t stream) {
  const py::object dev = out.attr("device");
  if (std::string(py::str(dev.attr("type"))) == "cpu") {
    const auto a = slot_sum_args(rows, row_of_slot, bias0, bias1, out, "cpu", -1);
    try {
      portep::host_slot_sums(a);
    } catch (const std::invalid_argument& e) {
      throw py::value_error(e.what());
    }
    return;
  }
#ifdef PORTEP_WITH_GPU
  const int index = dev.attr("index").is_none() ? 0 : dev.attr("index").cast<int>();
  const auto a = slot_sum_args(rows, row_of_slot, bias0, bias1, out, "cuda", index);
  if (int err = portep::cuda::launch_slot_sums(a, reinterpret_cast<void*>(stream)))
    throw std::runtime_error(std::string("slot sums: ") + portep::cuda::cuda_error_string(err));
#else
  (void)stream;
  throw py::value_error("slot sums: out is on " + std::string(py::str(dev)) + ", and this build has no GPU kernels");
#endif
}

}  // namespace

void bind_reduce(py::module_& m) {
  m.def("slot_sums", &slot_sums, py::arg("rows"), py::arg("row_of_slot"), py::arg("bias0"), py::arg("bias1"),
        py::arg("out"), py::arg("stream") = 0,
        "out [T, hidden] bf16 = fp32(bias0) + fp32(bias1) + each slot's row in slot order (+0.0 where a slot has "
        "none), rounded once (gpu_kernels/slot_sums.h); rows [C, hidden] bf16, row_of_slot [T, K] int64 (-1: none); "
        "on the tensors' device (a GPU: on `stream`, a cudaStream_t, 0 the default stream)");
}
