// Bindings of the CUDA low-latency kernels and their device setup (built with the CUDA kernels only).
#ifdef PORTEP_WITH_GPU
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "gpu_kernels/cuda/api.h"
#include "python/src/bind_util.h"
#include "gpu_kernels/cuda/ll_api.h"
#include "gpu_kernels/cuda/ht_api.h"

namespace py = pybind11;
using namespace portep::cuda;

namespace {

using portep::bind::check;
using portep::bind::ptr;
using portep::bind::PyFifoSet;

// The per-Buffer constants of LLCommon; every call adds its half's offsets and its tensors.
class LLKernels {
 public:
  LLKernels(int rank, int num_ranks, uintptr_t local, uintptr_t peers, uintptr_t place, uintptr_t host_signals,
            uintptr_t signal_seen,
            uint32_t num_streams, const PyFifoSet& fifos, uintptr_t finish, uintptr_t chunk_done, uintptr_t proxy_begin,
            int max_chunks, uintptr_t dest_done, uintptr_t error, double timeout_s, int num_sms, uintptr_t failed,
            uintptr_t peer_status, uintptr_t mask, uintptr_t send_mask) {
    if (!failed) throw std::invalid_argument("failed: the device words for reported errors must not be null");
    if (!peers || !place) throw std::invalid_argument("peers and place: device arrays of num_ranks pointers, not null");
    c_ = LLCommon{};
    c_.rank = rank;
    c_.num_ranks = num_ranks;
    c_.local = ptr<uint8_t>(local);
    c_.peers = ptr<uint8_t* const>(peers);
    c_.place = ptr<uint8_t* const>(place);
    c_.host_signals = ptr<uint64_t>(host_signals);
    c_.signal_seen = ptr<uint64_t>(signal_seen);
    c_.num_streams = num_streams;
    c_.fifos = fifos.set_.device_views;
    c_.fifo_tails = fifos.set_.device_tails;
    c_.num_fifos = fifos.set_.count;
    c_.finish = ptr<uint32_t>(finish);
    c_.chunk_done = ptr<uint32_t>(chunk_done);
    c_.proxy_begin = ptr<uint32_t>(proxy_begin);
    c_.max_chunks = max_chunks;
    c_.dest_done = ptr<uint32_t>(dest_done);
    c_.meta_stride = kMetaStride;
    c_.error = ptr<KernelError>(error);
    c_.failed = ptr<uint32_t>(failed);
    c_.peer_status = ptr<const uint32_t>(peer_status);
    c_.mask = ptr<uint32_t>(mask);
    c_.send_mask = ptr<const uint32_t>(send_mask);
    if (!c_.mask != !c_.send_mask) throw std::invalid_argument("mask and send_mask: both (shrink mode) or neither");
    c_.timeout_ns = uint64_t(timeout_s * 1e9);
    c_.num_sms = num_sms;
  }

  LLCommon shape(int T, int hidden, int num_experts, uint64_t send_off, uint64_t recv_off, uint64_t flag_off,
                 uint32_t disp_bytes, uint32_t comb_pitch, uint32_t stream_base, uint64_t meta_off,
                 uintptr_t stream, uint32_t seq) const {
    LLCommon c = c_;
    c.T = T;
    c.hidden = hidden;
    c.num_experts = num_experts;
    c.num_local_experts = num_experts / c.num_ranks;
    c.send_off = send_off;
    c.recv_off = recv_off;
    c.flag_off = flag_off;
    c.disp_bytes = disp_bytes;
    c.comb_pitch = comb_pitch;
    c.stream_base = stream_base;
    c.meta_off = meta_off;
    c.stream = reinterpret_cast<void*>(stream);
    c.seq = seq;
    return c;
  }

  // The per-call constants as _shape in backends/cuda/engine.py packs them.
  LLCommon shape(const py::tuple& s) const {
    return shape(s[0].cast<int>(), s[1].cast<int>(), s[2].cast<int>(), s[3].cast<uint64_t>(), s[4].cast<uint64_t>(),
                 s[5].cast<uint64_t>(), s[6].cast<uint32_t>(), s[7].cast<uint32_t>(), s[8].cast<uint32_t>(),
                 s[9].cast<uint64_t>(), s[10].cast<uintptr_t>(), s[11].cast<uint32_t>());
  }

  LLCommon c_;
};

}  // namespace

void bind_cuda_ll(py::module_& m) {
  py::class_<PyFifoSet>(m, "DeviceFifoSet")
      .def(py::init<int, uint32_t>(), py::arg("count"), py::arg("capacity"))
      .def_property_readonly("count", [](const PyFifoSet& f) { return f.set_.count; })
      .def_property_readonly("host_views", [](const PyFifoSet& f) { return reinterpret_cast<uintptr_t>(f.set_.host_views); })
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
  py::class_<LLKernels>(m, "LLKernels")
      .def(py::init<int, int, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uint32_t, const PyFifoSet&,
                    uintptr_t, uintptr_t, uintptr_t, int, uintptr_t, uintptr_t, double, int, uintptr_t, uintptr_t,
                    uintptr_t, uintptr_t>(),
           py::arg("rank"), py::arg("num_ranks"), py::arg("local"), py::arg("peers"), py::arg("place"),
           py::arg("host_signals"),
           py::arg("signal_seen"), py::arg("num_streams"), py::arg("fifos"), py::arg("finish"), py::arg("chunk_done"),
           py::arg("proxy_begin"), py::arg("max_chunks"), py::arg("dest_done"), py::arg("error"), py::arg("timeout_s"),
           py::arg("num_sms"), py::arg("failed"), py::arg("peer_status") = 0, py::arg("mask") = 0,
           py::arg("send_mask") = 0,
           py::keep_alive<1, 10>())
      .def("dispatch",
           [](const LLKernels& k, int phases, py::tuple shape, uintptr_t x, uintptr_t topk_idx, int num_tokens,
              int num_topk, bool use_fp8, bool round_scale, bool use_ue8m0, uintptr_t recv_x, uintptr_t recv_scales,
              uintptr_t recv_count, uintptr_t src_info, uintptr_t layout_range, uintptr_t cumulative_stats,
              uintptr_t wait_stats) {
             LLDispatchArgs a{};
             a.c = k.shape(shape);
             a.x = ptr<const void>(x);
             a.topk_idx = ptr<const int64_t>(topk_idx);
             a.num_tokens = num_tokens;
             a.num_topk = num_topk;
             a.use_fp8 = use_fp8;
             a.round_scale = round_scale;
             a.use_ue8m0 = use_ue8m0;
             a.recv_x = ptr<void>(recv_x);
             a.recv_scales = ptr<void>(recv_scales);
             a.recv_count = ptr<int32_t>(recv_count);
             a.src_info = ptr<int32_t>(src_info);
             a.layout_range = ptr<int64_t>(layout_range);
             a.cumulative_stats = ptr<int32_t>(cumulative_stats);
             a.wait_stats = ptr<int64_t>(wait_stats);
             check(ll_dispatch(a, phases), "low-latency dispatch");
           })
      .def("combine",
           [](const LLKernels& k, int phases, py::tuple shape, uintptr_t x, uint64_t x_pitch, bool zero_copy,
              uintptr_t src_info, uintptr_t layout_range, uintptr_t topk_idx, uintptr_t topk_weights, int num_tokens,
              int num_topk, uintptr_t out, uint64_t out_pitch, uintptr_t wait_stats) {
             LLCombineArgs a{};
             a.c = k.shape(shape);
             a.x = ptr<const void>(x);
             a.x_pitch = x_pitch;
             a.zero_copy = zero_copy;
             a.src_info = ptr<const int32_t>(src_info);
             a.layout_range = ptr<const int64_t>(layout_range);
             a.topk_idx = ptr<const int64_t>(topk_idx);
             a.topk_weights = ptr<const float>(topk_weights);
             a.num_tokens = num_tokens;
             a.num_topk = num_topk;
             a.out = ptr<void>(out);
             a.out_pitch = out_pitch;
             a.wait_stats = ptr<int64_t>(wait_stats);
             check(ll_combine(a, phases), "low-latency combine");
           });

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
  m.def("cuda_copy", [](uintptr_t dst, uintptr_t src, uint64_t bytes) {
    check(copy_to_device(ptr<void>(dst), ptr<const void>(src), bytes), "cudaMemcpy");
  });
  m.def("cuda_host_alloc_mapped", [](uint64_t bytes) {
    void *h = nullptr, *d = nullptr;
    check(host_alloc_mapped(&h, &d, bytes), "cudaHostAlloc");
    return py::make_tuple(reinterpret_cast<uintptr_t>(h), reinterpret_cast<uintptr_t>(d));
  });
  m.def("cuda_host_free_mapped", [](uintptr_t h) { check(host_free_mapped(ptr<void>(h)), "cudaFreeHost"); });
}
#endif
