// Bindings of the CUDA low-latency kernels and their device setup (built with the CUDA kernels only).
#ifdef PORTEP_WITH_GPU
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <iterator>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>

#include "gpu_kernels/cuda/api.h"
#include "gpu_kernels/cuda/ht_api.h"
#include "gpu_kernels/cuda/ll_api.h"
#include "gpu_kernels/cuda/ll_plan.h"
#include "gpu_kernels/ll_layout.h"
#include "proxy/channel.h"
#include "python/src/bind_util.h"
#include "python/src/ll_shared.h"
#include "python/src/mapped_host.h"
#include "python/src/peer_table.h"
#include "python/src/tensor_arg.h"

namespace py = pybind11;
using namespace portep::cuda;

namespace {

using portep::ll_half_layout;
using portep::LLHalfLayout;
using portep::bind::check;
using portep::bind::GpuTensors;
using portep::bind::MappedHost;
using portep::bind::ptr;
using portep::bind::PyFifoSet;

// A Buffer's LL kernels: the per-Buffer constants (LLCommon) and the table of prepared call signatures
// (ll_plan.h), which the torch fast path reads through the LLShared capsule (ll_shared).
class LLKernels {
 public:
  struct Setup {
    int rank, num_ranks, max_local_experts, num_direct;
    uint64_t num_bytes;    // the LL buffer and the normal mode's area; LLRegion's flags and meta blocks follow
    uint32_t stream_base;  // the first LL signal stream
    int device;
  };

  LLKernels(const Setup& s, LLCommon base, const KernelError* error_host, portep::Channel& channel)
      : setup_(s), region_{s.num_bytes, s.num_ranks, s.max_local_experts}, table_(new LLPlanTable) {
    base.rank = s.rank;
    base.num_ranks = s.num_ranks;
    base.meta_stride = kMetaStride;
    base_ = base;
    table_->device = s.device;
    table_->num_ranks = s.num_ranks;
    table_->errors = error_host;
    table_->proxies_failed = channel.proxies().failed_flag();
    table_->dispatch_fn = &ll_dispatch;
    table_->combine_fn = &ll_combine;
    table_->error_string = &cuda_error_string;
    table_->dispatch_graphed_fn = &ll_dispatch_graphed;
    table_->combine_graphed_fn = &ll_combine_graphed;
    table_->capturing_fn = &stream_capturing;
    table_->graphs = graphs_.get();
  }

  // Graph launches on or off (ll_api.h, LLGraphs; off where the build has no graph cache, as under HIP). Turned
  // off by the table itself after a graph launch failed (graph_error).
  bool graph_launch() const { return table_->graphs != nullptr; }
  void set_graph_launch(bool on) { table_->graphs = on ? graphs_.get() : nullptr; }
  py::dict graph_counts() const {
    const LLGraphCounts n = ll_graph_counts(graphs_.get());
    py::dict d;
    d["launches"] = n.launches;
    d["builds"] = n.builds;
    d["updates"] = n.updates;
    d["error"] = table_->graph_error;
    return d;
  }
  void close() {
    table_->close();
    graphs_.reset();  // an executable graph still queued is freed when it completes (CUDA's rule)
  }

  // The plan of signature (T, hidden, num_experts), made on first use (python checked the signature first).
  LLPlan& plan(int T, int hidden, int num_experts) {
    if (LLPlan* p = table_->find(T, hidden, num_experts)) return *p;
    LLPlan& p = table_->count < LLPlanTable::kMaxPlans
                    ? table_->plans[table_->count++]
                    : table_->plans[table_->next_victim++ % uint32_t(LLPlanTable::kMaxPlans)];
    p = LLPlan{};
    p.T = T;
    p.hidden = hidden;
    p.num_experts = num_experts;
    const LLHalfLayout lay = ll_half_layout(T, hidden, num_experts, setup_.num_ranks);
    // combine partials between direct peers while the meta blocks have room (ll_api.h); else rows to every peer
    const bool partials = T <= kMetaTokens && setup_.num_direct > 1;
    for (int half = 0; half < 2; ++half) {
      p.dispatch[half] = shaped(lay, half, 0, 0);
      p.combine[half] = shaped(lay, half, 1, partials ? region_.meta_off(half) : 0);
    }
    return p;
  }

  LLPlanTable& table() { return *table_; }

 private:
  LLCommon shaped(const LLHalfLayout& lay, int half, int phase, uint64_t meta_off) const {
    LLCommon c = base_;
    c.T = lay.T;
    c.hidden = lay.H;
    c.num_experts = lay.E;
    c.num_local_experts = lay.E_l;
    c.send_off = lay.send_off(half);
    c.recv_off = lay.recv_off(half);
    c.flag_off = region_.flag_off(half, phase);
    c.disp_bytes = uint32_t(lay.disp_bytes);
    c.comb_pitch = uint32_t(lay.comb_pitch);
    c.stream_base = setup_.stream_base + uint32_t((half * 2 + phase) * setup_.max_local_experts);
    c.meta_off = meta_off;
    c.half = uint32_t(half);
    return c;
  }

  Setup setup_;
  LLRegion region_;
  LLCommon base_{};
  std::unique_ptr<LLPlanTable> table_;
  struct GraphsDeleter {
    void operator()(LLGraphs* g) const { ll_graphs_destroy(g); }
  };
  std::unique_ptr<LLGraphs, GraphsDeleter> graphs_{ll_graphs_create()};
};

// A tensor argument of the engine's keyword arguments, checked as GpuTensors checks it (tensor_arg.h): on the
// Buffer's GPU, contiguous, of its dtype and with at least `entries` elements; None only where optional. Python passes
// tensors, never addresses.
struct KwTensors {
  const py::kwargs& kw;
  GpuTensors tensors;
  template <class T>
  T* get(const char* name, const char* dtype, int64_t entries, bool optional = false) {
    return tensors.entries<T>(kw[name], name, dtype, entries, portep::bind::Entries::kAtLeast, optional);
  }
};

// LLCommon's per-Buffer pointers and limits, from the engine's keyword arguments: its tensors (each checked for the
// Buffer's GPU, dtype and size), the Channel's memory, the FIFOs; the scratch laid out by LLScratch.
LLCommon common_from(const py::kwargs& kw, int device) {
  KwTensors t{kw, GpuTensors("LLKernels", device)};
  const int R = kw["num_ranks"].cast<int>();
  const LLScratch scratch{R, kw["max_local_experts"].cast<int>()};
  LLCommon c{};
  const portep::Channel& channel = kw["channel"].cast<const portep::Channel&>();
  c.local = static_cast<uint8_t*>(channel.device_address(portep::kRegionData));
  c.host_signals = static_cast<uint64_t*>(channel.device_address(portep::kRegionSignal));
  if (!c.local || !c.host_signals) throw std::invalid_argument("channel: not connected (no device memory)");
  c.peers = t.get<uint8_t* const>("peers", "int64", R);
  c.place = t.get<uint8_t* const>("place", "int64", R);
  c.num_streams = kw["num_streams"].cast<uint32_t>();
  c.signal_seen = t.get<uint64_t>("signal_seen", "int64", int64_t(R) * c.num_streams);
  const PyFifoSet& fifos = kw["fifos"].cast<const PyFifoSet&>();
  c.fifos = fifos.set_.device_views;
  c.fifo_tails = fifos.set_.device_tails;
  c.num_fifos = fifos.set_.count;
  uint32_t* words = t.get<uint32_t>("scratch", "int32", scratch.words());
  c.finish = words;
  c.chunk_done = words + scratch.chunk_done();
  c.proxy_begin = words + scratch.proxy_begin();
  c.max_chunks = int(scratch.max_chunks());
  c.dest_done = words + scratch.dest_done();
  c.seq_chain = words + scratch.seq_chain();
  const auto& errors = kw["errors"].cast<const MappedHost&>();
  c.error = static_cast<KernelError*>(errors.device(sizeof(KernelError) * kNumErrorWords, "errors"));
  c.failed = t.get<uint32_t>("failed", "int32", kNumErrorWords);
  const py::object status = kw["peer_status"];  // None: no peer watch
  if (!status.is_none())
    c.peer_status =
        static_cast<const uint32_t*>(status.cast<const MappedHost&>().device(4 * uint64_t(R), "peer_status"));
  c.mask = t.get<uint32_t>("mask", "int32", R, true);
  c.send_mask = t.get<const uint32_t>("send_mask", "int32", R, true);
  c.timeout_ns = uint64_t(kw["timeout_s"].cast<double>() * 1e9);
  c.num_sms = kw["num_sms"].cast<int>();
  if (!c.mask != !c.send_mask) throw std::invalid_argument("mask and send_mask: both (shrink mode) or neither");
  return c;
}

const char* const kLLKernelsKeywords[] = {
    "rank",        "num_ranks", "max_local_experts", "num_direct",  "num_bytes", "stream_base", "device", "channel",
    "peers",       "place",     "signal_seen",       "num_streams", "fifos",     "scratch",     "errors", "failed",
    "peer_status", "mask",      "send_mask",         "timeout_s",   "num_sms"};

std::unique_ptr<LLKernels> make_ll_kernels(const py::kwargs& kw) {
  for (const char* k : kLLKernelsKeywords)
    if (!kw.contains(k)) throw std::invalid_argument(std::string("LLKernels: keyword argument '") + k + "' missing");
  if (kw.size() != std::size(kLLKernelsKeywords))
    throw std::invalid_argument("LLKernels: unexpected keyword arguments (takes " +
                                std::to_string(std::size(kLLKernelsKeywords)) + ")");
  LLKernels::Setup s{
      kw["rank"].cast<int>(),       kw["num_ranks"].cast<int>(),      kw["max_local_experts"].cast<int>(),
      kw["num_direct"].cast<int>(), kw["num_bytes"].cast<uint64_t>(), kw["stream_base"].cast<uint32_t>(),
      kw["device"].cast<int>()};
  const auto* error_host = static_cast<const KernelError*>(
      kw["errors"].cast<const MappedHost&>().host(sizeof(KernelError) * kNumErrorWords, "errors"));
  return std::make_unique<LLKernels>(s, common_from(kw, s.device), error_host, kw["channel"].cast<portep::Channel&>());
}

void dispatch(LLPlanTable& table, const LLPlan& p, int half, int phases, uintptr_t stream, uint32_t seq,
              const py::kwargs& kw) {
  KwTensors t{kw, GpuTensors("low-latency dispatch", table.device)};
  LLDispatchArgs a{};
  a.c = ll_call_common(p.dispatch[half], reinterpret_cast<void*>(stream), seq);
  a.num_tokens = kw["num_tokens"].cast<int>();
  a.num_topk = kw["num_topk"].cast<int>();
  a.use_fp8 = kw["use_fp8"].cast<bool>();
  a.round_scale = kw["round_scale"].cast<bool>();
  a.use_ue8m0 = kw["use_ue8m0"].cast<bool>();
  const int64_t N = a.num_tokens, H = a.c.hidden, E_l = a.c.num_local_experts, R = a.c.num_ranks, M = R * a.c.T;
  const int64_t S = !a.use_fp8 ? 0 : a.use_ue8m0 ? H / 512 : H / 128;  // scale entries per received row
  a.x = t.get<const void>("x", "bfloat16", N * H);
  a.topk_idx = t.get<const int64_t>("topk_idx", "int64", N * a.num_topk);
  a.recv_x = t.get<void>("recv_x", a.use_fp8 ? "float8_e4m3fn" : "bfloat16", E_l * M * H);
  a.recv_scales = t.get<void>("recv_scales", a.use_ue8m0 ? "int32" : "float32", E_l * M * S, !a.use_fp8);
  a.recv_count = t.get<int32_t>("recv_count", "int32", E_l);
  a.src_info = t.get<int32_t>("src_info", "int32", E_l * M);
  a.layout_range = t.get<int64_t>("layout_range", "int64", E_l * R);
  a.cumulative_stats = t.get<int32_t>("cumulative_stats", "int32", E_l, true);
  a.wait_stats = t.get<int64_t>("wait_stats", "int64", R, true);
  check(table.launch_dispatch(a, phases), "low-latency dispatch");
}

void combine(LLPlanTable& table, const LLPlan& p, int half, int phases, uintptr_t stream, uint32_t seq,
             const py::kwargs& kw) {
  KwTensors t{kw, GpuTensors("low-latency combine", table.device)};
  LLCombineArgs a{};
  a.c = ll_call_common(p.combine[half], reinterpret_cast<void*>(stream), seq);
  a.zero_copy = kw["zero_copy"].cast<bool>();
  ll_set_combine_logfmt(&a, kw["use_logfmt"].cast<bool>());
  a.num_tokens = kw["num_tokens"].cast<int>();
  a.num_topk = kw["num_topk"].cast<int>();
  const int64_t N = a.num_tokens, K = a.num_topk, H = a.c.hidden, E_l = a.c.num_local_experts, R = a.c.num_ranks,
                M = R * a.c.T;
  ll_set_combine_rows(&a, t.get<const void>("x", "bfloat16", E_l * M * H));  // unread with zero-copy
  a.src_info = t.get<const int32_t>("src_info", "int32", E_l * M);
  a.layout_range = t.get<const int64_t>("layout_range", "int64", E_l * R);
  a.topk_idx = t.get<const int64_t>("topk_idx", "int64", N * K);
  a.topk_weights = t.get<const float>("topk_weights", "float32", N * K);
  a.out = t.get<void>("out", "bfloat16", N * H);
  a.out_pitch = uint64_t(a.c.hidden) * 2;
  a.wait_stats = t.get<int64_t>("wait_stats", "int64", R, true);
  check(table.launch_combine(a, phases), "low-latency combine");
}

// What an LLShared capsule owns: the struct the fast path reads, and the objects it points into.
struct SharedHolder {
  portep::LLShared shared;
  py::object state, kernels;
};

// A capsule of LLShared (ll_shared.h) over `state` and, unless None, the table of `kernels`; it keeps both alive.
py::capsule ll_shared(py::object state, py::object kernels) {
  auto type_error = [](const char* arg, const char* want, const py::object& got) {
    return py::type_error(std::string("ll_shared: ") + arg + " must be " + want + ", got " +
                          py::str(py::type::of(got).attr("__name__")).cast<std::string>());
  };
  if (!py::isinstance<portep::LockstepState>(state)) throw type_error("state", "a LockstepState", state);
  if (!kernels.is_none() && !py::isinstance<LLKernels>(kernels))
    throw type_error("kernels", "an LLKernels or None", kernels);
  portep::LLShared shared;
  shared.lockstep = &state.cast<portep::LockstepState&>();
  if (!kernels.is_none()) {
    shared.table = &kernels.cast<LLKernels&>().table();
    shared.table_size = sizeof(LLPlanTable);
  }
  auto holder = std::make_unique<SharedHolder>(SharedHolder{shared, state, kernels});
  PyObject* capsule = PyCapsule_New(&holder->shared, portep::kLLSharedCapsule,
                                    [](PyObject* c) { delete static_cast<SharedHolder*>(PyCapsule_GetContext(c)); });
  if (!capsule) throw py::error_already_set();
  if (PyCapsule_SetContext(capsule, holder.get()) != 0) {
    Py_DECREF(capsule);  // its destructor finds no context and deletes nothing
    throw py::error_already_set();
  }
  holder.release();
  return py::reinterpret_steal<py::capsule>(capsule);
}

}  // namespace

void bind_cuda_ll(py::module_& m) {
  py::class_<PyFifoSet>(m, "DeviceFifoSet")
      .def(py::init<int, uint32_t>(), py::arg("count"), py::arg("capacity"))
      .def_property_readonly("count", [](const PyFifoSet& f) { return f.set_.count; })
      .def_property_readonly("host_views",
                             [](const PyFifoSet& f) { return reinterpret_cast<uintptr_t>(f.set_.host_views); })
      .def_property_readonly("device_views",
                             [](const PyFifoSet& f) { return reinterpret_cast<uintptr_t>(f.set_.device_views); });

  py::list errors;
  for (const KernelErrorInfo& e : kKernelErrors) {
    py::dict d;
    d["code"] = e.code;
    d["name"] = e.name;
    d["notice"] = e.notice;
    d["what"] = e.what;
    d["where"] = e.where;
    errors.append(d);
  }
  m.attr("KERNEL_ERRORS") = errors;
  m.attr("KERNEL_ERROR_WORDS") = kNumErrorWords;
  m.attr("KERNEL_ERROR_BYTES") = sizeof(KernelError);
  m.attr("LL_PHASE_SEND") = kPhaseSend;
  m.attr("LL_PHASE_RECV") = kPhaseRecv;
  m.attr("LL_CHUNK_EXPERTS") = kChunkExperts;
  m.attr("LL_META_TOKENS") = kMetaTokens;
  m.attr("LL_META_STRIDE") = kMetaStride;
  m.def(
      "ll_scratch_words",
      [](int num_ranks, int max_local_experts) { return LLScratch{num_ranks, max_local_experts}.words(); },
      py::arg("num_ranks"), py::arg("max_local_experts"),
      "int32 words of the LL kernels' scratch (gpu_kernels/cuda/ll_api.h, LLScratch)");
  py::class_<LLRegion>(m, "LLRegion", "what follows a Buffer's data in its region (gpu_kernels/cuda/ll_api.h)")
      .def(py::init([](uint64_t num_bytes, int num_ranks, int max_local_experts) {
             return LLRegion{num_bytes, num_ranks, max_local_experts};
           }),
           py::arg("num_bytes"), py::arg("num_ranks"), py::arg("max_local_experts"))
      .def_property_readonly("end", &LLRegion::end, "where the normal mode's control area begins");
  py::class_<LLKernels>(m, "LLKernels")
      .def(py::init(&make_ll_kernels), "keyword arguments only: see kLLKernelsKeywords in bind_cuda_ll.cpp")
      .def(
          "prepare", [](LLKernels& k, int T, int hidden, int num_experts) { k.plan(T, hidden, num_experts); },
          py::arg("T"), py::arg("hidden"), py::arg("num_experts"))
      .def(
          "mark_checked",
          [](LLKernels& k, int T, int hidden, int num_experts, py::object dispatch_flags) {
            LLPlan& p = k.plan(T, hidden, num_experts);
            if (dispatch_flags.is_none()) {
              p.checked |= kCombineChecked;
            } else {
              auto [fp8, round_scale, ue8m0] = dispatch_flags.cast<std::tuple<bool, bool, bool>>();
              p.checked |= 1u << ll_fp8_combo(fp8, round_scale, ue8m0);
            }
          },
          py::arg("T"), py::arg("hidden"), py::arg("num_experts"), py::arg("dispatch_flags"),
          "a call of this signature passed Python's checks: dispatch_flags (use_fp8, round_scale, use_ue8m0) for a "
          "dispatch, None for a combine")
      .def(
          "dispatch",
          [](LLKernels& k, int T, int hidden, int num_experts, int half, int phases, uintptr_t stream, uint32_t seq,
             const py::kwargs& kw) {
            dispatch(k.table(), k.plan(T, hidden, num_experts), half & 1, phases, stream, seq, kw);
          },
          py::arg("T"), py::arg("hidden"), py::arg("num_experts"), py::arg("half"), py::arg("phases"),
          py::arg("stream"), py::arg("seq"))
      .def(
          "combine",
          [](LLKernels& k, int T, int hidden, int num_experts, int half, int phases, uintptr_t stream, uint32_t seq,
             const py::kwargs& kw) {
            combine(k.table(), k.plan(T, hidden, num_experts), half & 1, phases, stream, seq, kw);
          },
          py::arg("T"), py::arg("hidden"), py::arg("num_experts"), py::arg("half"), py::arg("phases"),
          py::arg("stream"), py::arg("seq"))
      .def_property_readonly(
          "half", [](LLKernels& k) { return k.table().half; }, "the buffer half the next LL call uses")
      .def(
          "take_half", [](LLKernels& k) { return k.table().take_half(); }, "the next call's half (then flipped)")
      .def("reset_half", [](LLKernels& k) { k.table().reset_half(); })
      .def_property("graph_launch", &LLKernels::graph_launch, &LLKernels::set_graph_launch,
                    "whether eager LL calls launch as cached CUDA graphs (gpu_kernels/cuda/graph_cache.h)")
      .def_property_readonly("graph_counts", &LLKernels::graph_counts,
                             "graph launches, builds and updates, and the error that turned them off (0: none)")
      .def(
          "close", [](LLKernels& k) { k.close(); },
          "the Buffer's memory goes away: the fast path finds no plan and reads nothing any more");
  m.def("ll_shared", &ll_shared, py::arg("state"), py::arg("kernels").none(true),
        "a capsule for portep._ll_torch.LLCalls: a LockstepState and the plan table of LLKernels (None: no table), "
        "versioned and sized as python/src/ll_shared.h says; it keeps both alive");

  m.def("cuda_device_alloc", [](uint64_t bytes) {
    void* p = nullptr;
    check(device_alloc_zeroed(&p, bytes), "cudaMalloc");
    return reinterpret_cast<uintptr_t>(p);
  });
  m.def("cuda_device_free", [](uintptr_t p) { check(device_free(ptr<void>(p)), "cudaFree"); });
  // Every portep kernel loaded now, while none runs. With CUDA's lazy module loading (the default) a kernel's
  // first launch can wait for running kernels and holds up other threads' CUDA calls meanwhile: a first normal-
  // mode kernel launched behind one that waits for the proxies' copies would stall them until its timeout.
  m.def("cuda_load_kernels", [] {
    check(load_layout_kernels(), "loading the layout kernel");
    check(load_slot_sum_kernels(), "loading the slot-sum kernel");
    check(load_ll_dispatch_kernels(), "loading the LL dispatch kernels");
    check(load_ll_combine_kernels(), "loading the LL combine kernels");
    check(load_ht_notify_kernels(), "loading the HT notify kernel");
    check(load_ht_dispatch_kernels(), "loading the HT dispatch kernel");
    check(load_ht_combine_kernels(), "loading the HT combine kernel");
  });
  m.def("cuda_stream_create", [] {
    void* s = nullptr;
    check(stream_create(&s), "cudaStreamCreateWithFlags");
    return reinterpret_cast<uintptr_t>(s);
  });
  m.def(
      "cuda_peer_table",
      [](const portep::Channel& channel, const std::vector<int>& ranks, py::handle table) {
        const auto t = portep::bind::tensor_arg(table, "table", "int64", "cuda");
        portep::bind::write_peer_table(channel, ranks, t.as<uint8_t*>(), t.numel, false, "cuda_peer_table");
      },
      py::arg("channel"), py::arg("ranks"), py::arg("table"),
      "table (int64 [num_ranks] on a GPU) gets the region of each of `ranks` that the Channel mapped, 0 elsewhere");
  m.def("cuda_copy", [](uintptr_t dst, uintptr_t src, uint64_t bytes) {
    check(copy_to_device(ptr<void>(dst), ptr<const void>(src), bytes), "cudaMemcpy");
  });
}
#endif
