// portep._ll_torch's receive hooks: what a low-latency call made with return_recv_hook=True returns, which launches
// the call's receive phase when called (ll_torch_path.h, new_recv_hook). As the full path's hook
// (CudaEngine.low_latency_dispatch's launch, guarded by buffer.py's _Collective.hook and followed by raise_notice),
// it launches on the current stream of the Buffer's GPU as the hook runs, and a failed launch leaves the Buffer out
// of step; unlike a second kernel that would wait for data that never comes, a second call raises.
#include <Python.h>

#include <new>
#include <utility>

#include "python/src/ll_torch_path.h"

namespace {

using portep::cuda::LLPlanTable;
namespace lt = portep::ll_torch;

struct RecvHook {
  PyObject_HEAD lt::RecvPhase phase;  // phase.keep: the tensors its launch reads or writes, kept as the full path's
                                      // hook keeps them (while it lives: its stream may not be theirs)
  LLPlanTable* table;                 // null once cleared by the garbage collector
  portep::LockstepState* state;
  PyObject* shared;  // the capsule that keeps the table and the state alive
  PyObject* lockstep;
  PyObject* raise_notice;
  PyObject* what;
  bool called;
};

PyObject* hook_error(const RecvHook* h, const char* why) {
  PyErr_Format(PyExc_RuntimeError, "%U's receive hook: %s", h->what, why);
  return nullptr;
}

// The launch failed: its error is raised, and the Buffer is out of step (lockstep.fail).
PyObject* launch_failed(RecvHook* h, int err) {
  PyErr_Format(PyExc_RuntimeError, "%U: %s", h->what, h->table->error_string(err));
  return lt::fail_out_of_step(h->lockstep, h->what);
}

PyObject* hook_call(PyObject* self, PyObject* args, PyObject* kwargs) {
  RecvHook* h = reinterpret_cast<RecvHook*>(self);
  if (PyTuple_GET_SIZE(args) != 0 || (kwargs && PyDict_GET_SIZE(kwargs) != 0)) {
    PyErr_SetString(PyExc_TypeError, "a receive hook takes no arguments");
    return nullptr;
  }
  if (h->called) return hook_error(h, "already called (it launches the receive phase once)");
  if (!h->table || h->table->closed()) return hook_error(h, "its Buffer was destroyed");
  h->called = true;
  void* stream = lt::current_stream(h->table->device).native_handle();
  h->state->sent = 1;  // the Python path's lockstep.sending()
  int err;
  if (h->phase.is_combine) {
    h->phase.combine.c.stream = stream;
    err = h->table->launch_combine(h->phase.combine, portep::cuda::kPhaseRecv);
  } else {
    h->phase.dispatch.c.stream = stream;
    err = h->table->launch_dispatch(h->phase.dispatch, portep::cuda::kPhaseRecv);
  }
  if (err) return launch_failed(h, err);
  if (h->table->notice_pending()) {
    PyObject* raised = PyObject_CallNoArgs(h->raise_notice);  // raises the notice (a DroppedInput without results)
    if (!raised) return nullptr;
    Py_DECREF(raised);
  }
  Py_RETURN_NONE;
}

int hook_traverse(PyObject* self, visitproc visit, void* arg) {
  RecvHook* h = reinterpret_cast<RecvHook*>(self);
  Py_VISIT(h->phase.keep);
  Py_VISIT(h->shared);
  Py_VISIT(h->lockstep);
  Py_VISIT(h->raise_notice);
  return 0;
}

int hook_clear(PyObject* self) {
  RecvHook* h = reinterpret_cast<RecvHook*>(self);
  h->table = nullptr;  // a table without its owner is never read
  h->state = nullptr;
  Py_CLEAR(h->phase.keep);
  Py_CLEAR(h->shared);
  Py_CLEAR(h->lockstep);
  Py_CLEAR(h->raise_notice);
  return 0;
}

void hook_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  hook_clear(self);
  Py_CLEAR(reinterpret_cast<RecvHook*>(self)->what);
  Py_TYPE(self)->tp_free(self);
}

PyTypeObject kHookType = [] {
  PyTypeObject t{PyVarObject_HEAD_INIT(nullptr, 0)};
  t.tp_name = "portep._ll_torch.RecvHook";
  t.tp_basicsize = sizeof(RecvHook);
  t.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  t.tp_doc = "A hooked low-latency call's receive phase: calling it (once) launches it (ll_torch_hook.cpp)";
  t.tp_call = hook_call;
  t.tp_dealloc = hook_dealloc;
  t.tp_traverse = hook_traverse;
  t.tp_clear = hook_clear;
  return t;
}();

}  // namespace

namespace portep::ll_torch {

PyObject* new_recv_hook(RecvPhase&& phase, const HookOwner& owner) {
  RecvHook* h = PyObject_GC_New(RecvHook, &kHookType);
  if (!h) {
    Py_CLEAR(phase.keep);
    return nullptr;
  }
  new (&h->phase) RecvPhase(std::move(phase));
  phase.keep = nullptr;  // taken over
  h->table = owner.table;
  h->state = owner.state;
  h->shared = Py_NewRef(owner.shared);
  h->lockstep = Py_NewRef(owner.lockstep);
  h->raise_notice = Py_NewRef(owner.raise_notice);
  h->what = Py_NewRef(owner.what);
  h->called = false;
  PyObject_GC_Track(reinterpret_cast<PyObject*>(h));
  return reinterpret_cast<PyObject*>(h);
}

bool recv_hook_type_ready() { return PyType_Ready(&kHookType) == 0; }

}  // namespace portep::ll_torch
