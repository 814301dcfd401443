// portep._ll_torch's entries: LLCalls, one per CUDA Buffer in low-latency mode, whose dispatch and combine become that
// Buffer's low_latency_dispatch and low_latency_combine (Buffer._install_ll_fast_path sets them over the class's
// methods, so a call reaches native code without a Python frame). An entry binds the call's arguments to Buffer's
// signature, checks the Buffer's lockstep state, runs the phase (ll_torch_path.cpp) and counts the call
// (LockstepState::made_call); the state and the plan table come from portep._C as one LLShared capsule (ll_shared.h),
// checked once. Whatever it does not take (arguments it cannot bind, a Buffer out of step or owing its
// peers a refusal, a call the phase declines, `enabled` off) goes to Buffer's own Python method with the arguments as
// they came, which validates the call in full and raises or runs it.
#include <Python.h>
#include <structmember.h>

#include <stdint.h>

#include <array>
#include <string>
#include <utility>
#include <vector>

#include "python/src/ll_shared.h"
#include "python/src/ll_torch_path.h"

namespace {

using portep::LockstepState;
using portep::cuda::LLPlanTable;
namespace lt = portep::ll_torch;

constexpr int kMaxParams = 16;

// One of Buffer's LL methods: its parameters after self (names interned at module init) and their defaults.
struct Signature {
  const char* what;
  int count, required;
  const char* names[kMaxParams];
  enum Default { kNone, kTrue, kFalse } defaults[kMaxParams];
  PyObject* interned[kMaxParams];
  PyObject* (*run)(LLPlanTable*, PyObject* const*, const lt::CallContext&, lt::RecvPhase*);
  PyObject* what_str;
  std::string doc;  // the entry's docstring, led by its signature as inspect reads it (made from the table above)
};

Signature kDispatch = {
    "low_latency_dispatch",
    lt::kDispatchArgCount,
    4,
    {"x", "topk_idx", "num_max_dispatch_tokens_per_rank", "num_experts", "cumulative_local_expert_recv_stats",
     "dispatch_wait_recv_cost_stats", "use_fp8", "round_scale", "use_ue8m0", "async_finish", "return_recv_hook"},
    {Signature::kNone, Signature::kNone, Signature::kNone, Signature::kNone, Signature::kNone, Signature::kNone,
     Signature::kTrue, Signature::kFalse, Signature::kFalse, Signature::kFalse, Signature::kFalse},
    {},
    &lt::run_dispatch,
    nullptr,
    {}};

Signature kCombine = {"low_latency_combine",
                      lt::kCombineArgCount,
                      4,
                      {"x", "topk_idx", "topk_weights", "handle", "use_logfmt", "zero_copy", "async_finish",
                       "return_recv_hook", "out", "combine_wait_recv_cost_stats"},
                      {Signature::kNone, Signature::kNone, Signature::kNone, Signature::kNone, Signature::kFalse,
                       Signature::kFalse, Signature::kFalse, Signature::kFalse, Signature::kNone, Signature::kNone},
                      {},
                      &lt::run_combine,
                      nullptr,
                      {}};

static_assert(lt::kDispatchArgCount <= kMaxParams && lt::kCombineArgCount <= kMaxParams);

PyObject* default_of(Signature::Default d) {
  return d == Signature::kTrue ? Py_True : d == Signature::kFalse ? Py_False : Py_None;
}

const char* default_text(Signature::Default d) {
  return d == Signature::kTrue ? "=True" : d == Signature::kFalse ? "=False" : "=None";
}

int param_of(const Signature& sig, PyObject* name) {
  for (int i = 0; i < sig.count; ++i)
    if (sig.interned[i] == name) return i;  // the usual case: call sites' keyword names are interned too
  for (int i = 0; i < sig.count; ++i)
    if (PyUnicode_Check(name) && PyUnicode_Compare(sig.interned[i], name) == 0) return i;
  return -1;
}

// The call's arguments bound to sig's parameters (borrowed references), or false where Python would raise a
// TypeError binding them: the Python method then raises it.
bool bind(const Signature& sig, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames, PyObject** bound) {
  if (nargs > sig.count) return false;
  for (int i = 0; i < sig.count; ++i) bound[i] = i < nargs ? args[i] : nullptr;
  const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  for (Py_ssize_t k = 0; k < nkw; ++k) {
    const int i = param_of(sig, PyTuple_GET_ITEM(kwnames, k));
    if (i < 0 || bound[i]) return false;
    bound[i] = args[nargs + k];
  }
  for (int i = 0; i < sig.count; ++i) {
    if (bound[i]) continue;
    if (i < sig.required) return false;
    bound[i] = default_of(sig.defaults[i]);
  }
  return true;
}

PyObject* s_fail;

struct LLCalls {
  PyObject_HEAD PyObject* shared;  // portep._C's LLShared capsule: keeps the table's LLKernels and the state alive
  LLPlanTable* table;              // the plan table (null: every call declines)
  LockstepState* state;            // the Buffer's lockstep counters, which the full path advances too
  PyObject* lockstep;              // the engine's Lockstep (its fail() marks the Buffer out of step)
  PyObject* buffer;                // a weak reference to the Buffer (its instance dict holds this object's entries)
  PyObject* event_type;            // EventOverlap
  PyObject* raise_notice;          // the engine's raise_notice
  PyObject* full[2];               // Buffer.low_latency_dispatch, Buffer.low_latency_combine (Python functions)
  PyObject* handle_type;           // the tuple subclass of dispatch handles (LLHandle), or null: a plain tuple
  char enabled;
  unsigned long long taken, declined;
};

// A call failed after its launch was tried (the error is set): this rank is out of step. The call's error is raised.
PyObject* out_of_step(LLCalls* c, const Signature& sig) { return lt::fail_out_of_step(c->lockstep, sig.what_str); }

// The launch was tried and failed (the error is set): the call counts (made_call), then out_of_step.
PyObject* failed(LLCalls* c, const Signature& sig) {
  if (c->state) c->state->made_call();
  return out_of_step(c, sig);
}

// A hooked call's results with its receive hook in their last place (None there until now).
PyObject* with_hook(LLCalls* c, const Signature& sig, PyObject* out, lt::RecvPhase&& hooked) {
  PyObject* hook = lt::new_recv_hook(
      std::move(hooked), lt::HookOwner{c->table, c->state, c->shared, c->lockstep, c->raise_notice, sig.what_str});
  if (!hook) {
    Py_DECREF(out);
    return out_of_step(c, sig);  // its send phase went out: its peers wait for a receive phase that will not come
  }
  PyTuple_SetItem(out, PyTuple_GET_SIZE(out) - 1, hook);  // out is this call's own tuple: nothing else holds it
  return out;
}

// results, or results raised with a kernel's notice (a list [results]: ll_torch_path.h), as the full path does.
PyObject* with_notice(LLCalls* c, PyObject* out) {
  if (PyTuple_CheckExact(out)) return out;
  PyObject* results = PyList_GET_ITEM(out, 0);
  Py_INCREF(results);
  Py_DECREF(out);
  PyObject* raised = PyObject_CallOneArg(c->raise_notice, results);
  if (!raised) {
    Py_DECREF(results);
    return nullptr;
  }
  Py_DECREF(raised);
  return results;
}

// Buffer's Python method with the call's arguments as they came.
PyObject* full_path(LLCalls* c, int phase, const Signature& sig, PyObject* const* args, size_t nargsf,
                    PyObject* kwnames) {
  ++c->declined;
  if (!c->buffer || !c->full[phase]) {  // cleared by the garbage collector (tp_clear)
    PyErr_Format(PyExc_RuntimeError, "%s: the Buffer this method belonged to was deleted", sig.what);
    return nullptr;
  }
#if PY_VERSION_HEX >= 0x030D0000
  PyObject* buffer = nullptr;
  if (PyWeakref_GetRef(c->buffer, &buffer) < 0) return nullptr;
#else
  PyObject* buffer = PyWeakref_GetObject(c->buffer);
  buffer = buffer == Py_None ? nullptr : buffer;
  Py_XINCREF(buffer);
#endif
  if (!buffer) {
    PyErr_Format(PyExc_RuntimeError, "%s: the Buffer this method belonged to was deleted", sig.what);
    return nullptr;
  }
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf), nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  std::vector<PyObject*> all(size_t(1 + nargs + nkw));
  all[0] = buffer;
  for (Py_ssize_t i = 0; i < nargs + nkw; ++i) all[size_t(1 + i)] = args[i];
  PyObject* full = Py_NewRef(c->full[phase]);  // this object may be cleared while the method runs
  PyObject* out = PyObject_Vectorcall(full, all.data(), size_t(1 + nargs), kwnames);
  Py_DECREF(full);
  Py_DECREF(buffer);
  return out;
}

PyObject* enter(LLCalls* c, int phase, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  const Signature& sig = phase == 0 ? kDispatch : kCombine;
  PyObject* bound[kMaxParams];
  if (c->enabled && c->state && c->state->in_step() && bind(sig, args, PyVectorcall_NARGS(nargsf), kwnames, bound)) {
    const uint32_t wire_seq = uint32_t(c->state->seq % 0xFFFFFFFFull + 1);  // lockstep.wire_seq of seq + 1
    lt::RecvPhase hooked;
    PyObject* out = sig.run(c->table, bound, lt::CallContext{wire_seq, c->event_type, c->handle_type}, &hooked);
    if (!out) return failed(c, sig);
    if (out != Py_None) {
      ++c->taken;
      if (c->state) c->state->made_call();  // (null only if the garbage collector cleared this object meanwhile)
      return hooked.keep ? with_hook(c, sig, out, std::move(hooked)) : with_notice(c, out);
    }
    Py_DECREF(out);
  }
  return full_path(c, phase, sig, args, nargsf, kwnames);
}

PyObject* calls_dispatch(PyObject* self, PyObject* const* args, Py_ssize_t nargsf, PyObject* kwnames) {
  return enter(reinterpret_cast<LLCalls*>(self), 0, args, size_t(nargsf), kwnames);
}

PyObject* calls_combine(PyObject* self, PyObject* const* args, Py_ssize_t nargsf, PyObject* kwnames) {
  return enter(reinterpret_cast<LLCalls*>(self), 1, args, size_t(nargsf), kwnames);
}

// The LLShared of capsule `shared` (ll_shared.h), or nullptr with a TypeError (not such a capsule) or a RuntimeError
// (one of another layout: a portep._C and a portep._ll_torch of different builds).
const portep::LLShared* shared_of(PyObject* shared) {
  if (!PyCapsule_IsValid(shared, portep::kLLSharedCapsule)) {
    PyErr_Format(PyExc_TypeError, "LLCalls: shared must be a %s capsule (portep._C.ll_shared), got %.200s",
                 portep::kLLSharedCapsule, Py_TYPE(shared)->tp_name);
    return nullptr;
  }
  const auto* s = static_cast<const portep::LLShared*>(PyCapsule_GetPointer(shared, portep::kLLSharedCapsule));
  const std::string why = s ? portep::ll_shared_check(s, sizeof(LLPlanTable)) : "no pointer";
  if (!s || !why.empty()) {
    if (!PyErr_Occurred())
      PyErr_Format(PyExc_RuntimeError,
                   "LLCalls: portep._C's LLShared does not match this portep._ll_torch (%s): they come from different "
                   "builds; reinstall portep",
                   why.c_str());
    return nullptr;
  }
  return s;
}

// LLCalls(shared, lockstep, buffer, event_type, raise_notice, full_dispatch, full_combine, *, handle_type=None)
PyObject* calls_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject *shared, *lockstep, *buffer, *event_type, *raise_notice, *full_dispatch, *full_combine;
  PyObject* handle_type = Py_None;
  static const char* kw[] = {"shared",        "lockstep",     "buffer",      "event_type", "raise_notice",
                             "full_dispatch", "full_combine", "handle_type", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOOO|$O:LLCalls", const_cast<char**>(kw), &shared, &lockstep,
                                   &buffer, &event_type, &raise_notice, &full_dispatch, &full_combine, &handle_type))
    return nullptr;
  if (!PyType_Check(event_type) || !PyCallable_Check(raise_notice) || !PyCallable_Check(full_dispatch) ||
      !PyCallable_Check(full_combine)) {
    PyErr_SetString(PyExc_TypeError,
                    "LLCalls: event_type must be a class; raise_notice, full_dispatch and full_combine callables");
    return nullptr;
  }
  if (handle_type != Py_None &&
      !(PyType_Check(handle_type) && PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(handle_type), &PyTuple_Type))) {
    PyErr_SetString(PyExc_TypeError, "LLCalls: handle_type must be None or a subclass of tuple (LLHandle)");
    return nullptr;
  }
  const portep::LLShared* s = shared_of(shared);
  if (!s) return nullptr;
  PyObject* ref = PyWeakref_NewRef(buffer, nullptr);
  if (!ref) return nullptr;
  LLCalls* c = reinterpret_cast<LLCalls*>(type->tp_alloc(type, 0));
  if (!c) {
    Py_DECREF(ref);
    return nullptr;
  }
  c->shared = Py_NewRef(shared);
  c->table = s->table;
  c->state = s->lockstep;
  c->lockstep = Py_NewRef(lockstep);
  c->buffer = ref;
  c->event_type = Py_NewRef(event_type);
  c->raise_notice = Py_NewRef(raise_notice);
  c->full[0] = Py_NewRef(full_dispatch);
  c->full[1] = Py_NewRef(full_combine);
  c->handle_type = handle_type == Py_None ? nullptr : Py_NewRef(handle_type);
  c->enabled = 1;
  return reinterpret_cast<PyObject*>(c);
}

// The references an LLCalls owns (the one list its traverse and clear walk).
std::array<PyObject**, 8> owned_refs(LLCalls* c) {
  return {&c->shared,       &c->lockstep, &c->buffer,  &c->event_type,
          &c->raise_notice, &c->full[0],  &c->full[1], &c->handle_type};
}

int calls_traverse(PyObject* self, visitproc visit, void* arg) {
  for (PyObject** ref : owned_refs(reinterpret_cast<LLCalls*>(self))) Py_VISIT(*ref);
  return 0;
}

int calls_clear(PyObject* self) {
  LLCalls* c = reinterpret_cast<LLCalls*>(self);
  c->table = nullptr;  // whatever comes now declines (a table or a state without its owner is never read)
  c->state = nullptr;
  c->enabled = 0;
  for (PyObject** ref : owned_refs(c)) Py_CLEAR(*ref);
  return 0;
}

void calls_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  calls_clear(self);
  Py_TYPE(self)->tp_free(self);
}

PyCFunction fastcall_keywords(PyObject* (*f)(PyObject*, PyObject* const*, Py_ssize_t, PyObject*)) {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f));
}

PyMethodDef kCallsMethods[] = {
    // docstrings: prepare_signatures
    {"dispatch", fastcall_keywords(&calls_dispatch), METH_FASTCALL | METH_KEYWORDS, nullptr},
    {"combine", fastcall_keywords(&calls_combine), METH_FASTCALL | METH_KEYWORDS, nullptr},
    {nullptr, nullptr, 0, nullptr}};

PyMemberDef kCallsMembers[] = {
    {"enabled", T_BOOL, offsetof(LLCalls, enabled), 0, "False: every call takes Buffer's Python method"},
    {"taken", T_ULONGLONG, offsetof(LLCalls, taken), READONLY, "calls the fast path launched"},
    {"declined", T_ULONGLONG, offsetof(LLCalls, declined), READONLY, "calls handed to Buffer's Python method"},
    {nullptr, 0, 0, 0, nullptr}};

PyTypeObject kCallsType = [] {
  PyTypeObject t{PyVarObject_HEAD_INIT(nullptr, 0)};
  t.tp_name = "portep._ll_torch.LLCalls";
  t.tp_basicsize = sizeof(LLCalls);
  t.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  t.tp_doc = "A Buffer's low-latency entries (ll_torch_calls.cpp)";
  t.tp_new = calls_new;
  t.tp_dealloc = calls_dealloc;
  t.tp_traverse = calls_traverse;
  t.tp_clear = calls_clear;
  t.tp_methods = kCallsMethods;
  t.tp_members = kCallsMembers;
  return t;
}();

// "name($self, x, ..., use_fp8=True, ...)\n--\n\n": the signature inspect.signature reports for the entry (which
// tests/unit/test_ll_fast_entries.py compares with Buffer's method), then what it is.
std::string signature_doc(const Signature& sig, const char* entry) {
  std::string doc = std::string(entry) + "($self";
  for (int i = 0; i < sig.count; ++i) {
    doc += std::string(", ") + sig.names[i];
    if (i >= sig.required) doc += default_text(sig.defaults[i]);
  }
  return doc + ")\n--\n\nBuffer." + sig.what + ": the fast path, or Buffer's method for what it does not take";
}

bool prepare_signatures() {
  int m = 0;
  for (Signature* sig : {&kDispatch, &kCombine}) {
    for (int i = 0; i < sig->count; ++i)
      if (!(sig->interned[i] = PyUnicode_InternFromString(sig->names[i]))) return false;
    if (!(sig->what_str = PyUnicode_InternFromString(sig->what))) return false;
    sig->doc = signature_doc(*sig, kCallsMethods[m].ml_name);
    kCallsMethods[m++].ml_doc = sig->doc.c_str();
  }
  return (s_fail = PyUnicode_InternFromString("fail")) != nullptr;
}

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_ll_torch", "portep's LL hot path against torch", -1, nullptr};

}  // namespace

namespace portep::ll_torch {

PyObject* fail_out_of_step(PyObject* lockstep, PyObject* what) {
  PyObject *type, *value, *trace;
  PyErr_Fetch(&type, &value, &trace);
  PyErr_NormalizeException(&type, &value, &trace);
  if (lockstep) {
    PyObject* fail = PyObject_CallMethodObjArgs(lockstep, s_fail, what, value ? value : Py_None, nullptr);
    if (!fail) PyErr_WriteUnraisable(lockstep);  // the call's own error is the one to raise
    Py_XDECREF(fail);
  }
  PyErr_Restore(type, value, trace);
  return nullptr;
}

}  // namespace portep::ll_torch

PyMODINIT_FUNC PyInit__ll_torch() {
  if (!prepare_signatures() || PyType_Ready(&kCallsType) < 0 || !lt::recv_hook_type_ready() || !lt::event_type_ready())
    return nullptr;
  PyObject* m = PyModule_Create(&kModule);
  if (!m) return nullptr;
  if (PyModule_AddStringConstant(m, "TORCH_VERSION", PORTEP_TORCH_VERSION) < 0 ||
      PyModule_AddObjectRef(m, "LLCalls", reinterpret_cast<PyObject*>(&kCallsType)) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
