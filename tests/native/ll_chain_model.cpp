// portep_testing.ll_chain: LLPlanTable's choice between a graph and a kernel launch (gpu_kernels/cuda/ll_plan.h)
// driven against fake launches that do on the host what the kernels do with the sequence-number chain
// (ll_call_seq, gpu_kernels/cuda/ll_common.cuh; ll_api.h says the protocol), so that its rule, a graph-launched
// call carries the number a kernel launch would have, is checked without a GPU (tests/unit/test_ll_chain.py).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdint.h>

#include <string>
#include <tuple>
#include <vector>

#include "gpu_kernels/cuda/ll_plan.h"

namespace py = pybind11;
using namespace portep::cuda;

namespace {

// One Buffer's table with fake launches. A launch runs at once (the GPU's order is the launch order), except under
// capture, where it is recorded and runs never (a replay runs what it baked, which the chain must not see).
struct ChainModel {
  LLPlanTable table;
  uint32_t chain[2] = {0, 0};  // the device words seq_chain[2]
  bool capturing = false, graph_fails = false, graph_declines = false;
  // (how: "kernel", "graph" or "captured"; half; seq_mode; the number the kernel carries)
  std::vector<std::tuple<std::string, uint32_t, uint32_t, uint32_t>> launches;

  ChainModel();
  py::tuple launch(bool dispatch, uint32_t half, uint32_t seq, int phases);
};

ChainModel* g_model = nullptr;  // the model whose launch runs (the fakes are plain functions, as the table wants)

// What ll_call_seq does on the GPU: the number the call carries; the next one left in the other half's word.
uint32_t run_on_device(const LLCommon& c) {
  const uint32_t seq = (c.seq_mode & kSeqFromChain) ? g_model->chain[c.half] : c.seq;
  if (c.seq_mode & kSeqWriteChain) g_model->chain[c.half ^ 1u] = seq == 0xFFFFFFFFu ? 1u : seq + 1u;
  return seq;
}

void record(const char* how, const LLCommon& c) {
  const bool captured = g_model->capturing;
  const uint32_t carried = captured ? c.seq : run_on_device(c);
  g_model->launches.emplace_back(captured ? "captured" : how, c.half, c.seq_mode, carried);
}

template <class Args>
int kernel_launch(const Args& a, int) {
  record("kernel", a.c);
  return 0;
}

template <class Args>
int graph_launch(LLGraphs*, const Args& a) {
  if (g_model->graph_fails) return 3;                  // cudaErrorInitializationError: nothing queued
  if (g_model->graph_declines) return kGraphDeclined;  // another GPU current: nothing wrong, nothing queued
  record("graph", a.c);
  return 0;
}

int fake_capturing(void*, bool* capturing) {
  *capturing = g_model->capturing;
  return 0;
}

ChainModel::ChainModel() {
  table.dispatch_fn = &kernel_launch<LLDispatchArgs>;
  table.combine_fn = &kernel_launch<LLCombineArgs>;
  table.dispatch_graphed_fn = &graph_launch<LLDispatchArgs>;
  table.combine_graphed_fn = &graph_launch<LLCombineArgs>;
  table.capturing_fn = &fake_capturing;
  table.graphs = reinterpret_cast<LLGraphs*>(this);  // any non-null: the fakes never read it
}

py::tuple ChainModel::launch(bool dispatch, uint32_t half, uint32_t seq, int phases) {
  g_model = this;
  const size_t before = launches.size();
  int err = 0;
  if (dispatch) {
    LLDispatchArgs a{};
    a.c.half = half;
    a.c.seq = seq;
    err = table.launch_dispatch(a, phases);
  } else {
    LLCombineArgs a{};
    a.c.half = half;
    a.c.seq = seq;
    err = table.launch_combine(a, phases);
  }
  g_model = nullptr;
  if (err != 0 || launches.size() != before + 1) throw std::runtime_error("a launch recorded nothing");
  const auto& [how, h, mode, carried] = launches.back();
  return py::make_tuple(how, mode, carried);
}

}  // namespace

void bind_ll_chain(py::module_& m) {
  py::module_ c = m.def_submodule("ll_chain", "LLPlanTable's graph-or-kernel choice against fake launches");
  c.attr("SEQ_WRITE_CHAIN") = kSeqWriteChain;
  c.attr("SEQ_FROM_CHAIN") = kSeqFromChain;
  c.attr("PHASE_SEND") = kPhaseSend;
  c.attr("PHASE_RECV") = kPhaseRecv;
  py::class_<ChainModel>(c, "ChainModel")
      .def(py::init<>())
      .def("launch", &ChainModel::launch, py::arg("dispatch"), py::arg("half"), py::arg("seq"), py::arg("phases"),
           "one launch through the table: (how, seq_mode, the number the kernel carries)")
      .def("reset_half", [](ChainModel& m) { m.table.reset_half(); })
      .def_readwrite("capturing", &ChainModel::capturing)
      .def_readwrite("graph_fails", &ChainModel::graph_fails)
      .def_readwrite("graph_declines", &ChainModel::graph_declines)
      .def_property(
          "graphs_on", [](const ChainModel& m) { return m.table.graphs != nullptr; },
          [](ChainModel& m, bool on) { m.table.graphs = on ? reinterpret_cast<LLGraphs*>(&m) : nullptr; })
      .def_property_readonly("graph_error", [](const ChainModel& m) { return m.table.graph_error; })
      .def_property_readonly("chain",
                             [](const ChainModel& m) { return std::vector<uint32_t>{m.chain[0], m.chain[1]}; });
}
