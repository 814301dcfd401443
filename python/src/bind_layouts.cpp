// The buffer layouts both backends share, from their one definition (gpu_kernels/ll_layout.h).
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "gpu_kernels/ll_layout.h"

namespace py = pybind11;
using portep::LLHalfLayout;

void bind_layouts(py::module_& m) {
  m.attr("LL_HIDDEN_STEP") = portep::kLLHiddenStep;
  py::class_<LLHalfLayout>(m, "LLHalfLayout", "one buffer half of the low-latency mode (gpu_kernels/ll_layout.h)")
      .def_readonly("T", &LLHalfLayout::T)
      .def_readonly("H", &LLHalfLayout::H)
      .def_readonly("E", &LLHalfLayout::E)
      .def_readonly("R", &LLHalfLayout::R)
      .def_readonly("E_l", &LLHalfLayout::E_l)
      .def_readonly("M", &LLHalfLayout::M)
      .def_readonly("disp", &LLHalfLayout::disp_bytes)
      .def_readonly("comb", &LLHalfLayout::comb_pitch)
      .def_readonly("send", &LLHalfLayout::send_bytes)
      .def_readonly("recv", &LLHalfLayout::recv_bytes)
      .def_readonly("half", &LLHalfLayout::half_bytes)
      .def("send_off", &LLHalfLayout::send_off, py::arg("half"))
      .def("recv_off", &LLHalfLayout::recv_off, py::arg("half"));
  m.def(
      "ll_layout",
      [](int T, int hidden, int num_experts, int num_ranks) {
        if (T < 1 || num_ranks < 1 || num_experts < num_ranks || num_experts % num_ranks)
          throw py::value_error("ll_layout: T=" + std::to_string(T) + ", num_experts=" + std::to_string(num_experts) +
                                ", num_ranks=" + std::to_string(num_ranks) +
                                ": T and num_ranks must be positive, num_experts a positive multiple of num_ranks");
        if (hidden < portep::kLLHiddenStep || hidden % portep::kLLHiddenStep)
          throw py::value_error("hidden=" + std::to_string(hidden) + " must be a multiple of " +
                                std::to_string(portep::kLLHiddenStep) + " for low-latency mode (DeepEP supports " +
                                "2048..8192 in steps of 512)");
        return portep::ll_half_layout(T, hidden, num_experts, num_ranks);
      },
      py::arg("T"), py::arg("hidden"), py::arg("num_experts"), py::arg("num_ranks"));
}
