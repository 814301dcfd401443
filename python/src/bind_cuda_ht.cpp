// Bindings of the CUDA normal-mode (HT) kernels (built with the CUDA kernels only). Layouts in ht_api.h.
#ifdef PORTEP_WITH_GPU
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "python/src/bind_util.h"
#include "gpu_kernels/cuda/ht_api.h"

namespace py = pybind11;
using namespace portep::cuda;

namespace {

using portep::bind::check;
using portep::bind::ptr;
using portep::bind::PyFifoSet;

// The per-Buffer constants of HTCommon; each call adds its channels and stream.
class HTKernels {
 public:
  HTKernels(int rank, int num_ranks, int ranks_per_node, uintptr_t local, uintptr_t peers, uintptr_t place,
            uint64_t ctrl_off,
            uint64_t recv_off, uint64_t stage_off, uintptr_t epoch, uintptr_t host_counts,
            uintptr_t host_counts_device, uintptr_t error, uintptr_t error_host, double timeout_s,
            const PyFifoSet& fifos, uintptr_t host_signals, uintptr_t signal_seen, uint32_t num_streams,
            uint32_t stream_base, uintptr_t failed, uintptr_t peer_status)
      : host_(ptr<HTHostCounts>(host_counts)), error_host_(ptr<KernelError>(error_host)), timeout_s_(timeout_s) {
    if (num_ranks > kHTMaxRanks)
      throw std::invalid_argument("num_ranks=" + std::to_string(num_ranks) +
                                  ": the CUDA HT kernels store into at most " + std::to_string(kHTMaxRanks) + " ranks");
    if (!failed) throw std::invalid_argument("failed: the device words for reported errors must not be null");
    if (!peers || !place) throw std::invalid_argument("peers and place: device arrays of num_ranks pointers, not null");
    if (ranks_per_node < 1 || num_ranks % ranks_per_node)
      throw std::invalid_argument("ranks_per_node=" + std::to_string(ranks_per_node) + " must divide num_ranks=" +
                                  std::to_string(num_ranks));
    c_ = HTCommon{};
    c_.rank = rank;
    c_.num_ranks = num_ranks;
    c_.ranks_per_node = ranks_per_node;
    c_.local = ptr<uint8_t>(local);
    c_.peers = ptr<uint8_t* const>(peers);
    c_.place = ptr<uint8_t* const>(place);
    c_.ctrl_off = ctrl_off;
    c_.recv_off = recv_off;
    c_.stage_off = stage_off;
    c_.epoch = ptr<uint64_t>(epoch);
    c_.fifos = fifos.set_.device_views;
    c_.fifo_tails = fifos.set_.device_tails;
    c_.num_fifos = fifos.set_.count;
    c_.host_signals = ptr<uint64_t>(host_signals);
    c_.signal_seen = ptr<uint64_t>(signal_seen);
    c_.num_streams = num_streams;
    c_.stream_base = stream_base;
    c_.host = ptr<HTHostCounts>(host_counts_device);
    c_.error = ptr<KernelError>(error);
    c_.failed = ptr<uint32_t>(failed);
    c_.peer_status = ptr<const uint32_t>(peer_status);
    c_.timeout_ns = uint64_t(timeout_s * 1e9);
  }

  HTCommon common(int num_channels, uintptr_t stream) const {
    if (num_channels < 1 || num_channels > kHTMaxChannels)
      throw std::invalid_argument("num_channels=" + std::to_string(num_channels) +
                                  " (config.num_sms // 2) must be in [1, " + std::to_string(kHTMaxChannels) + "]");
    HTCommon c = c_;
    c.num_channels = num_channels;
    c.stream = reinterpret_cast<void*>(stream);
    return c;
  }

  // Spins (without the GIL) until the notify kernel of `ticket` published its counts, or a kernel failed, or the
  // timeout passed. Returns (num_recv, self_begin, self_rows, forward_rows, [selections per local expert]) or None.
  py::object wait_counts(uint64_t ticket, int num_local_experts) const {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s_);
    bool ok = false;
    {
      py::gil_scoped_release nogil;
      const volatile uint64_t* e = &host_->ticket;
      const volatile uint32_t* err = &error_host_->code;
      for (uint32_t spins = 0;; ++spins) {
        if (*e >= ticket) {
          ok = *e == ticket;
          break;
        }
        if (*err) break;
        if ((spins & 1023) == 0 && std::chrono::steady_clock::now() > deadline) break;
        if (spins > 4096) std::this_thread::yield();
      }
      std::atomic_thread_fence(std::memory_order_acquire);
    }
    if (!ok) return py::none();
    std::vector<int64_t> experts(host_->expert, host_->expert + num_local_experts);
    return py::make_tuple(host_->num_recv, host_->self_begin, host_->self_rows, host_->forward_rows, experts);
  }

  HTCommon c_;
  HTHostCounts* host_;
  KernelError* error_host_;
  double timeout_s_;
};

// The kernels' ring rule (ht_api.h); the Python side sizes rings from the buffer and raises first.
uint32_t check_ring(uint32_t ring_rows) {
  if (ring_rows < uint32_t(kHTMinRingRows) || ring_rows % kHTChunkRows)
    throw std::invalid_argument("ring_rows=" + std::to_string(ring_rows) + " must be a multiple of " +
                                std::to_string(kHTChunkRows) + " and at least " + std::to_string(kHTMinRingRows));
  return ring_rows;
}

// With forwarding the data kernels read the handle's node matrices; without, they must not be given.
void check_forwarding(const HTCommon& c, bool given, const char* what) {
  const bool forwarding = ht_blocks_per_channel(c.num_ranks, c.ranks_per_node) == 3;
  if (forwarding != given)
    throw std::invalid_argument(std::string(what) + ": the forwarding arguments (fwd_channel_prefix, fwd_rank_prefix" +
                                (forwarding ? ") are required with " : ") must be null without ") +
                                "forwarding (num_ranks=" + std::to_string(c.num_ranks) +
                                ", ranks_per_node=" + std::to_string(c.ranks_per_node) + ")");
}

}  // namespace

void bind_cuda_ht(py::module_& m) {
  m.attr("HT_CTRL_BYTES") = kHTCtrlBytes;
  m.attr("HT_HOST_COUNTS_BYTES") = sizeof(HTHostCounts);
  m.attr("HT_MAX_RANKS") = kHTMaxRanks;
  m.attr("HT_MAX_CHANNELS") = kHTMaxChannels;
  m.attr("HT_MAX_LOCAL_EXPERTS") = kHTMaxLocalExperts;
  m.attr("HT_NUM_STREAMS") = kHTNumStreams;
  m.attr("HT_CHUNK_ROWS") = kHTChunkRows;
  m.attr("HT_MIN_RING_ROWS") = kHTMinRingRows;
  m.attr("HT_NVL_HEAD_COLUMNS") = kHTNvlHeadColumns;
  m.def("ht_blocks_per_channel", &ht_blocks_per_channel, py::arg("num_ranks"), py::arg("ranks_per_node"));
  py::class_<HTKernels>(m, "HTKernels")
      .def(py::init<int, int, int, uintptr_t, uintptr_t, uintptr_t, uint64_t, uint64_t, uint64_t, uintptr_t,
                    uintptr_t, uintptr_t, uintptr_t, uintptr_t, double, const PyFifoSet&, uintptr_t, uintptr_t,
                    uint32_t, uint32_t, uintptr_t, uintptr_t>(),
           py::arg("rank"), py::arg("num_ranks"), py::arg("ranks_per_node"), py::arg("local"), py::arg("peers"),
           py::arg("place"), py::arg("ctrl_off"),
           py::arg("recv_off"), py::arg("stage_off"), py::arg("epoch"), py::arg("host_counts"),
           py::arg("host_counts_device"), py::arg("error"), py::arg("error_host"), py::arg("timeout_s"),
           py::arg("fifos"), py::arg("host_signals"), py::arg("signal_seen"), py::arg("num_streams"),
           py::arg("stream_base"), py::arg("failed"), py::arg("peer_status") = 0, py::keep_alive<1, 17>())
      .def("wait_counts", &HTKernels::wait_counts, py::arg("ticket"), py::arg("num_local_experts"))
      .def("notify",
           [](const HTKernels& k, int num_channels, uintptr_t stream, bool count_mode, uintptr_t is_token_in_rank,
              uintptr_t tokens_per_expert, int num_tokens, int num_experts, uintptr_t rank_prefix,
              uintptr_t channel_prefix, uintptr_t recv_channel_prefix, uintptr_t node_channel_prefix,
              uintptr_t fwd_channel_prefix, uintptr_t fwd_rank_prefix, int64_t max_recv, uint64_t ticket) {
             HTNotifyArgs a{};
             a.c = k.common(num_channels, stream);
             a.count_mode = count_mode;
             a.is_token_in_rank = ptr<const bool>(is_token_in_rank);
             a.tokens_per_expert = ptr<const int32_t>(tokens_per_expert);
             a.num_tokens = num_tokens;
             a.num_experts = num_experts;
             a.rank_prefix = ptr<int32_t>(rank_prefix);
             a.channel_prefix = ptr<int32_t>(channel_prefix);
             a.recv_channel_prefix = ptr<int32_t>(recv_channel_prefix);
             a.node_channel_prefix = ptr<int32_t>(node_channel_prefix);
             a.fwd_channel_prefix = ptr<int32_t>(fwd_channel_prefix);
             a.fwd_rank_prefix = ptr<int32_t>(fwd_rank_prefix);
             if (count_mode && (a.node_channel_prefix || a.fwd_channel_prefix || a.fwd_rank_prefix) &&
                 !(a.node_channel_prefix && a.fwd_channel_prefix && a.fwd_rank_prefix))
               throw std::invalid_argument("node_channel_prefix, fwd_channel_prefix, fwd_rank_prefix: all or none");
             a.max_recv = max_recv;
             a.ticket = ticket;
             check(ht_notify(a), "HT notify");
           })
      .def("dispatch",
           [](const HTKernels& k, int num_channels, uintptr_t stream, uintptr_t x, uintptr_t scales, uintptr_t topk_idx,
              uintptr_t topk_weights, uintptr_t is_token_in_rank, uintptr_t recv_prefix, int recv_prefix_stride,
              uintptr_t channel_prefix, uintptr_t recv_channel_prefix, int num_tokens, int row_bytes, int num_scales,
              int num_topk, int num_local_experts, uint32_t ring_rows, int64_t max_recv, uintptr_t recv_x,
              uintptr_t recv_scales, uintptr_t recv_topk_idx, uintptr_t recv_topk_weights, uintptr_t recv_src_idx,
              uintptr_t send_head, uintptr_t fwd_channel_prefix, uintptr_t fwd_rank_prefix, uintptr_t recv_src_meta,
              uintptr_t nvl_head, int64_t nvl_rows) {
             HTDispatchArgs a{};
             a.c = k.common(num_channels, stream);
             a.x = ptr<const uint8_t>(x);
             a.scales = ptr<const float>(scales);
             a.topk_idx = ptr<const int64_t>(topk_idx);
             a.topk_weights = ptr<const float>(topk_weights);
             a.is_token_in_rank = ptr<const bool>(is_token_in_rank);
             a.recv_prefix = ptr<const int32_t>(recv_prefix);
             a.recv_prefix_stride = recv_prefix_stride;
             a.channel_prefix = ptr<const int32_t>(channel_prefix);
             a.recv_channel_prefix = ptr<const int32_t>(recv_channel_prefix);
             a.num_tokens = num_tokens;
             a.row_bytes = row_bytes;
             a.num_scales = num_scales;
             a.num_topk = num_topk;
             a.num_local_experts = num_local_experts;
             a.ring_rows = check_ring(ring_rows);
             a.max_recv = max_recv;
             a.recv_x = ptr<uint8_t>(recv_x);
             a.recv_scales = ptr<float>(recv_scales);
             a.recv_topk_idx = ptr<int64_t>(recv_topk_idx);
             a.recv_topk_weights = ptr<float>(recv_topk_weights);
             a.recv_src_idx = ptr<int32_t>(recv_src_idx);
             a.send_head = ptr<int32_t>(send_head);
             a.fwd_channel_prefix = ptr<const int32_t>(fwd_channel_prefix);
             a.fwd_rank_prefix = ptr<const int32_t>(fwd_rank_prefix);
             a.recv_src_meta = ptr<int32_t>(recv_src_meta);
             a.nvl_head = ptr<int32_t>(nvl_head);
             a.nvl_rows = nvl_rows;
             check_forwarding(a.c, a.fwd_channel_prefix && a.fwd_rank_prefix, "dispatch");
             check(ht_dispatch(a), "HT dispatch");
           })
      .def("combine",
           [](const HTKernels& k, int num_channels, uintptr_t stream, uintptr_t x, uintptr_t topk_weights,
              uintptr_t bias0, uintptr_t bias1, uintptr_t is_token_in_rank, uintptr_t recv_prefix,
              int recv_prefix_stride, uintptr_t recv_channel_prefix, uintptr_t fwd_channel_prefix,
              uintptr_t fwd_rank_prefix, uintptr_t nvl_head, int num_tokens, int hidden, int num_topk,
              uint32_t ring_rows, uintptr_t out, uintptr_t out_weights) {
             HTCombineArgs a{};
             a.c = k.common(num_channels, stream);
             a.x = ptr<const uint16_t>(x);
             a.topk_weights = ptr<const float>(topk_weights);
             a.bias0 = ptr<const uint16_t>(bias0);
             a.bias1 = ptr<const uint16_t>(bias1);
             a.is_token_in_rank = ptr<const bool>(is_token_in_rank);
             a.recv_prefix = ptr<const int32_t>(recv_prefix);
             a.recv_prefix_stride = recv_prefix_stride;
             a.recv_channel_prefix = ptr<const int32_t>(recv_channel_prefix);
             a.fwd_channel_prefix = ptr<const int32_t>(fwd_channel_prefix);
             a.fwd_rank_prefix = ptr<const int32_t>(fwd_rank_prefix);
             a.nvl_head = ptr<const int32_t>(nvl_head);
             check_forwarding(a.c, a.fwd_channel_prefix && a.fwd_rank_prefix && a.nvl_head, "combine");
             a.num_tokens = num_tokens;
             a.hidden = hidden;
             a.num_topk = num_topk;
             a.ring_rows = check_ring(ring_rows);
             a.out = ptr<uint16_t>(out);
             a.out_weights = ptr<float>(out_weights);
             check(ht_combine(a), "HT combine");
           });
}
#endif
