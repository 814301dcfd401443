// A Buffer's prepared low-latency calls: for each call signature (T, hidden, num_experts) the kernels' constants of
// both buffer halves, so a call adds only its tensors, its stream and its sequence number. The bindings' LLKernels
// (python/src/bind_cuda_ll.cpp) own the table; the torch fast path (python/src/ll_torch_path.cpp), a separate module
// without kernels of its own, receives it in a versioned LLShared capsule (python/src/ll_shared.h) and launches
// through its function pointers (launch_dispatch and launch_combine choose between a cached CUDA graph and a kernel
// launch for both).
#pragma once

#include <stdint.h>

#include <atomic>

#include "gpu_kernels/cuda/ll_api.h"

namespace portep::cuda {

// The dispatch flags (use_fp8, round_scale, use_ue8m0) as a bit index.
constexpr int ll_fp8_combo(bool use_fp8, bool round_scale, bool use_ue8m0) {
  return int(use_fp8) | int(round_scale) << 1 | int(use_ue8m0) << 2;
}
constexpr uint32_t kCombineChecked = 1u << 8;  // in LLPlan::checked: a combine of this signature passed the checks

struct LLPlan {
  int T = 0, hidden = 0, num_experts = 0;
  uint32_t checked = 0;              // bit ll_fp8_combo(...): a dispatch with those flags passed Python's checks
  LLCommon dispatch[2], combine[2];  // per buffer half; stream and seq are the call's
};

// A plan's constants for one call: its stream (cudaStream_t) and sequence number.
inline LLCommon ll_call_common(const LLCommon& planned, void* stream, uint32_t seq) {
  LLCommon c = planned;
  c.stream = stream;
  c.seq = seq;
  return c;
}

// LogFMT rows (use_logfmt) go to every peer, each a row of its own: no partial sums between direct peers.
inline void ll_set_combine_logfmt(LLCombineArgs* a, bool use_logfmt) {
  a->use_logfmt = use_logfmt;
  if (use_logfmt) a->c.meta_off = 0;
}

// Where a combine reads the expert outputs (a->c and a->zero_copy set): x, rows of 2H bytes; or with zero_copy this
// half's send area, where get_next_low_latency_combine_buffer's view put them, rows of comb_pitch bytes.
inline void ll_set_combine_rows(LLCombineArgs* a, const void* x) {
  const LLCommon& c = a->c;
  a->x = a->zero_copy ? static_cast<const void*>(c.local + c.send_off) : x;
  a->x_pitch = a->zero_copy ? c.comb_pitch : uint64_t(c.hidden) * 2;
}

struct LLPlanTable {
  static constexpr int kMaxPlans = 64;
  LLPlan plans[kMaxPlans];
  int count = 0;
  uint32_t next_victim = 0;
  uint32_t half = 0;  // the buffer half the next LL call uses; every call flips it
  int device = -1, num_ranks = 0;
  const KernelError* errors = nullptr;  // host view of the mapped records [kNumErrorWords]: [0] failures, [1] notices
  const std::atomic<bool>* proxies_failed = nullptr;  // a proxy thread latched an error
  int (*dispatch_fn)(const LLDispatchArgs&, int) = nullptr;
  int (*combine_fn)(const LLCombineArgs&, int) = nullptr;
  const char* (*error_string)(int) = nullptr;
  // Graph launches (ll_api.h, LLGraphs; null graphs: kernel launches only) and the chain they read the call's
  // sequence number from. The last launch that sent, if an eager one of this table, left chain_seq in the word of
  // half chain_half; else chain_seq is kNoChain. A call launches as a graph only if it is that half's call with that
  // number (the host's), so a graph-launched call carries the number a kernel launch would have.
  LLGraphs* graphs = nullptr;
  int (*dispatch_graphed_fn)(LLGraphs*, const LLDispatchArgs&) = nullptr;
  int (*combine_graphed_fn)(LLGraphs*, const LLCombineArgs&) = nullptr;
  int (*capturing_fn)(void*, bool*) = nullptr;
  static constexpr uint32_t kNoChain = 0;  // no call has this number (lockstep.wire_seq starts at 1)
  uint32_t chain_half = 0, chain_seq = kNoChain;
  int graph_error = 0;  // the first error that turned graph launches off

  LLPlan* find(int T, int hidden, int num_experts) {
    for (int i = 0; i < count; ++i) {
      LLPlan& p = plans[i];
      if (p.T == T && p.hidden == hidden && p.num_experts == num_experts) return &p;
    }
    return nullptr;
  }
  // Nothing the host must raise first: no kernel failure recorded, no proxy error latched (and not closed).
  bool healthy() const {
    return errors && proxies_failed && __atomic_load_n(&errors[0].code, __ATOMIC_ACQUIRE) == 0 &&
           !proxies_failed->load(std::memory_order_acquire);
  }
  bool notice_pending() const { return errors && __atomic_load_n(&errors[1].code, __ATOMIC_ACQUIRE) != 0; }
  // The Buffer's memory went away (close): nothing may launch any more.
  bool closed() const { return errors == nullptr; }
  // The Buffer's memory goes away: no plan is found and nothing is read any more.
  void close() {
    count = 0;
    errors = nullptr;
    proxies_failed = nullptr;
    graphs = nullptr;
  }
  uint32_t take_half() {
    const uint32_t h = half;
    half ^= 1;
    return h;
  }
  void reset_half() {
    half = 0;
    chain_seq = kNoChain;  // the chain's words follow the halves (and are zeroed): the next call writes it afresh
  }
  // Launches a call (a.c from ll_call_common) as a graph where it can (both phases, not under capture, the chain
  // holding its number), else as a kernel; the launch's error (0: launched).
  int launch_dispatch(LLDispatchArgs& a, int phases) { return launch(a, phases, dispatch_fn, dispatch_graphed_fn); }
  int launch_combine(LLCombineArgs& a, int phases) { return launch(a, phases, combine_fn, combine_graphed_fn); }

 private:
  template <class Args>
  int launch(Args& a, int phases, int (*kernel_fn)(const Args&, int), int (*graph_fn)(LLGraphs*, const Args&)) {
    bool capturing = true;
    if (!capturing_fn || capturing_fn(a.c.stream, &capturing) != 0) capturing = true;  // unknown: as if captured
    if (!capturing && a.c.half == chain_half && a.c.seq == chain_seq && graphs && graph_fn &&
        phases == (kPhaseSend | kPhaseRecv)) {
      a.c.seq_mode = kSeqFromChain | kSeqWriteChain;
      const int err = graph_fn(graphs, a);
      if (err == 0) {
        chained(a.c);
        return 0;
      }
      if (err != kGraphDeclined) {  // nothing was queued: the kernel launch below, and from now on
        graphs = nullptr;
        if (!graph_error) graph_error = err;  // the first: turning graphs on again does not clear it
      }
    }
    a.c.seq_mode = !capturing && (phases & kPhaseSend) ? kSeqWriteChain : 0;
    const int err = kernel_fn(a, phases);
    if (!(phases & kPhaseSend)) return err;
    if (err == 0 && !capturing)
      chained(a.c);
    else
      chain_seq = kNoChain;
    return err;
  }
  // What the launch of call c left in the chain (ll_common.cuh, ll_call_seq).
  void chained(const LLCommon& c) {
    chain_half = c.half ^ 1u;
    chain_seq = c.seq == 0xFFFFFFFFu ? 1u : c.seq + 1u;
  }
};

}  // namespace portep::cuda
