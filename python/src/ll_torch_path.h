// portep._ll_torch inside: the two phases of an LL call (ll_torch_path.cpp) behind the Python entries that Buffer's
// methods become (ll_torch_calls.cpp), and the receive hooks of hooked calls (ll_torch_hook.cpp). Each run_* takes the
// call's arguments in the order of Buffer's signature (python/portep/buffer.py), already bound to their parameters, and
// returns:
//   - the call's results, or [results] when a kernel reported a notice (raised with them by the caller; a hooked
//     call's notice is its hook's to raise);
//   - None, a new reference, when it declined the call before anything happened (the full path then runs it);
//   - nullptr with a RuntimeError set once the launch was tried and failed, or building the results failed after it.
#pragma once

#include <Python.h>
#include <c10/core/Stream.h>

#include <stdint.h>

#include "gpu_kernels/cuda/ll_plan.h"
#include "python/src/ll_shared.h"

namespace portep::ll_torch {

// Buffer.low_latency_dispatch's parameters after self, in order.
enum DispatchArg {
  kDispatchX,
  kDispatchTopkIdx,
  kDispatchTokens,
  kDispatchExperts,
  kDispatchRecvStats,
  kDispatchWaitStats,
  kDispatchUseFp8,
  kDispatchRoundScale,
  kDispatchUseUe8m0,
  kDispatchAsyncFinish,
  kDispatchRecvHook,
  kDispatchArgCount
};

// Buffer.low_latency_combine's parameters after self, in order.
enum CombineArg {
  kCombineX,
  kCombineTopkIdx,
  kCombineWeights,
  kCombineHandle,
  kCombineLogfmt,
  kCombineZeroCopy,
  kCombineAsyncFinish,
  kCombineRecvHook,
  kCombineOut,
  kCombineWaitStats,
  kCombineArgCount
};

// What a call needs besides its arguments: its sequence number as the kernels carry it (lockstep.wire_seq), the
// class whose new instance without an event is the EventOverlap of a call without async_finish (with async_finish,
// the instance gets new_recorded_event's event and the call's tensors), and the tuple subclass a dispatch's handle is
// made of (portep.handles.LLHandle; nullptr: a plain tuple).
struct CallContext {
  uint32_t seq;
  PyObject* event_type;
  PyObject* handle_type;
};

// The receive phase of a call made with return_recv_hook=True, which launched only its send phase: the launch's
// arguments (their stream is the hook's) and the tensors they point into.
struct RecvPhase {
  bool is_combine = false;
  portep::cuda::LLDispatchArgs dispatch{};
  portep::cuda::LLCombineArgs combine{};
  PyObject* keep = nullptr;  // a new reference, set only for a hooked call: the tensors the phase reads or writes
};

// A hooked call's results end with None where its hook goes: the caller puts new_recv_hook's there.
PyObject* run_dispatch(portep::cuda::LLPlanTable* table, PyObject* const* args, const CallContext& ctx,
                       RecvPhase* hooked);
PyObject* run_combine(portep::cuda::LLPlanTable* table, PyObject* const* args, const CallContext& ctx,
                      RecvPhase* hooked);

// What a receive hook refers to: its Buffer's plan table and lockstep counters, the capsule that keeps both alive,
// the engine's Lockstep (fail) and raise_notice, and the call's name.
struct HookOwner {
  portep::cuda::LLPlanTable* table;
  portep::LockstepState* state;
  PyObject* shared;
  PyObject* lockstep;
  PyObject* raise_notice;
  PyObject* what;
};

// torch's current stream on GPU `device` (a CUDA stream; a HIP one under ROCm's torch, whose GPUs are CUDA devices to
// torch): where the calls, the hooks and the events of async_finish calls launch or record (ll_torch_path.cpp).
c10::Stream current_stream(int device);

// With an error set: the Buffer is out of step (lockstep.fail(what, error), as the full path's failed calls and hooks
// do; skipped where lockstep is null), and the error stays set to be raised; returns nullptr (ll_torch_calls.cpp).
PyObject* fail_out_of_step(PyObject* lockstep, PyObject* what);

// The hook of a hooked call (ll_torch_hook.cpp), taking over phase.keep: called once, it launches the receive phase
// on the current stream of the table's GPU, then raises a notice pending (raise_notice()), as the full path's hook
// does; a launch that fails marks the Buffer out of step (lockstep.fail(what, error)) and raises. A second call, or
// one after the Buffer was destroyed, raises and launches nothing.
PyObject* new_recv_hook(RecvPhase&& phase, const HookOwner& owner);
bool recv_hook_type_ready();  // at module init

// An async_finish call's event (ll_torch_event.cpp, type portep._ll_torch.Event), recorded now on the current stream
// of `device`: the full path's CudaEvent's methods (current_stream_wait, query, synchronize); a RuntimeError set
// and nullptr where the backend fails.
PyObject* new_recorded_event(int device);
bool event_type_ready();  // at module init

}  // namespace portep::ll_torch
