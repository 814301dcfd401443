// portep._ll_torch's events: the completion event of an async_finish call the fast path took. A c10::Event (torch's
// device-generic event: CUDA's, or ROCm's under the CUDA name) recorded on the stream the call launched on, with the
// three methods of the full path's CudaEvent (backends/cuda/engine.py) that EventOverlap calls. Made here because a
// torch.cuda.Event made and recorded from Python costs several microseconds a call (its record() builds a Stream).
#include <Python.h>
#include <c10/core/Event.h>

#include <exception>
#include <new>
#include <string>

#include "python/src/ll_torch_path.h"

namespace {

struct Event {
  PyObject_HEAD c10::Event event;  // constructed in place by new_recorded_event, destroyed by dealloc
  int device;
};

PyObject* event_error(const char* what, const char* error) {
  PyErr_Format(PyExc_RuntimeError, "portep._ll_torch.Event.%s: %s", what, error);
  return nullptr;
}

// The current stream of the event's GPU waits for it (EventOverlap.current_stream_wait).
PyObject* event_current_stream_wait(PyObject* self, PyObject*) {
  Event* ev = reinterpret_cast<Event*>(self);
  try {
    ev->event.block(portep::ll_torch::current_stream(ev->device));
  } catch (const std::exception& e) {
    return event_error("current_stream_wait", e.what());
  }
  Py_RETURN_NONE;
}

PyObject* event_query(PyObject* self, PyObject*) {
  try {
    return PyBool_FromLong(reinterpret_cast<Event*>(self)->event.query());
  } catch (const std::exception& e) {
    return event_error("query", e.what());
  }
}

// Waits on the host for the event, without the GIL (the wait may be long; other threads go on).
PyObject* event_synchronize(PyObject* self, PyObject*) {
  const c10::Event& event = reinterpret_cast<Event*>(self)->event;
  std::string error;
  Py_BEGIN_ALLOW_THREADS;
  try {
    event.synchronize();
  } catch (const std::exception& e) {
    error = e.what();
  }
  Py_END_ALLOW_THREADS;
  if (!error.empty()) return event_error("synchronize", error.c_str());
  Py_RETURN_NONE;
}

PyObject* event_repr(PyObject* self) {
  return PyUnicode_FromFormat("portep._ll_torch.Event(device=%d)", reinterpret_cast<Event*>(self)->device);
}

void event_dealloc(PyObject* self) {
  reinterpret_cast<Event*>(self)->event.~Event();  // the backend's event is destroyed with it
  Py_TYPE(self)->tp_free(self);
}

PyMethodDef kEventMethods[] = {
    {"current_stream_wait", event_current_stream_wait, METH_NOARGS,
     "The current stream of the event's GPU waits for it (queued; the host does not wait)."},
    {"query", event_query, METH_NOARGS, "Whether the work before the event has finished."},
    {"synchronize", event_synchronize, METH_NOARGS, "Waits on the host until the work before the event finished."},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject kEventType = [] {
  PyTypeObject t{PyVarObject_HEAD_INIT(nullptr, 0)};
  t.tp_name = "portep._ll_torch.Event";
  t.tp_basicsize = sizeof(Event);
  t.tp_flags = Py_TPFLAGS_DEFAULT;
  t.tp_doc = "An async_finish low-latency call's completion event, recorded after its launch (ll_torch_event.cpp)";
  t.tp_dealloc = event_dealloc;
  t.tp_repr = event_repr;
  t.tp_methods = kEventMethods;
  return t;
}();

}  // namespace

namespace portep::ll_torch {

PyObject* new_recorded_event(int device) {
  Event* ev = PyObject_New(Event, &kEventType);
  if (!ev) return nullptr;
  try {
    new (&ev->event) c10::Event(c10::DeviceType::CUDA, c10::EventFlag::PYTORCH_DEFAULT);  // no timing
  } catch (const std::exception& e) {
    PyObject_Free(ev);  // nothing was constructed in it: no dealloc
    return event_error("create", e.what());
  }
  ev->device = device;
  PyObject* self = reinterpret_cast<PyObject*>(ev);
  try {
    ev->event.record(current_stream(device));
  } catch (const std::exception& e) {
    Py_DECREF(self);
    return event_error("record", e.what());
  }
  return self;
}

bool event_type_ready() { return PyType_Ready(&kEventType) == 0; }

}  // namespace portep::ll_torch
