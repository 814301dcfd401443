// Bindings of the CUDA normal-mode (HT) kernels (built with the CUDA kernels only): the layout of one rank's memory
// (ht_layout.h) as HTLayout, and one Buffer's kernels as HTKernels, whose constructor and calls take keyword
// arguments only. The calls take torch tensors (optional ones default to None, null for the kernels), each checked
// for its GPU, dtype and size; the constructor takes the Channel (its regions), tensors, and the mapped host words
// (count record, error records, peer status) as MappedHost objects (python/src/mapped_host.h).
#ifdef PORTEP_WITH_GPU
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "proxy/channel.h"
#include "python/src/bind_util.h"
#include "python/src/mapped_host.h"
#include "python/src/peer_table.h"
#include "python/src/tensor_arg.h"
#include "gpu_kernels/cuda/api.h"
#include "gpu_kernels/cuda/ht_api.h"

namespace py = pybind11;
using namespace portep::cuda;

namespace {

using portep::bind::check;
using portep::bind::Entries;
using portep::bind::GpuTensors;
using portep::bind::MappedHost;
using portep::bind::ptr;
using portep::bind::PyFifoSet;
using portep::bind::tensor_arg;
using portep::bind::TensorArg;

constexpr uint64_t kErrorBytes = sizeof(KernelError) * kNumErrorWords;  // the records: failures, notices

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

// The per-Buffer constants of HTCommon; each call adds its channels and stream. This rank's memory is the Channel's
// (its regions, and its same-node peers' written into `peers`), or for a Buffer without a Channel (the loopback
// benchmark) the tensors region, signals and peers.
class HTKernels {
 public:
  HTKernels(const HTLayout& layout, const PyFifoSet* fifos, int rank, const portep::Channel* channel, py::handle region,
            py::handle signals, py::handle peers, py::handle place, py::handle epoch, const MappedHost& host_counts,
            const MappedHost& errors, py::handle failed, const MappedHost* peer_status, py::handle signal_seen,
            uint32_t num_streams, uint32_t stream_base, double timeout_s)
      : layout_(layout),
        host_(static_cast<HTHostCounts*>(host_counts.host(sizeof(HTHostCounts), "host_counts"))),
        error_host_(static_cast<KernelError*>(errors.host(kErrorBytes, "errors"))),
        timeout_s_(timeout_s) {
    if (rank < 0 || rank >= layout.num_ranks)
      throw std::invalid_argument("rank=" + str(rank) + " must be in [0, " + str(layout.num_ranks) + ")");
    if (uint64_t(stream_base) + kHTNumStreams > num_streams)
      throw std::invalid_argument("stream_base=" + str(stream_base) + " + " + str(kHTNumStreams) +
                                  " normal-mode streams exceed num_streams=" + str(num_streams));
    if (layout.proxy && !fifos)
      throw std::invalid_argument("fifos: None, but peers through the proxies (layout.proxy) need the device FIFOs");
    const int64_t R = layout.num_ranks;
    GpuTensors t("HTKernels");
    auto* peer_table = t.entries<uint8_t*>(peers, "peers", "int64", R, Entries::kExactly, false);
    const auto* place_table = t.entries<uint8_t* const>(place, "place", "int64", R, Entries::kExactly, false);
    auto* epoch_words = t.entries<uint64_t>(epoch, "epoch", "int64", kHTEpochWords, Entries::kExactly, false);
    auto* failed_words = t.entries<uint32_t>(failed, "failed", "int32", kNumErrorWords, Entries::kExactly, false);
    auto* seen = t.entries<uint64_t>(signal_seen, "signal_seen", "int64", R * num_streams, Entries::kExactly, false);
    c_ = HTCommon{};
    const uint64_t end = std::max(layout.ctrl_off + layout.ctrl().bytes, layout.area_off + layout.area_bytes);
    if (channel) {
      if (!region.is_none() || !signals.is_none())
        throw py::value_error("region, signals: None with a channel (the kernels use the Channel's regions)");
      c_.local = static_cast<uint8_t*>(channel->device_address(portep::kRegionData));
      c_.host_signals = static_cast<uint64_t*>(channel->device_address(portep::kRegionSignal));
      if (!c_.local || !c_.host_signals) throw std::invalid_argument("channel: not connected (no device memory)");
      if (channel->data_bytes() < end)
        throw std::invalid_argument("channel: its region has " + str(channel->data_bytes()) +
                                    " bytes; the layout ends at " + str(end));
      std::vector<int> node_ranks(layout.ranks_per_node);  // this rank's node: the peers it stores into
      for (int l = 0; l < layout.ranks_per_node; ++l)
        node_ranks[l] = rank / layout.ranks_per_node * layout.ranks_per_node + l;
      portep::bind::write_peer_table(*channel, node_ranks, peer_table, R, true, "the normal mode on GPU tensors");
    } else {
      c_.local = t.entries<uint8_t>(region, "region", "uint8", int64_t(end), Entries::kAtLeast, false);
      c_.host_signals = t.entries<uint64_t>(signals, "signals", "int64", R * num_streams, Entries::kExactly, false);
    }
    const HTAreas areas = layout.areas();
    c_.rank = rank;
    c_.num_ranks = layout.num_ranks;
    c_.ranks_per_node = layout.ranks_per_node;
    c_.peers = peer_table;
    c_.place = place_table;
    c_.ctrl_off = layout.ctrl_off;
    c_.ctrl = layout.ctrl();
    c_.recv_off = areas.recv_off;
    c_.stage_off = areas.stage_off;
    c_.epoch = epoch_words;
    c_.host = static_cast<HTHostCounts*>(host_counts.device(sizeof(HTHostCounts), "host_counts"));
    if (peer_status) c_.peer_status = static_cast<const uint32_t*>(peer_status->device(4 * uint64_t(R), "peer_status"));
    c_.error = static_cast<KernelError*>(errors.device(kErrorBytes, "errors"));
    c_.failed = failed_words;
    c_.timeout_ns = uint64_t(timeout_s * 1e9);
    if (fifos) {
      c_.fifos = fifos->set_.device_views;
      c_.fifo_tails = fifos->set_.device_tails;
      c_.num_fifos = fifos->set_.count;
    }
    c_.signal_seen = seen;
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

// With forwarding the data kernels read the handle's node matrices; without, they must not be given. Given means
// not None (an empty tensor has no address, so a pointer cannot say it).
void check_forwarding(const HTCommon& c, py::handle channel_prefix, py::handle rank_prefix, const char* what) {
  const bool forwarding = ht_forwarding(c), given = !channel_prefix.is_none();
  if (given == rank_prefix.is_none())
    throw std::invalid_argument(std::string(what) + ": fwd_channel_prefix and fwd_rank_prefix: both or neither");
  if (forwarding != given)
    throw std::invalid_argument(std::string(what) + ": the forwarding arguments (fwd_channel_prefix, fwd_rank_prefix" +
                                (forwarding ? ") are required with " : ") must be null without ") +
                                "forwarding (num_ranks=" + str(c.num_ranks) +
                                ", ranks_per_node=" + str(c.ranks_per_node) + ")");
}

// Rows from sources 0..s to this rank, inclusive: the vector recv_prefix [R] (stride 1), or this rank's column of
// the one-node [R][R] matrix rank_prefix_matrix (stride R); exactly one of them.
void recv_prefix_of(GpuTensors& t, const HTCommon& c, py::handle vector, py::handle matrix, const int32_t** prefix,
                    int* stride) {
  const int R = c.num_ranks;
  if (vector.is_none() == matrix.is_none())
    throw py::value_error("recv_prefix ([R] vector) or rank_prefix_matrix ([R][R]): exactly one is needed");
  if (!vector.is_none()) {
    *prefix = t.entries<const int32_t>(vector, "recv_prefix", "int32", R, Entries::kExactly, false);
    *stride = 1;
    return;
  }
  *prefix = t.entries<const int32_t>(matrix, "rank_prefix_matrix", "int32", int64_t(R) * R, Entries::kExactly, false) +
            c.rank;
  *stride = R;
}

void notify(const HTKernels& k, int channels, uintptr_t stream, bool count_mode, py::handle is_token_in_rank,
            py::handle tokens_per_expert, int num_tokens, int num_experts, py::handle recv_rank_prefix,
            py::handle rank_prefix, py::handle channel_prefix, py::handle recv_channel_prefix,
            py::handle node_channel_prefix, py::handle fwd_channel_prefix, py::handle fwd_rank_prefix, int64_t max_recv,
            uint64_t ticket) {
  HTNotifyArgs a{};
  a.c = k.common(channels, stream);
  a.count_mode = count_mode;
  a.num_tokens = num_tokens;
  a.num_experts = num_experts;
  a.max_recv = max_recv;
  a.ticket = ticket;
  if (!count_mode) {  // a flag: the slots carry nothing else
    if (!(is_token_in_rank.is_none() && tokens_per_expert.is_none() && recv_rank_prefix.is_none() &&
          rank_prefix.is_none() && channel_prefix.is_none() && recv_channel_prefix.is_none() &&
          node_channel_prefix.is_none() && fwd_channel_prefix.is_none() && fwd_rank_prefix.is_none()))
      throw py::value_error("notify: without count_mode it takes no tensors (a flag exchange)");
    check(ht_notify(a), "HT notify");
    return;
  }
  const int64_t R = a.c.num_ranks, Nn = R / a.c.ranks_per_node, C = channels;
  if (num_tokens < 0 || num_experts < 1 || num_experts % R)
    throw py::value_error("notify: num_tokens=" + str(num_tokens) + " (>= 0), num_experts=" + str(num_experts) +
                          " (a positive multiple of num_ranks=" + str(R) + ")");
  GpuTensors t("notify");
  a.is_token_in_rank =
      t.entries<const bool>(is_token_in_rank, "is_token_in_rank", "bool", num_tokens * R, Entries::kExactly, false);
  a.tokens_per_expert =
      t.entries<const int32_t>(tokens_per_expert, "tokens_per_expert", "int32", num_experts, Entries::kExactly, false);
  a.recv_rank_prefix = t.entries<int32_t>(recv_rank_prefix, "recv_rank_prefix", "int32", R, Entries::kExactly, false);
  a.rank_prefix = t.entries<int32_t>(rank_prefix, "rank_prefix", "int32", R * R);
  a.channel_prefix = t.entries<int32_t>(channel_prefix, "channel_prefix", "int32", R * C, Entries::kExactly, false);
  a.recv_channel_prefix =
      t.entries<int32_t>(recv_channel_prefix, "recv_channel_prefix", "int32", R * C, Entries::kExactly, false);
  a.node_channel_prefix = t.entries<int32_t>(node_channel_prefix, "node_channel_prefix", "int32", Nn * C);
  a.fwd_channel_prefix = t.entries<int32_t>(fwd_channel_prefix, "fwd_channel_prefix", "int32", Nn * C);
  a.fwd_rank_prefix = t.entries<int32_t>(fwd_rank_prefix, "fwd_rank_prefix", "int32", Nn);
  if (a.rank_prefix && Nn > 1)
    throw py::value_error("notify: rank_prefix (the [R][R] matrix) is for one node only, num_ranks=" + str(R) +
                          " ranks_per_node=" + str(a.c.ranks_per_node));
  const int given =
      int(!node_channel_prefix.is_none()) + int(!fwd_channel_prefix.is_none()) + int(!fwd_rank_prefix.is_none());
  if (given != (ht_forwarding(a.c) ? 3 : 0))
    throw py::value_error(
        "notify: node_channel_prefix, fwd_channel_prefix, fwd_rank_prefix: all with forwarding, "
        "none without");
  check(ht_notify(a), "HT notify");
}

void dispatch(const HTKernels& k, int channels, uintptr_t stream, py::handle x, int row_bytes, int num_tokens,
              py::handle is_token_in_rank, py::handle recv_prefix, py::handle rank_prefix_matrix,
              py::handle channel_prefix, py::handle recv_channel_prefix, int64_t max_recv, py::handle recv_x,
              py::handle scales, int num_scales, py::handle recv_scales, py::handle topk_idx, py::handle topk_weights,
              int num_topk, int num_local_experts, py::handle recv_topk_idx, py::handle recv_topk_weights,
              py::handle recv_src_idx, py::handle send_head, py::handle fwd_channel_prefix, py::handle fwd_rank_prefix,
              py::handle recv_src_meta, py::handle nvl_head, int64_t nvl_rows) {
  HTDispatchArgs a{};
  a.c = k.common(channels, stream);
  const int64_t R = a.c.num_ranks, Nn = R / a.c.ranks_per_node, C = channels, N = num_tokens;
  if (num_tokens < 0 || row_bytes < 1 || max_recv < 0 || num_scales < 0 || num_topk < 0 || nvl_rows < 0)
    throw py::value_error("dispatch: num_tokens=" + str(num_tokens) + ", row_bytes=" + str(row_bytes) + ", max_recv=" +
                          str(max_recv) + ", num_scales=" + str(num_scales) + ", num_topk=" + str(num_topk) +
                          ", nvl_rows=" + str(nvl_rows) + ": row_bytes must be positive, the others >= 0");
  GpuTensors t("dispatch");
  a.x = t.bytes<const uint8_t>(x, "x", N * row_bytes, false);
  a.row_bytes = row_bytes;
  a.num_tokens = num_tokens;
  a.is_token_in_rank =
      t.entries<const bool>(is_token_in_rank, "is_token_in_rank", "bool", N * R, Entries::kExactly, false);
  recv_prefix_of(t, a.c, recv_prefix, rank_prefix_matrix, &a.recv_prefix, &a.recv_prefix_stride);
  a.channel_prefix =
      t.entries<const int32_t>(channel_prefix, "channel_prefix", "int32", R * C, Entries::kExactly, false);
  a.recv_channel_prefix =
      t.entries<const int32_t>(recv_channel_prefix, "recv_channel_prefix", "int32", R * C, Entries::kExactly, false);
  a.max_recv = max_recv;
  a.recv_x = t.bytes<uint8_t>(recv_x, "recv_x", max_recv * row_bytes, false);
  a.scales = t.bytes<const float>(scales, "scales", N * num_scales * 4);
  // from the argument, not the pointer: a rank with no tokens passes empty scales (no address) but receives
  // FP8 rows with scales, laid out as its peers lay them out
  a.num_scales = scales.is_none() ? 0 : num_scales;
  a.recv_scales = t.bytes<float>(recv_scales, "recv_scales", max_recv * num_scales * 4);
  a.topk_idx = t.entries<const int64_t>(topk_idx, "topk_idx", "int64", N * num_topk);
  a.topk_weights = t.entries<const float>(topk_weights, "topk_weights", "float32", N * num_topk);
  a.num_topk = num_topk;
  a.num_local_experts = num_local_experts;
  a.recv_topk_idx = t.entries<int64_t>(recv_topk_idx, "recv_topk_idx", "int64", max_recv * num_topk);
  a.recv_topk_weights = t.entries<float>(recv_topk_weights, "recv_topk_weights", "float32", max_recv * num_topk);
  a.recv_src_idx = t.entries<int32_t>(recv_src_idx, "recv_src_idx", "int32", max_recv);
  a.send_head = t.entries<int32_t>(send_head, "send_head", "int32", N * R);
  a.fwd_channel_prefix = t.entries<const int32_t>(fwd_channel_prefix, "fwd_channel_prefix", "int32", Nn * C);
  a.fwd_rank_prefix = t.entries<const int32_t>(fwd_rank_prefix, "fwd_rank_prefix", "int32", Nn);
  a.recv_src_meta = t.entries<int32_t>(recv_src_meta, "recv_src_meta", "int32", max_recv * 2);
  a.nvl_head = t.entries<int32_t>(nvl_head, "nvl_head", "int32", nvl_rows * kHTNvlHeadColumns);
  a.nvl_rows = nvl_head.is_none() ? 0 : nvl_rows;
  if ((scales.is_none() != recv_scales.is_none()) || (topk_idx.is_none() != topk_weights.is_none()))
    throw py::value_error("dispatch: scales with recv_scales, topk_idx with topk_weights: both or neither");
  a.ring_rows = ring_rows_for(k.layout_, uint32_t(ht_dispatch_row(a).bytes), channels);
  check_forwarding(a.c, fwd_channel_prefix, fwd_rank_prefix, "dispatch");
  check(ht_dispatch(a), "HT dispatch");
}

void combine(const HTKernels& k, int channels, uintptr_t stream, py::handle x, int hidden, int num_tokens,
             py::handle is_token_in_rank, py::handle recv_prefix, py::handle rank_prefix_matrix,
             py::handle recv_channel_prefix, py::handle out, py::handle topk_weights, int num_topk,
             py::handle out_weights, py::handle bias0, py::handle bias1, py::handle fwd_channel_prefix,
             py::handle fwd_rank_prefix, py::handle nvl_head) {
  HTCombineArgs a{};
  a.c = k.common(channels, stream);
  const int64_t R = a.c.num_ranks, Nn = R / a.c.ranks_per_node, C = channels, N = num_tokens;
  if (num_tokens < 0 || hidden < 1 || num_topk < 0)
    throw py::value_error("combine: num_tokens=" + str(num_tokens) + " (>= 0), hidden=" + str(hidden) +
                          " (>= 1), num_topk=" + str(num_topk) + " (>= 0)");
  GpuTensors t("combine");
  const TensorArg rows = tensor_arg(x, "x", "bfloat16", "cuda", -1);
  if (rows.numel % hidden)
    throw py::value_error("combine: x has " + str(rows.numel) + " entries, not rows of hidden=" + str(hidden));
  const int64_t num_recv = rows.numel / hidden;
  a.x = t.entries<const uint16_t>(x, "x", "bfloat16", num_recv * hidden, Entries::kExactly, false);
  a.hidden = hidden;
  a.num_tokens = num_tokens;
  a.is_token_in_rank =
      t.entries<const bool>(is_token_in_rank, "is_token_in_rank", "bool", N * R, Entries::kExactly, false);
  recv_prefix_of(t, a.c, recv_prefix, rank_prefix_matrix, &a.recv_prefix, &a.recv_prefix_stride);
  a.recv_channel_prefix =
      t.entries<const int32_t>(recv_channel_prefix, "recv_channel_prefix", "int32", R * C, Entries::kExactly, false);
  a.out = t.entries<uint16_t>(out, "out", "bfloat16", N * hidden, Entries::kExactly, false);
  a.topk_weights = t.entries<const float>(topk_weights, "topk_weights", "float32", num_recv * num_topk);
  a.num_topk = num_topk;
  a.out_weights = t.entries<float>(out_weights, "out_weights", "float32", N * num_topk);
  a.bias0 = t.entries<const uint16_t>(bias0, "bias0", "bfloat16", N * hidden);
  a.bias1 = t.entries<const uint16_t>(bias1, "bias1", "bfloat16", N * hidden);
  a.fwd_channel_prefix = t.entries<const int32_t>(fwd_channel_prefix, "fwd_channel_prefix", "int32", Nn * C);
  a.fwd_rank_prefix = t.entries<const int32_t>(fwd_rank_prefix, "fwd_rank_prefix", "int32", Nn);
  a.nvl_head = t.entries<const int32_t>(nvl_head, "nvl_head", "int32", 0, Entries::kAtLeast);
  if (topk_weights.is_none() != out_weights.is_none() || (!bias1.is_none() && bias0.is_none()))
    throw py::value_error("combine: topk_weights with out_weights (both or neither); bias1 only with bias0");
  a.ring_rows = ring_rows_for(k.layout_, ht_combine_row_bytes(ht_forwarding(a.c), a), channels);
  check_forwarding(a.c, fwd_channel_prefix, fwd_rank_prefix, "combine");  // (nvl_head: null when empty)
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
         int rank, py::handle failed, const MappedHost& errors) {
        // every tensor on topk_idx's GPU, contiguous, of its dtype and exact size (python/src/tensor_arg.h); the
        // initializer's elements are evaluated in order, so topk_idx names the GPU
        GpuTensors t("cuda_dispatch_layout");
        const int num_nodes = ranks_per_node > 0 ? num_ranks / ranks_per_node : 0;
        portep::cuda::LayoutArgs a{
            t.entries<const int64_t>(topk_idx, "topk_idx", "int64", int64_t(num_tokens) * num_topk, Entries::kExactly,
                                     false),
            num_tokens,
            num_topk,
            num_experts,
            num_ranks,
            ranks_per_node,
            t.entries<int32_t>(per_rank, "per_rank", "int32", num_ranks, Entries::kExactly, false),
            t.entries<int32_t>(per_node, "per_node", "int32", num_nodes, Entries::kExactly, true),
            t.entries<int32_t>(per_expert, "per_expert", "int32", num_experts, Entries::kExactly, false),
            t.entries<bool>(is_token_in_rank, "is_token_in_rank", "bool", int64_t(num_tokens) * num_ranks,
                            Entries::kExactly, false),
            reinterpret_cast<void*>(stream),
            rank,
            t.entries<uint32_t>(failed, "failed", "int32", portep::cuda::kNumErrorWords, Entries::kExactly, false),
            static_cast<portep::cuda::KernelError*>(errors.device(kErrorBytes, "errors"))};
        if (int err = portep::cuda::launch_dispatch_layout(a))
          throw std::runtime_error(std::string("cuda_dispatch_layout: ") + portep::cuda::cuda_error_string(err));
      },
      py::arg("topk_idx"), py::arg("num_tokens"), py::arg("num_topk"), py::arg("num_experts"), py::arg("num_ranks"),
      py::arg("ranks_per_node"), py::arg("per_rank"), py::arg("per_node"), py::arg("per_expert"),
      py::arg("is_token_in_rank"), py::arg("stream"), py::arg("rank"), py::arg("failed"), py::arg("errors"));
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
      .def(py::init<const HTLayout&, const PyFifoSet*, int, const portep::Channel*, py::handle, py::handle, py::handle,
                    py::handle, py::handle, const MappedHost&, const MappedHost&, py::handle, const MappedHost*,
                    py::handle, uint32_t, uint32_t, double>(),
           py::arg("layout"), py::arg("fifos"), py::kw_only(), py::arg("rank"), py::arg("channel") = nullptr,
           py::arg("region") = py::none(), py::arg("signals") = py::none(), py::arg("peers"), py::arg("place"),
           py::arg("epoch"), py::arg("host_counts"), py::arg("errors"), py::arg("failed"),
           py::arg("peer_status") = nullptr, py::arg("signal_seen"), py::arg("num_streams"), py::arg("stream_base"),
           py::arg("timeout_s"), py::keep_alive<1, 3>(), py::keep_alive<1, 5>(), py::keep_alive<1, 11>(),
           py::keep_alive<1, 12>(), py::keep_alive<1, 14>())
      .def_property_readonly("layout", [](const HTKernels& k) { return k.layout_; })
      .def("wait_counts", &HTKernels::wait_counts, py::arg("ticket"), py::arg("num_local_experts"))
      .def("notify", &notify, py::kw_only(), py::arg("channels"), py::arg("stream"), py::arg("count_mode") = false,
           py::arg("is_token_in_rank") = py::none(), py::arg("tokens_per_expert") = py::none(),
           py::arg("num_tokens") = 0, py::arg("num_experts") = 0, py::arg("recv_rank_prefix") = py::none(),
           py::arg("rank_prefix") = py::none(), py::arg("channel_prefix") = py::none(),
           py::arg("recv_channel_prefix") = py::none(), py::arg("node_channel_prefix") = py::none(),
           py::arg("fwd_channel_prefix") = py::none(), py::arg("fwd_rank_prefix") = py::none(), py::arg("max_recv") = 0,
           py::arg("ticket") = 0)
      .def("dispatch", &dispatch, py::kw_only(), py::arg("channels"), py::arg("stream"), py::arg("x"),
           py::arg("row_bytes"), py::arg("num_tokens"), py::arg("is_token_in_rank"),
           py::arg("recv_prefix") = py::none(), py::arg("rank_prefix_matrix") = py::none(), py::arg("channel_prefix"),
           py::arg("recv_channel_prefix"), py::arg("max_recv"), py::arg("recv_x"), py::arg("scales") = py::none(),
           py::arg("num_scales") = 0, py::arg("recv_scales") = py::none(), py::arg("topk_idx") = py::none(),
           py::arg("topk_weights") = py::none(), py::arg("num_topk") = 0, py::arg("num_local_experts") = 0,
           py::arg("recv_topk_idx") = py::none(), py::arg("recv_topk_weights") = py::none(),
           py::arg("recv_src_idx") = py::none(), py::arg("send_head") = py::none(),
           py::arg("fwd_channel_prefix") = py::none(), py::arg("fwd_rank_prefix") = py::none(),
           py::arg("recv_src_meta") = py::none(), py::arg("nvl_head") = py::none(), py::arg("nvl_rows") = 0)
      .def("combine", &combine, py::kw_only(), py::arg("channels"), py::arg("stream"), py::arg("x"), py::arg("hidden"),
           py::arg("num_tokens"), py::arg("is_token_in_rank"), py::arg("recv_prefix") = py::none(),
           py::arg("rank_prefix_matrix") = py::none(), py::arg("recv_channel_prefix"), py::arg("out"),
           py::arg("topk_weights") = py::none(), py::arg("num_topk") = 0, py::arg("out_weights") = py::none(),
           py::arg("bias0") = py::none(), py::arg("bias1") = py::none(), py::arg("fwd_channel_prefix") = py::none(),
           py::arg("fwd_rank_prefix") = py::none(), py::arg("nvl_head") = py::none());
}
#endif
