// LockstepState (python/src/ll_shared.h): the counters of a Buffer's call protocol, one native object that both LL
// call paths advance. python/portep/lockstep.py keeps the protocol and reads and writes them through this binding.
#include <pybind11/pybind11.h>

#include "python/src/ll_shared.h"

namespace py = pybind11;
using portep::LockstepState;

void bind_lockstep(py::module_& m) {
  py::class_<LockstepState>(m, "LockstepState", "a Buffer's lockstep counters (python/src/ll_shared.h)")
      .def(py::init<>())
      .def_readwrite("seq", &LockstepState::seq, "collective calls made or refused since the last resync")
      .def_readwrite("refused", &LockstepState::refused, "this rank's refusals")
      .def_readwrite("resolved", &LockstepState::resolved, "this rank's refusals every peer refused too")
      .def_property(
          "sent", [](const LockstepState& s) { return s.sent != 0; }, [](LockstepState& s, bool v) { s.sent = v; },
          "the current call sent something")
      .def_property(
          "broken", [](const LockstepState& s) { return s.broken != 0; },
          [](LockstepState& s, bool v) { s.broken = v; }, "this rank is out of step")
      .def_property_readonly("in_step", &LockstepState::in_step,
                             "not broken, and every refusal of this rank's matched by its peers")
      .def("begin", &LockstepState::begin, "a call begins: seq + 1, nothing sent yet")
      .def("made_call", &LockstepState::made_call, "a call began and launched in one step: seq + 1, sent");
}
