// Bindings of the CUDA normal-mode (HT) kernels (built with the CUDA kernels only): the layout of one rank's memory
// (ht_layout.h) as HTLayout, and one Buffer's kernels as HTKernels, whose constructor and calls take keyword
// arguments only (optional pointers default to null). Device and host addresses come from Python as integers.
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
#include "python/src/tensor_arg.h"
#include "gpu_kernels/cuda/api.h"
#include "gpu_kernels/cuda/ht_api.h"

namespace py = pybind11;
using namespace portep::cuda;

namespace {

using portep::bind::check;
using portep::bind::ptr;
using portep::bind::PyFifoSet;

template <class T>
std::string str(T v) {
  return std::to_string(v);
}

// The normal mode's limits: ranks per node 1..kHTMaxNodeRanks, nodes 1..kHTMaxNodes.
void check_ranks(int num_ranks, int ranks_per_node) {
  if (ranks_per_node < 1 || ranks_per_node > kHTMaxNodeRanks)
    throw std::invalid_argument("ranks_per_node=" + str(ranks_per_node) + ": the normal mode runs 1 to " +
                                str(kHTMaxNodeRanks) + " ranks per node");
  if (num_ranks < 1 || num_ranks % ranks_per_node)
    throw std::invalid_argument("ranks_per_node=" + str(ranks_per_node) + " must divide num_ranks=" + str(num_ranks));
  if (num_ranks / ranks_per_node > kHTMaxNodes)
    throw std::invalid_argument("num_ranks=" + str(num_ranks) + " with ranks_per_node=" + str(ranks_per_node) +
                                " makes " + str(num_ranks / ranks_per_node) + " nodes; the normal mode runs at most " +
                                str(kHTMaxNodes) + " nodes");
}

HTLayout make_layout(int num_ranks, int ranks_per_node, bool proxy, uint64_t ctrl_off, uint64_t area_off,
                     uint64_t area_bytes) {
  check_ranks(num_ranks, ranks_per_node);
  if (ctrl_off % kHTAlign || area_off % kHTAlign || area_bytes % kHTAlign)
    throw std::invalid_argument("ctrl_off=" + str(ctrl_off) + ", area_off=" + str(area_off) +
                                ", area_bytes=" + str(area_bytes) + " must be multiples of " + str(kHTAlign));
  const uint64_t ctrl_bytes = ht_ctrl(num_ranks, ranks_per_node).bytes;
  if (ctrl_off < area_off + area_bytes && area_off < ctrl_off + ctrl_bytes)
    throw std::invalid_argument("the control area [" + str(ctrl_off) + ", +" + str(ctrl_bytes) +
                                ") overlaps the normal-mode area [" + str(area_off) + ", +" + str(area_bytes) + ")");
  return HTLayout{num_ranks, ranks_per_node, proxy, ctrl_off, area_off, area_bytes};
}

// The kernels' ring rule (ht_layout.h); Python sizes rings from the same layout and raises first, naming the bytes.
uint32_t ring_rows_for(const HTLayout& l, uint32_t row_bytes, int num_channels) {
  const uint32_t rows = l.rows_per_ring(row_bytes, num_channels);
  if (!ht_ring_rows_valid(rows))
    throw std::invalid_argument("the normal-mode area (" + str(l.area_bytes) + " bytes) holds " + str(rows) +
                                " rows of " + str(row_bytes) + " bytes per ring with " + str(num_channels) +
                                " channels; at least " + str(kHTMinRingRows) + " are needed");
  return rows;
}

// The per-Buffer constants of HTCommon; each call adds its channels and stream.
class HTKernels {
 public:
  HTKernels(const HTLayout& layout, const PyFifoSet& fifos, int rank, uintptr_t local, uintptr_t peers, uintptr_t place,
            uintptr_t epoch, uintptr_t host_counts, uintptr_t host_counts_device, uintptr_t error, uintptr_t error_host,
            uintptr_t failed, uintptr_t peer_status, uintptr_t host_signals, uintptr_t signal_seen,
            uint32_t num_streams, uint32_t stream_base, double timeout_s)
      : layout_(layout),
        host_(ptr<HTHostCounts>(host_counts)),
        error_host_(ptr<KernelError>(error_host)),
        timeout_s_(timeout_s) {
    if (rank < 0 || rank >= layout.num_ranks)
      throw std::invalid_argument("rank=" + str(rank) + " must be in [0, " + str(layout.num_ranks) + ")");
    if (!local || !epoch || !host_counts || !host_counts_device || !error || !error_host || !failed)
      throw std::invalid_argument("local, epoch, host_counts(_device), error(_host), failed must not be null");
    if (!peers || !place) throw std::invalid_argument("peers and place: device arrays of num_ranks pointers, not null");
    if (uint64_t(stream_base) + kHTNumStreams > num_streams)
      throw std::invalid_argument("stream_base=" + str(stream_base) + " + " + str(kHTNumStreams) +
                                  " normal-mode streams exceed num_streams=" + str(num_streams));
    const HTAreas areas = layout.areas();
    c_ = HTCommon{};
    c_.rank = rank;
    c_.num_ranks = layout.num_ranks;
    c_.ranks_per_node = layout.ranks_per_node;
    c_.local = ptr<uint8_t>(local);
    c_.peers = ptr<uint8_t* const>(peers);
    c_.place = ptr<uint8_t* const>(place);
    c_.ctrl_off = layout.ctrl_off;
    c_.ctrl = layout.ctrl();
    c_.recv_off = areas.recv_off;
    c_.stage_off = areas.stage_off;
    c_.epoch = ptr<uint64_t>(epoch);
    c_.host = ptr<HTHostCounts>(host_counts_device);
    c_.peer_status = ptr<const uint32_t>(peer_status);
    c_.error = ptr<KernelError>(error);
    c_.failed = ptr<uint32_t>(failed);
    c_.timeout_ns = uint64_t(timeout_s * 1e9);
    c_.fifos = fifos.set_.device_views;
    c_.fifo_tails = fifos.set_.device_tails;
    c_.num_fifos = fifos.set_.count;
    c_.host_signals = ptr<uint64_t>(host_signals);
    c_.signal_seen = ptr<uint64_t>(signal_seen);
    c_.num_streams = num_streams;
    c_.stream_base = stream_base;
  }

  HTCommon common(int num_channels, uintptr_t stream) const {
    if (num_channels < 1 || num_channels > kHTMaxChannels)
      throw std::invalid_argument("num_channels=" + str(num_channels) + " (config.num_sms // 2) must be in [1, " +
                                  str(kHTMaxChannels) + "]");
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

  HTLayout layout_;
  HTCommon c_;
  HTHostCounts* host_;
  KernelError* error_host_;
  double timeout_s_;
};

// With forwarding the data kernels read the handle's node matrices; without, they must not be given.
void check_forwarding(const HTCommon& c, bool given, const char* what) {
  const bool forwarding = ht_forwarding(c);
  if (forwarding != given)
    throw std::invalid_argument(std::string(what) + ": the forwarding arguments (fwd_channel_prefix, fwd_rank_prefix" +
                                (forwarding ? ") are required with " : ") must be null without ") +
                                "forwarding (num_ranks=" + str(c.num_ranks) +
                                ", ranks_per_node=" + str(c.ranks_per_node) + ")");
}

void notify(const HTKernels& k, int channels, uintptr_t stream, uintptr_t is_token_in_rank, bool count_mode,
            uintptr_t tokens_per_expert, int num_tokens, int num_experts, uintptr_t recv_rank_prefix,
            uintptr_t rank_prefix, uintptr_t channel_prefix, uintptr_t recv_channel_prefix,
            uintptr_t node_channel_prefix, uintptr_t fwd_channel_prefix, uintptr_t fwd_rank_prefix, int64_t max_recv,
            uint64_t ticket) {
  HTNotifyArgs a{};
  a.c = k.common(channels, stream);
  a.count_mode = count_mode;
  a.is_token_in_rank = ptr<const bool>(is_token_in_rank);
  a.tokens_per_expert = ptr<const int32_t>(tokens_per_expert);
  a.num_tokens = num_tokens;
  a.num_experts = num_experts;
  a.recv_rank_prefix = ptr<int32_t>(recv_rank_prefix);
  a.rank_prefix = ptr<int32_t>(rank_prefix);
  a.channel_prefix = ptr<int32_t>(channel_prefix);
  a.recv_channel_prefix = ptr<int32_t>(recv_channel_prefix);
  a.node_channel_prefix = ptr<int32_t>(node_channel_prefix);
  a.fwd_channel_prefix = ptr<int32_t>(fwd_channel_prefix);
  a.fwd_rank_prefix = ptr<int32_t>(fwd_rank_prefix);
  a.max_recv = max_recv;
  a.ticket = ticket;
  if (count_mode && !(a.tokens_per_expert && a.recv_rank_prefix && a.channel_prefix && a.recv_channel_prefix))
    throw std::invalid_argument(
        "notify: count mode needs tokens_per_expert, recv_rank_prefix, channel_prefix and "
        "recv_channel_prefix");
  if (count_mode && a.rank_prefix && a.c.num_ranks > a.c.ranks_per_node)
    throw std::invalid_argument("notify: rank_prefix (the [R][R] matrix) is for one node only, num_ranks=" +
                                str(a.c.num_ranks) + " ranks_per_node=" + str(a.c.ranks_per_node));
  if (count_mode && ht_forwarding(a.c) != (a.node_channel_prefix && a.fwd_channel_prefix && a.fwd_rank_prefix))
    throw std::invalid_argument(
        "notify: node_channel_prefix, fwd_channel_prefix, fwd_rank_prefix: all with "
        "forwarding, none without");
  check(ht_notify(a), "HT notify");
}

void dispatch(const HTKernels& k, int channels, uintptr_t stream, uintptr_t x, int row_bytes, int num_tokens,
              uintptr_t is_token_in_rank, uintptr_t recv_prefix, int recv_prefix_stride, uintptr_t channel_prefix,
              uintptr_t recv_channel_prefix, int64_t max_recv, uintptr_t recv_x, uintptr_t scales, int num_scales,
              uintptr_t recv_scales, uintptr_t topk_idx, uintptr_t topk_weights, int num_topk, int num_local_experts,
              uintptr_t recv_topk_idx, uintptr_t recv_topk_weights, uintptr_t recv_src_idx, uintptr_t send_head,
              uintptr_t fwd_channel_prefix, uintptr_t fwd_rank_prefix, uintptr_t recv_src_meta, uintptr_t nvl_head,
              int64_t nvl_rows) {
  HTDispatchArgs a{};
  a.c = k.common(channels, stream);
  a.x = ptr<const uint8_t>(x);
  a.row_bytes = row_bytes;
  a.num_tokens = num_tokens;
  a.is_token_in_rank = ptr<const bool>(is_token_in_rank);
  a.recv_prefix = ptr<const int32_t>(recv_prefix);
  a.recv_prefix_stride = recv_prefix_stride;
  a.channel_prefix = ptr<const int32_t>(channel_prefix);
  a.recv_channel_prefix = ptr<const int32_t>(recv_channel_prefix);
  a.max_recv = max_recv;
  a.recv_x = ptr<uint8_t>(recv_x);
  a.scales = ptr<const float>(scales);
  a.num_scales = num_scales;
  a.recv_scales = ptr<float>(recv_scales);
  a.topk_idx = ptr<const int64_t>(topk_idx);
  a.topk_weights = ptr<const float>(topk_weights);
  a.num_topk = num_topk;
  a.num_local_experts = num_local_experts;
  a.recv_topk_idx = ptr<int64_t>(recv_topk_idx);
  a.recv_topk_weights = ptr<float>(recv_topk_weights);
  a.recv_src_idx = ptr<int32_t>(recv_src_idx);
  a.send_head = ptr<int32_t>(send_head);
  a.fwd_channel_prefix = ptr<const int32_t>(fwd_channel_prefix);
  a.fwd_rank_prefix = ptr<const int32_t>(fwd_rank_prefix);
  a.recv_src_meta = ptr<int32_t>(recv_src_meta);
  a.nvl_head = ptr<int32_t>(nvl_head);
  a.nvl_rows = nvl_rows;
  a.ring_rows = ring_rows_for(k.layout_, uint32_t(ht_dispatch_row(a).bytes), channels);
  check_forwarding(a.c, a.fwd_channel_prefix && a.fwd_rank_prefix, "dispatch");
  check(ht_dispatch(a), "HT dispatch");
}

void combine(const HTKernels& k, int channels, uintptr_t stream, uintptr_t x, int hidden, int num_tokens,
             uintptr_t is_token_in_rank, uintptr_t recv_prefix, int recv_prefix_stride, uintptr_t recv_channel_prefix,
             uintptr_t out, uintptr_t topk_weights, int num_topk, uintptr_t out_weights, uintptr_t bias0,
             uintptr_t bias1, uintptr_t fwd_channel_prefix, uintptr_t fwd_rank_prefix, uintptr_t nvl_head) {
  HTCombineArgs a{};
  a.c = k.common(channels, stream);
  a.x = ptr<const uint16_t>(x);
  a.hidden = hidden;
  a.num_tokens = num_tokens;
  a.is_token_in_rank = ptr<const bool>(is_token_in_rank);
  a.recv_prefix = ptr<const int32_t>(recv_prefix);
  a.recv_prefix_stride = recv_prefix_stride;
  a.recv_channel_prefix = ptr<const int32_t>(recv_channel_prefix);
  a.out = ptr<uint16_t>(out);
  a.topk_weights = ptr<const float>(topk_weights);
  a.num_topk = num_topk;
  a.out_weights = ptr<float>(out_weights);
  a.bias0 = ptr<const uint16_t>(bias0);
  a.bias1 = ptr<const uint16_t>(bias1);
  a.fwd_channel_prefix = ptr<const int32_t>(fwd_channel_prefix);
  a.fwd_rank_prefix = ptr<const int32_t>(fwd_rank_prefix);
  a.nvl_head = ptr<const int32_t>(nvl_head);
  a.ring_rows = ring_rows_for(k.layout_, ht_combine_row_bytes(ht_forwarding(a.c), a), channels);
  check_forwarding(a.c, a.fwd_channel_prefix && a.fwd_rank_prefix, "combine");  // (nvl_head: null when empty)
  check(ht_combine(a), "HT combine");
}

py::dict ctrl_layout(int num_ranks, int ranks_per_node) {
  check_ranks(num_ranks, ranks_per_node);
  const HTCtrl t = ht_ctrl(num_ranks, ranks_per_node);
  py::dict d;
  d["slots"] = t.slots;
  d["tails"] = t.tails;
  d["outgoing"] = t.outgoing;
  d["heads"] = t.heads;
  d["fwd_tails"] = t.fwd_tails;
  d["fwd_heads"] = t.fwd_heads;
  d["scratch"] = t.scratch;
  d["bytes"] = t.bytes;
  d["slot_bytes"] = kHTSlotBytes;
  d["word_table_bytes"] = t.word_half_bytes;  // one op's half of a tails/heads table
  d["fwd_table_bytes"] = t.fwd_half_bytes;    // one op's half of a forward tails/heads table
  return d;
}

py::dict slot_layout() {
  py::dict d;
  d["flag"] = kHTSlotFlagOff;
  d["counts"] = kHTSlotCountsOff;
  d["channels"] = kHTSlotChannelsOff;
  d["node_channels"] = kHTSlotNodeChannelsOff;
  d["experts"] = kHTSlotExpertsOff;
  d["bytes"] = kHTSlotBytes;
  return d;
}

py::dict streams() {  // the first stream of each kind, from stream_base
  const HTGeometry g{};
  py::dict d;
  d["notify"] = ht_notify_stream(g);
  d["dispatch_data"] = ht_data_stream(g, false, 0);
  d["combine_data"] = ht_data_stream(g, true, 0);
  d["dispatch_credits"] = ht_credit_stream(g, false, 0);
  d["combine_credits"] = ht_credit_stream(g, true, 0);
  return d;
}

void bind_layout(py::module_& m) {
  py::class_<HTLayout>(m, "HTLayout", "one rank's normal-mode memory (gpu_kernels/cuda/ht_layout.h)")
      .def(py::init(&make_layout), py::kw_only(), py::arg("num_ranks"), py::arg("ranks_per_node"), py::arg("proxy"),
           py::arg("ctrl_off"), py::arg("area_off"), py::arg("area_bytes"))
      .def_readonly("num_ranks", &HTLayout::num_ranks)
      .def_readonly("ranks_per_node", &HTLayout::ranks_per_node)
      .def_readonly("proxy", &HTLayout::proxy)
      .def_readonly("ctrl_off", &HTLayout::ctrl_off)
      .def_readonly("area_off", &HTLayout::area_off)
      .def_readonly("area_bytes", &HTLayout::area_bytes)
      .def_property_readonly("forwarding", &HTLayout::forwarding)
      .def_property_readonly("ctrl_bytes", [](const HTLayout& l) { return l.ctrl().bytes; })
      .def_property_readonly("blocks_per_channel",
                             [](const HTLayout& l) { return ht_blocks_per_channel(l.geometry(0)); })
      .def_property_readonly("recv_off", [](const HTLayout& l) { return l.areas().recv_off; })
      .def_property_readonly("recv_bytes", [](const HTLayout& l) { return l.areas().recv_bytes; })
      .def_property_readonly("stage_off", [](const HTLayout& l) { return l.areas().stage_off; })
      .def_property_readonly("stage_bytes", [](const HTLayout& l) { return l.areas().stage_bytes; })
      .def("rings", &HTLayout::rings, py::arg("num_channels"), "rings in the receive area for that many channels")
      .def("rows_per_ring", &HTLayout::rows_per_ring, py::arg("row_bytes"), py::arg("num_channels"))
      .def("area_bytes_for", &HTLayout::area_bytes_for, py::arg("ring_rows"), py::arg("row_bytes"),
           py::arg("num_channels"), "the normal-mode area that gives every ring ring_rows rows")
      .def_static(
          "dispatch_row_bytes",
          [](int row_bytes, int num_scales, int num_topk) {
            return ht_dispatch_row(HTRowShape{row_bytes, num_scales, num_topk, 0}).bytes;
          },
          py::arg("row_bytes"), py::arg("num_scales"), py::arg("num_topk"))
      .def(
          "combine_row_bytes",
          [](const HTLayout& l, int hidden, int num_topk) {
            return ht_combine_row_bytes(l.forwarding(), HTRowShape{0, 0, num_topk, hidden});
          },
          py::arg("hidden"), py::arg("num_topk"))
      .def_static("chunk_bytes", &ht_chunk_bytes, py::arg("row_bytes"), "bytes of one proxy WRITE of whole chunks");
}

}  // namespace

void bind_cuda_ht(py::module_& m) {
  // get_dispatch_layout's kernel (gpu_kernels/cuda/layout.cu)
  m.def(
      "cuda_dispatch_layout",
      [](py::handle topk_idx, int num_tokens, int num_topk, int num_experts, int num_ranks, int ranks_per_node,
         py::handle per_rank, py::handle per_node, py::handle per_expert, py::handle is_token_in_rank, uintptr_t stream,
         int rank, py::handle failed, uintptr_t error) {
        using portep::bind::Entries;
        using portep::bind::gpu_tensor;
        // every tensor on topk_idx's GPU, contiguous, of its dtype and exact size (python/src/tensor_arg.h)
        // (both arms py::object: with a py::none arm the conditional's type is py::none, which refuses an int)
        const py::object index =
            topk_idx.is_none() ? py::object(py::none()) : py::object(topk_idx.attr("device").attr("index"));
        const int dev = index.is_none() ? -1 : index.cast<int>();  // a CPU topk_idx is refused below, by name
        const int num_nodes = ranks_per_node > 0 ? num_ranks / ranks_per_node : 0;
        portep::cuda::LayoutArgs a{
            gpu_tensor<const int64_t>(topk_idx, "topk_idx", "int64", dev, int64_t(num_tokens) * num_topk,
                                      Entries::kExactly),
            num_tokens,
            num_topk,
            num_experts,
            num_ranks,
            ranks_per_node,
            gpu_tensor<int32_t>(per_rank, "per_rank", "int32", dev, num_ranks, Entries::kExactly),
            gpu_tensor<int32_t>(per_node, "per_node", "int32", dev, num_nodes, Entries::kExactly, true),
            gpu_tensor<int32_t>(per_expert, "per_expert", "int32", dev, num_experts, Entries::kExactly),
            gpu_tensor<bool>(is_token_in_rank, "is_token_in_rank", "bool", dev, int64_t(num_tokens) * num_ranks,
                             Entries::kExactly),
            reinterpret_cast<void*>(stream),
            rank,
            gpu_tensor<uint32_t>(failed, "failed", "int32", dev, portep::cuda::kNumErrorWords, Entries::kExactly),
            reinterpret_cast<portep::cuda::KernelError*>(error)};
        if (int err = portep::cuda::launch_dispatch_layout(a))
          throw std::runtime_error(std::string("cuda_dispatch_layout: ") + portep::cuda::cuda_error_string(err));
      },
      py::arg("topk_idx"), py::arg("num_tokens"), py::arg("num_topk"), py::arg("num_experts"), py::arg("num_ranks"),
      py::arg("ranks_per_node"), py::arg("per_rank"), py::arg("per_node"), py::arg("per_expert"),
      py::arg("is_token_in_rank"), py::arg("stream"), py::arg("rank"), py::arg("failed"), py::arg("error"));
  m.def("ht_ctrl_layout", &ctrl_layout, py::arg("num_ranks"), py::arg("ranks_per_node"),
        "the normal mode's control area for that many ranks (gpu_kernels/cuda/ht_layout.h: ht_ctrl)");
  m.attr("HT_SLOT_LAYOUT") = slot_layout();
  m.attr("HT_STREAMS") = streams();
  m.attr("HT_HOST_COUNTS_BYTES") = sizeof(HTHostCounts);
  m.attr("HT_EPOCH_WORDS") = kHTEpochWords;
  m.attr("HT_ALIGN") = kHTAlign;
  m.attr("HT_MAX_RANKS") = kHTMaxRanks;
  m.attr("HT_MAX_NODE_RANKS") = kHTMaxNodeRanks;
  m.attr("HT_MAX_NODES") = kHTMaxNodes;
  m.attr("HT_MAX_CHANNELS") = kHTMaxChannels;
  m.attr("HT_MAX_LOCAL_EXPERTS") = kHTMaxLocalExperts;
  m.attr("HT_NUM_STREAMS") = kHTNumStreams;
  m.attr("HT_CHUNK_ROWS") = kHTChunkRows;
  m.attr("HT_MIN_RING_ROWS") = kHTMinRingRows;
  m.attr("HT_MAX_WRITE_BYTES") = portep::kMaxCmdBytes;
  m.attr("HT_NVL_HEAD_COLUMNS") = kHTNvlHeadColumns;
  m.def(
      "ht_blocks_per_channel",
      [](int num_ranks, int ranks_per_node) { return ht_blocks_per_channel(HTGeometry{num_ranks, ranks_per_node}); },
      py::arg("num_ranks"), py::arg("ranks_per_node"));
  bind_layout(m);
  py::class_<HTKernels>(m, "HTKernels")
      .def(py::init<const HTLayout&, const PyFifoSet&, int, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t,
                    uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uint32_t, uint32_t,
                    double>(),
           py::arg("layout"), py::arg("fifos"), py::kw_only(), py::arg("rank"), py::arg("local"), py::arg("peers"),
           py::arg("place"), py::arg("epoch"), py::arg("host_counts"), py::arg("host_counts_device"), py::arg("error"),
           py::arg("error_host"), py::arg("failed"), py::arg("peer_status") = 0, py::arg("host_signals"),
           py::arg("signal_seen"), py::arg("num_streams"), py::arg("stream_base"), py::arg("timeout_s"),
           py::keep_alive<1, 3>())
      .def_property_readonly("layout", [](const HTKernels& k) { return k.layout_; })
      .def("wait_counts", &HTKernels::wait_counts, py::arg("ticket"), py::arg("num_local_experts"))
      .def("notify", &notify, py::kw_only(), py::arg("channels"), py::arg("stream"), py::arg("is_token_in_rank"),
           py::arg("count_mode") = false, py::arg("tokens_per_expert") = 0, py::arg("num_tokens") = 0,
           py::arg("num_experts") = 0, py::arg("recv_rank_prefix") = 0, py::arg("rank_prefix") = 0,
           py::arg("channel_prefix") = 0, py::arg("recv_channel_prefix") = 0, py::arg("node_channel_prefix") = 0,
           py::arg("fwd_channel_prefix") = 0, py::arg("fwd_rank_prefix") = 0, py::arg("max_recv") = 0,
           py::arg("ticket") = 0)
      .def("dispatch", &dispatch, py::kw_only(), py::arg("channels"), py::arg("stream"), py::arg("x"),
           py::arg("row_bytes"), py::arg("num_tokens"), py::arg("is_token_in_rank"), py::arg("recv_prefix"),
           py::arg("recv_prefix_stride"), py::arg("channel_prefix"), py::arg("recv_channel_prefix"),
           py::arg("max_recv"), py::arg("recv_x"), py::arg("scales") = 0, py::arg("num_scales") = 0,
           py::arg("recv_scales") = 0, py::arg("topk_idx") = 0, py::arg("topk_weights") = 0, py::arg("num_topk") = 0,
           py::arg("num_local_experts") = 0, py::arg("recv_topk_idx") = 0, py::arg("recv_topk_weights") = 0,
           py::arg("recv_src_idx") = 0, py::arg("send_head") = 0, py::arg("fwd_channel_prefix") = 0,
           py::arg("fwd_rank_prefix") = 0, py::arg("recv_src_meta") = 0, py::arg("nvl_head") = 0,
           py::arg("nvl_rows") = 0)
      .def("combine", &combine, py::kw_only(), py::arg("channels"), py::arg("stream"), py::arg("x"), py::arg("hidden"),
           py::arg("num_tokens"), py::arg("is_token_in_rank"), py::arg("recv_prefix"), py::arg("recv_prefix_stride"),
           py::arg("recv_channel_prefix"), py::arg("out"), py::arg("topk_weights") = 0, py::arg("num_topk") = 0,
           py::arg("out_weights") = 0, py::arg("bias0") = 0, py::arg("bias1") = 0, py::arg("fwd_channel_prefix") = 0,
           py::arg("fwd_rank_prefix") = 0, py::arg("nvl_head") = 0);
}
#endif
