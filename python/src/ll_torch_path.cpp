// portep._ll_torch: the low-latency calls' hot path, one native call per phase. Each call checks that its
// arguments match a signature the Python path validated (a plan of the Buffer's table, gpu_kernels/cuda/ll_plan.h,
// marked checked), allocates the outputs with torch's caching allocator on torch's current stream, and launches the
// kernels on that stream through the table (a cached CUDA graph or a kernel launch; portep._C holds the
// kernels). A call with return_recv_hook=True launches its send phase and returns a hook for the receive phase
// (ll_torch_hook.cpp); one with async_finish=True returns an EventOverlap recorded after its launch. Anything it does
// not recognise is declined before anything happened, and the Python path then validates the call in full and raises
// or runs it. The entries that Buffer's methods become, and the module, are in ll_torch_calls.cpp.
//
// The one part of portep that links libtorch (the rest takes raw pointers, so one build serves every torch): it is
// built where torch's headers are found at build time and loaded only under that torch version
// (backends/cuda/ll_fast.py).
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>
#include <ATen/Context.h>
#include <c10/core/Allocator.h>
#include <c10/core/ScalarTypeToTypeMeta.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <climits>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "gpu_kernels/logfmt.h"
#include "python/src/ll_torch_path.h"

namespace {

using portep::cuda::ll_call_common;
using portep::cuda::ll_set_combine_rows;
using portep::cuda::LLCombineArgs;
using portep::cuda::LLDispatchArgs;
using portep::cuda::LLPlan;
using portep::cuda::LLPlanTable;

constexpr int kAnySize = -1;
constexpr int kMaxTopk = portep::cuda::kMetaMaxTopk;

// o is a contiguous tensor of dtype on the table's GPU with these sizes (kAnySize: any); *t views it.
bool is_tensor(PyObject* o, at::ScalarType dtype, std::initializer_list<int64_t> sizes, int device,
               const at::Tensor** t) {
  if (!THPVariable_CheckExact(o)) return false;  // subclasses (__torch_dispatch__, functional) go the full way
  const at::Tensor& v = THPVariable_Unpack(o);
  if (v.scalar_type() != dtype || v.dim() != int64_t(sizes.size()) || !v.is_cuda() || v.get_device() != device ||
      !v.is_contiguous())
    return false;
  int d = 0;
  for (int64_t want : sizes) {
    if (want != kAnySize && v.size(d) != want) return false;
    ++d;
  }
  *t = &v;
  return true;
}

// None, or a tensor as is_tensor accepts it (*ptr: its address, 0 for None).
bool is_optional_tensor(PyObject* o, at::ScalarType dtype, int64_t size, int device, void** ptr) {
  *ptr = nullptr;
  if (o == Py_None) return true;
  const at::Tensor* t = nullptr;
  if (!is_tensor(o, dtype, {size}, device, &t)) return false;
  *ptr = t->data_ptr();
  return true;
}

bool is_int(PyObject* o, long* v) {  // exactly an int (the Python checks tell 128 from 128.0 and from True)
  if (!PyLong_CheckExact(o)) return false;
  int overflow = 0;
  *v = PyLong_AsLongAndOverflow(o, &overflow);
  return overflow == 0 && *v > 0 && *v <= INT_MAX;  // the plans hold int
}

bool is_bool(PyObject* o, bool* v) {
  *v = o == Py_True;
  return o == Py_True || o == Py_False;
}

// torch's current stream on `device` (current_stream's native handle), if `device` is the current GPU: the outputs come
// from the caching allocator of the current GPU and stream, and the kernels launch on the current GPU. Not when torch's
// deterministic mode fills new memory (at::empty fills the outputs then, which the full path does).
bool current_gpu(int device, void** stream) {
  const at::Context& ctx = at::globalContext();
  if (ctx.deterministicAlgorithms() && ctx.deterministicFillUninitializedMemory()) return false;
  if (c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice().index() != device) return false;
  *stream = portep::ll_torch::current_stream(device).native_handle();
  return true;
}

PyObject* wrap(const at::Tensor& t) { return THPVariable_Wrap(t); }

PyObject* new_ref(PyObject* o) {
  Py_INCREF(o);
  return o;
}

// A tuple that takes over the new references `items` (nullptr, with the error set, if any item is nullptr).
PyObject* tuple_of(std::initializer_list<PyObject*> items) {
  bool ok = true;
  for (PyObject* o : items) ok = ok && o;
  PyObject* t = ok ? PyTuple_New(Py_ssize_t(items.size())) : nullptr;
  Py_ssize_t i = 0;
  for (PyObject* o : items) {
    if (t)
      PyTuple_SET_ITEM(t, i++, o);
    else
      Py_XDECREF(o);
  }
  return t;
}

PyObject* launch_failed(const LLPlanTable& table, const char* what, int err) {
  PyErr_SetString(PyExc_RuntimeError, (std::string(what) + ": " + table.error_string(err)).c_str());
  return nullptr;
}

// results, or [results] when a kernel reported a notice (the Python side raises it with them)
PyObject* returned(const LLPlanTable& table, PyObject* results) {
  if (!results || !table.notice_pending()) return results;
  PyObject* list = PyList_New(1);
  if (!list) {
    Py_DECREF(results);
    return nullptr;
  }
  PyList_SET_ITEM(list, 0, results);
  return list;
}

// items (a new reference, taken over) as an instance of `type`, a tuple subclass (nullptr: items as it is), made as
// tuple.__new__(type, items) makes it, without a Python frame: a NamedTuple's own __new__ only calls that.
PyObject* as_tuple_type(PyObject* type, PyObject* items) {
  if (!type || !items) return items;
  PyObject* args = PyTuple_Pack(1, items);
  Py_DECREF(items);
  PyObject* typed = args ? PyTuple_Type.tp_new(reinterpret_cast<PyTypeObject*>(type), args, nullptr) : nullptr;
  Py_XDECREF(args);
  return typed;
}

// A new instance of the event type without running its __init__: EventOverlap's class attributes say "no event".
PyObject* new_event(PyObject* type) {
  if (!PyType_Check(type)) {
    PyErr_SetString(PyExc_TypeError, "event_type must be a class");
    return nullptr;
  }
  PyTypeObject* t = reinterpret_cast<PyTypeObject*>(type);
  PyObject* no_args = PyTuple_New(0);
  PyObject* event = no_args ? t->tp_new(t, no_args, nullptr) : nullptr;
  Py_XDECREF(no_args);
  return event;
}

int64_t align_to(int64_t bytes, int64_t unit) { return (bytes + unit - 1) / unit * unit; }
int64_t align16(int64_t bytes) { return align_to(bytes, 16); }

// `bytes` from torch's caching allocator on the current GPU and stream, as a byte tensor: at::empty's allocation
// without the dispatcher, the device guard and the options, which cost about a microsecond a call (current_gpu
// checked what they would).
at::Tensor gpu_bytes(int64_t bytes) {
  c10::Allocator* allocator = c10::GetAllocator(c10::DeviceType::CUDA);
  c10::Storage storage(c10::Storage::use_byte_size_t(), size_t(bytes), allocator->allocate(size_t(bytes)), allocator,
                       /*resizable=*/true);
  return at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CUDA),
                                                  caffe2::TypeMeta::Make<uint8_t>());
}

// A tensor over base's storage from byte `offset`, made without the dispatcher (a view op through it costs a good
// part of a microsecond); base is a fresh byte tensor of this call, so the parts share nothing with anything else.
at::Tensor part_of(const at::Tensor& base, at::ScalarType dtype, c10::IntArrayRef sizes, c10::IntArrayRef strides,
                   int64_t offset) {
  const caffe2::TypeMeta meta = c10::scalarTypeToTypeMeta(dtype);
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(base.storage()), base.key_set(), meta);
  t.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, offset / int64_t(meta.itemsize()));
  return t;
}

// The call's async_finish and return_recv_hook, exactly True or False, as the fast path takes them: not both (the
// full path refuses that).
bool call_mode(PyObject* async_arg, PyObject* hook_arg, bool* async_finish, bool* hook) {
  return is_bool(async_arg, async_finish) && is_bool(hook_arg, hook) && !(*async_finish && *hook);
}

// The call's EventOverlap, as the full path makes them: a new instance without an event; with async_finish, one whose
// event (new_recorded_event) is recorded now on the current stream of `device`, the call's launch stream, and whose
// extra_tensors are `extra` (a new reference, taken over; nullptr: making it failed, the error is set).
PyObject* call_event(const portep::ll_torch::CallContext& ctx, bool async_finish, PyObject* extra, int device) {
  if (async_finish && !extra) return nullptr;
  PyObject* overlap = new_event(ctx.event_type);
  if (!async_finish || !overlap) {
    Py_XDECREF(extra);
    return overlap;
  }
  static PyObject* const event_attr = PyUnicode_InternFromString("event");
  static PyObject* const extra_attr = PyUnicode_InternFromString("extra_tensors");
  if ((!event_attr || !extra_attr) && !PyErr_Occurred()) PyErr_NoMemory();
  PyObject* event = event_attr && extra_attr ? portep::ll_torch::new_recorded_event(device) : nullptr;
  const bool set =
      event && PyObject_SetAttr(overlap, event_attr, event) == 0 && PyObject_SetAttr(overlap, extra_attr, extra) == 0;
  Py_XDECREF(event);
  Py_DECREF(extra);
  if (set) return overlap;
  Py_DECREF(overlap);
  return nullptr;
}

// A hooked call's results and receive phase (args: the launch's); else results as returned() gives them.
template <class Args>
PyObject* finish(const LLPlanTable& table, PyObject* results, bool hook, const Args& args, PyObject* keep,
                 portep::ll_torch::RecvPhase* hooked) {
  if (!hook) {
    Py_XDECREF(keep);
    return returned(table, results);
  }
  if (!results || !keep) {
    Py_XDECREF(results);
    Py_XDECREF(keep);
    return nullptr;
  }
  if constexpr (std::is_same_v<Args, LLCombineArgs>) {
    hooked->is_combine = true;
    hooked->combine = args;
  } else {
    hooked->dispatch = args;
  }
  hooked->keep = keep;
  return results;
}

PyObject* dispatch_call(LLPlanTable* table, PyObject* const* args, const portep::ll_torch::CallContext& ctx,
                        portep::ll_torch::RecvPhase* hooked, bool* launched) {
  using namespace portep::ll_torch;
  long T, E;
  bool fp8, round_scale, ue8m0, async_finish, hook;
  PyObject* x_arg = args[kDispatchX];
  if (!table || !call_mode(args[kDispatchAsyncFinish], args[kDispatchRecvHook], &async_finish, &hook) ||
      !is_int(args[kDispatchTokens], &T) || !is_int(args[kDispatchExperts], &E) ||
      !is_bool(args[kDispatchUseFp8], &fp8) || !is_bool(args[kDispatchRoundScale], &round_scale) ||
      !is_bool(args[kDispatchUseUe8m0], &ue8m0) || !THPVariable_CheckExact(x_arg))
    Py_RETURN_NONE;
  const int dev = table->device, R = table->num_ranks;
  const at::Tensor& xv = THPVariable_Unpack(x_arg);
  const int64_t hidden = xv.dim() == 2 ? xv.size(1) : 0;
  LLPlan* plan = table->find(int(T), int(hidden), int(E));
  if (!plan || !(plan->checked >> portep::cuda::ll_fp8_combo(fp8, round_scale, ue8m0) & 1u)) Py_RETURN_NONE;
  const at::Tensor *x = nullptr, *idx = nullptr;
  const int64_t E_l = E / R, M = R * T, H = hidden;
  void *cumulative = nullptr, *wait = nullptr;
  if (!is_tensor(x_arg, at::kBFloat16, {kAnySize, H}, dev, &x) || x->size(0) > T ||
      !is_tensor(args[kDispatchTopkIdx], at::kLong, {x->size(0), kAnySize}, dev, &idx) || idx->size(1) < 1 ||
      idx->size(1) > kMaxTopk || !is_optional_tensor(args[kDispatchRecvStats], at::kInt, E_l, dev, &cumulative) ||
      !is_optional_tensor(args[kDispatchWaitStats], at::kLong, R, dev, &wait) || !table->healthy())
    Py_RETURN_NONE;
  void* stream;
  if (!current_gpu(dev, &stream)) Py_RETURN_NONE;

  // The outputs in one allocation (each costs about a microsecond, with its free), each part a tensor of its own:
  //   [recv_x [E_l][M][H]] (512-byte aligned, as an allocation of its own would be)
  //   [scales, FP8 only: [E_l][S][M], returned as DeepEP's [E_l, M, S] view][recv_count [E_l]]
  //   [src_info [E_l][M]][layout_range [E_l][R]], each part 16-byte aligned
  const int64_t S = !fp8 ? 0 : ue8m0 ? H / 512 : H / 128;  // UE8M0: four exponents packed per int32
  const int64_t scales_at = align_to(E_l * M * H * (fp8 ? 1 : 2), 512), count_at = scales_at + align16(E_l * S * M * 4),
                info_at = count_at + align16(E_l * 4), range_at = info_at + align16(E_l * M * 4),
                bytes = range_at + E_l * R * 8;
  const at::Tensor outputs = gpu_bytes(bytes);
  const at::Tensor recv_x = part_of(outputs, fp8 ? at::kFloat8_e4m3fn : at::kBFloat16, {E_l, M, H}, {M * H, H, 1}, 0);
  at::Tensor scales;
  if (fp8) scales = part_of(outputs, ue8m0 ? at::kInt : at::kFloat, {E_l, M, S}, {S * M, 1, M}, scales_at);
  const at::Tensor recv_count = part_of(outputs, at::kInt, {E_l}, {1}, count_at);
  const at::Tensor src_info = part_of(outputs, at::kInt, {E_l, M}, {M, 1}, info_at);
  const at::Tensor layout_range = part_of(outputs, at::kLong, {E_l, R}, {R, 1}, range_at);

  LLDispatchArgs a{};
  a.c = ll_call_common(plan->dispatch[table->take_half()], stream, ctx.seq);
  a.x = x->data_ptr();
  a.topk_idx = idx->data_ptr<int64_t>();
  a.num_tokens = int(x->size(0));
  a.num_topk = int(idx->size(1));
  a.use_fp8 = fp8;
  a.round_scale = round_scale;
  a.use_ue8m0 = ue8m0;
  a.recv_x = recv_x.data_ptr();
  a.recv_scales = fp8 ? scales.data_ptr() : nullptr;
  a.recv_count = recv_count.data_ptr<int32_t>();
  a.src_info = src_info.data_ptr<int32_t>();
  a.layout_range = layout_range.data_ptr<int64_t>();
  a.cumulative_stats = static_cast<int32_t*>(cumulative);
  a.wait_stats = static_cast<int64_t*>(wait);
  *launched = true;
  const int phases = hook ? portep::cuda::kPhaseSend : portep::cuda::kPhaseSend | portep::cuda::kPhaseRecv;
  if (int err = table->launch_dispatch(a, phases)) return launch_failed(*table, "low-latency dispatch", err);

  PyObject* out_x = fp8 ? tuple_of({wrap(recv_x), wrap(scales)}) : wrap(recv_x);
  PyObject* handle =
      as_tuple_type(ctx.handle_type, tuple_of({wrap(src_info), wrap(layout_range), new_ref(args[kDispatchTokens]),
                                               PyLong_FromLong(long(H)), new_ref(args[kDispatchExperts])}));
  // the full path's extra tensors of an async_finish call; with a hook, what the receive phase reads or writes
  auto tensors = [&] {
    return tuple_of({new_ref(x_arg), new_ref(args[kDispatchTopkIdx]), wrap(recv_x),
                     fp8 ? wrap(scales) : new_ref(Py_None), wrap(recv_count), wrap(src_info), wrap(layout_range),
                     new_ref(args[kDispatchRecvStats])});
  };
  PyObject* keep = hook ? tuple_of({tensors(), new_ref(args[kDispatchWaitStats])}) : nullptr;
  PyObject* event = call_event(ctx, async_finish, async_finish ? tensors() : nullptr, dev);
  return finish(*table, tuple_of({out_x, wrap(recv_count), handle, event, new_ref(Py_None)}), hook, a, keep, hooked);
}

PyObject* combine_call(LLPlanTable* table, PyObject* const* args, const portep::ll_torch::CallContext& ctx,
                       portep::ll_torch::RecvPhase* hooked, bool* launched) {
  using namespace portep::ll_torch;
  PyObject* handle = args[kCombineHandle];  // a tuple or an LLHandle
  long T, H, E;
  bool zero_copy, logfmt, async_finish, hook;
  if (!table || !call_mode(args[kCombineAsyncFinish], args[kCombineRecvHook], &async_finish, &hook) ||
      !PyTuple_Check(handle) || PyTuple_GET_SIZE(handle) != 5 || !is_int(PyTuple_GET_ITEM(handle, 2), &T) ||
      !is_int(PyTuple_GET_ITEM(handle, 3), &H) || !is_int(PyTuple_GET_ITEM(handle, 4), &E) ||
      !is_bool(args[kCombineZeroCopy], &zero_copy) || !is_bool(args[kCombineLogfmt], &logfmt) ||
      (logfmt && (zero_copy || !portep::logfmt_hidden_ok(int(H)))))  // the full path refuses these
    Py_RETURN_NONE;
  LLPlan* plan = table->find(int(T), int(H), int(E));
  if (!plan || !(plan->checked & portep::cuda::kCombineChecked)) Py_RETURN_NONE;
  const int dev = table->device, R = table->num_ranks;
  const int64_t E_l = E / R, M = R * T;
  const at::Tensor *x = nullptr, *idx = nullptr, *weights = nullptr, *src_info = nullptr, *range = nullptr,
                   *out = nullptr;
  void* wait = nullptr;
  PyObject* out_arg = args[kCombineOut];
  if (!is_tensor(args[kCombineX], at::kBFloat16, {E_l, M, H}, dev, &x) ||
      !is_tensor(args[kCombineTopkIdx], at::kLong, {kAnySize, kAnySize}, dev, &idx) || idx->size(0) > T ||
      idx->size(1) < 1 || idx->size(1) > kMaxTopk ||
      !is_tensor(args[kCombineWeights], at::kFloat, {idx->size(0), idx->size(1)}, dev, &weights) ||
      !is_tensor(PyTuple_GET_ITEM(handle, 0), at::kInt, {E_l, M}, dev, &src_info) ||
      !is_tensor(PyTuple_GET_ITEM(handle, 1), at::kLong, {E_l, R}, dev, &range) ||
      !(out_arg == Py_None || is_tensor(out_arg, at::kBFloat16, {idx->size(0), H}, dev, &out)) ||
      !is_optional_tensor(args[kCombineWaitStats], at::kLong, R, dev, &wait) || !table->healthy())
    Py_RETURN_NONE;
  void* stream;
  if (!current_gpu(dev, &stream)) Py_RETURN_NONE;
  const int64_t N = idx->size(0);
  const at::Tensor result = out ? *out : part_of(gpu_bytes(N * H * 2), at::kBFloat16, {N, H}, {H, 1}, 0);
  LLCombineArgs a{};
  a.c = ll_call_common(plan->combine[table->take_half()], stream, ctx.seq);
  a.zero_copy = zero_copy;
  ll_set_combine_logfmt(&a, logfmt);
  ll_set_combine_rows(&a, x->data_ptr());
  a.src_info = src_info->data_ptr<int32_t>();
  a.layout_range = range->data_ptr<int64_t>();
  a.topk_idx = idx->data_ptr<int64_t>();
  a.topk_weights = weights->data_ptr<float>();
  a.num_tokens = int(idx->size(0));
  a.num_topk = int(idx->size(1));
  a.out = result.data_ptr();
  a.out_pitch = uint64_t(H) * 2;
  a.wait_stats = static_cast<int64_t*>(wait);
  *launched = true;
  const int phases = hook ? portep::cuda::kPhaseSend : portep::cuda::kPhaseSend | portep::cuda::kPhaseRecv;
  if (int err = table->launch_combine(a, phases)) return launch_failed(*table, "low-latency combine", err);

  auto combined = [&] { return out ? new_ref(out_arg) : wrap(result); };
  // the full path's extra tensors of an async_finish call; with a hook, what the receive phase reads or writes
  auto tensors = [&] {
    return tuple_of({new_ref(args[kCombineX]), new_ref(args[kCombineTopkIdx]), new_ref(args[kCombineWeights]),
                     new_ref(PyTuple_GET_ITEM(handle, 0)), new_ref(PyTuple_GET_ITEM(handle, 1)), combined()});
  };
  PyObject* keep = hook ? tuple_of({tensors(), new_ref(args[kCombineWaitStats])}) : nullptr;
  PyObject* event = call_event(ctx, async_finish, async_finish ? tensors() : nullptr, dev);
  return finish(*table, tuple_of({combined(), event, new_ref(Py_None)}), hook, a, keep, hooked);
}

using Call = PyObject* (*)(LLPlanTable*, PyObject* const*, const portep::ll_torch::CallContext&,
                           portep::ll_torch::RecvPhase*, bool*);

// Runs a call so that nothing escapes but its results, None or a RuntimeError: an error before the launch (a C++
// exception, e.g. an allocation that failed or a tensor whose data cannot be reached, or a Python error raised
// inside torch) declines the call, which the full path then runs or refuses as torch would; one after the launch was
// tried is the call's failure, raised as RuntimeError (the caller counts the call then).
PyObject* guarded(Call call, LLPlanTable* table, PyObject* const* args, const portep::ll_torch::CallContext& ctx,
                  portep::ll_torch::RecvPhase* hooked) {
  bool launched = false;
  PyObject* out = nullptr;
  std::string error;
  try {
    out = call(table, args, ctx, hooked, &launched);
  } catch (const std::exception& e) {
    error = e.what();
  } catch (...) {
    error = "an unknown C++ exception";
  }
  if (out) return out;
  if (!launched) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  if (error.empty() && PyErr_ExceptionMatches(PyExc_RuntimeError)) return nullptr;  // the launch's own error
  if (error.empty()) {  // building the results failed (out of memory): the call's failure all the same
    PyObject *type, *value, *trace;
    PyErr_Fetch(&type, &value, &trace);
    PyObject* text = value ? PyObject_Str(value) : nullptr;
    error = text && PyUnicode_Check(text) ? PyUnicode_AsUTF8(text) : "a Python error";
    Py_XDECREF(text);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(trace);
  }
  PyErr_SetString(PyExc_RuntimeError, ("a low-latency call failed after its launch: " + error).c_str());
  return nullptr;
}

}  // namespace

namespace portep::ll_torch {

c10::Stream current_stream(int device) {
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)
      ->getStream(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
}

PyObject* run_dispatch(LLPlanTable* table, PyObject* const* args, const CallContext& ctx, RecvPhase* hooked) {
  return guarded(&dispatch_call, table, args, ctx, hooked);
}

PyObject* run_combine(LLPlanTable* table, PyObject* const* args, const CallContext& ctx, RecvPhase* hooked) {
  return guarded(&combine_call, table, args, ctx, hooked);
}

}  // namespace portep::ll_torch
