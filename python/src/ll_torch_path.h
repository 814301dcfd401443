// portep._ll_torch inside: the two phases of an LL call (ll_torch_path.cpp) behind the Python entries that Buffer's
// methods become (ll_torch_calls.cpp). Each run_* takes the call's arguments in the order of Buffer's signature
// (python/portep/buffer.py), already bound to their parameters, and returns:
//   - the call's results, or [results] when a kernel reported a notice (raised with them by the caller);
//   - None, a new reference, when it declined the call before anything happened (the full path then runs it);
//   - nullptr with a RuntimeError set once the launch was tried and failed, or building the results failed after it.
#pragma once

#include <Python.h>

#include <stdint.h>

#include "gpu_kernels/cuda/ll_plan.h"

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

// seq: the call's sequence number as the kernels carry it (lockstep.wire_seq); event_type: the class whose new
// instance without an event is the call's EventOverlap.
PyObject* run_dispatch(portep::cuda::LLPlanTable* table, PyObject* const* args, uint32_t seq, PyObject* event_type);
PyObject* run_combine(portep::cuda::LLPlanTable* table, PyObject* const* args, uint32_t seq, PyObject* event_type);

}  // namespace portep::ll_torch
