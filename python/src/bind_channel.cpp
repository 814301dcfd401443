// Bindings of Channel (transport + regions + proxies) and the host row kernels.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "gpu_kernels/host/channel_ops.h"
#include "gpu_kernels/host/logfmt_rows.h"
#include "gpu_kernels/host/row_kernels.h"
#include "gpu_kernels/logfmt.h"
#include "ordering/imm.h"
#include "proxy/channel.h"
#include "proxy/transfer_cmd.h"

namespace py = pybind11;
using namespace portep;

namespace {
std::unique_ptr<Channel> make_channel(int rank, int num_ranks, uint64_t nbytes, const std::string& transport,
                                      int num_proxy_threads, int num_fifos, uint32_t fifo_capacity,
                                      uint32_t num_streams, uint32_t max_inflight_cmds, uint64_t max_inflight_bytes,
                                      double timeout_s, uint32_t unordered_window, uint64_t seed, bool skip_ordering,
                                      int device, double idle_spin_us, int status_stream) {
  ChannelOptions o;
  o.transport.device = device;
  o.data_bytes = nbytes;
  o.transport.name = transport;
  o.transport.window = unordered_window;
  o.transport.seed = seed;
  o.proxy.rank = rank;
  o.proxy.num_ranks = num_ranks;
  o.proxy.num_threads = num_proxy_threads;
  o.proxy.num_fifos = num_fifos;
  o.proxy.fifo_capacity = fifo_capacity;
  o.proxy.num_streams = num_streams;
  o.proxy.max_inflight_cmds = max_inflight_cmds;
  o.proxy.max_inflight_bytes = max_inflight_bytes;
  o.proxy.timeout_s = timeout_s;
  o.proxy.skip_ordering = skip_ordering;
  o.proxy.idle_spin_us = idle_spin_us;
  o.proxy.status_stream = status_stream;
  return std::make_unique<Channel>(o);
}

// A byte range of a Channel's memory that keeps that memory mapped while Python holds it (torch.frombuffer and
// __cuda_array_interface__ views keep their source object): a view used after Channel.destroy() reads memory that is
// still there instead of unmapped pages.
struct RegionLease {
  std::shared_ptr<const Transport> owner;
  uint8_t* data;
  size_t bytes;
};

RegionLease lease(const Channel& c, void* data, size_t bytes) {
  if (!data) throw std::runtime_error("this Channel's region is not mapped here");
  return RegionLease{c.memory_owner(), static_cast<uint8_t*>(data), bytes};
}

py::dict stats_dict(const ProxyThreadStats& s) {
  py::dict d;
  d["commands"] = s.commands;
  d["writes"] = s.writes;
  d["signals"] = s.signals;
  d["bytes"] = s.bytes;
  d["notices"] = s.notices;
  d["held_signals"] = s.held_signals;
  d["in_flight"] = s.in_flight;
  d["signals_delayed"] = s.signals_delayed;
  d["queued"] = s.backlog.queued;
  d["copying"] = s.backlog.copying;
  d["notify_full"] = s.backlog.notify_full;
  d["polls"] = s.polls;
  d["post_ns"] = s.post_ns;
  d["poll_ns"] = s.poll_ns;
  d["completed"] = s.completed;
  d["op_latency_ns"] = s.op_latency_ns;
  d["op_latency_max_ns"] = s.op_latency_max_ns;
  return d;
}
}  // namespace

void bind_channel(py::module_& m) {
  py::class_<RegionLease>(m, "RegionLease", py::buffer_protocol())
      .def_buffer([](RegionLease& l) {
        return py::buffer_info(l.data, 1, py::format_descriptor<uint8_t>::format(), 1, {py::ssize_t(l.bytes)}, {1});
      })
      .def_property_readonly("address", [](const RegionLease& l) { return reinterpret_cast<uintptr_t>(l.data); })
      .def_property_readonly("nbytes", [](const RegionLease& l) { return l.bytes; });
  py::class_<Channel>(m, "Channel")
      .def(py::init(&make_channel), py::arg("rank"), py::arg("num_ranks"), py::arg("nbytes"), py::arg("transport"),
           py::arg("num_proxy_threads"), py::arg("num_fifos"), py::arg("fifo_capacity"), py::arg("num_streams"),
           py::arg("max_inflight_cmds"), py::arg("max_inflight_bytes"), py::arg("timeout_s"),
           py::arg("unordered_window"), py::arg("seed"), py::arg("skip_ordering"), py::arg("device") = -1,
           py::arg("idle_spin_us") = 0.0, py::arg("status_stream") = -1)
      // The C++ object's address, for native test hooks built from the same sources (portep_testing).
      .def_property_readonly("native_handle", [](Channel& c) { return reinterpret_cast<uintptr_t>(&c); })
      .def(
          "attach_device_fifos",
          [](Channel& c, uintptr_t host_views, int count) {
            auto* v = reinterpret_cast<const FifoView*>(host_views);
            c.proxies().attach_device_fifos(std::vector<FifoView>(v, v + count));
          },
          py::arg("host_views"), py::arg("count"))
      .def("device_data_ptr", [](Channel& c) { return reinterpret_cast<uintptr_t>(c.device_address(kRegionData)); })
      .def("device_signals_ptr",
           [](Channel& c) { return reinterpret_cast<uintptr_t>(c.device_address(kRegionSignal)); })
      .def(
          "peer_data_ptr", [](Channel& c, int dst) { return reinterpret_cast<uintptr_t>(c.peer_data(dst)); },
          py::arg("dst"))
      .def("endpoint_blob", [](Channel& c) { return py::bytes(c.endpoint_blob()); })
      .def("connect",
           [](Channel& c, const std::vector<py::bytes>& blobs) {
             std::vector<std::string> v;
             for (auto& b : blobs) v.push_back(std::string(b));
             c.connect(v);
           })
      .def("bootstrap_done", &Channel::bootstrap_done)
      .def("destroy", &Channel::destroy, py::call_guard<py::gil_scoped_release>())
      .def("write", &Channel::write, py::arg("dst"), py::arg("local_offset"), py::arg("remote_offset"),
           py::arg("nbytes"), py::arg("stream"), py::call_guard<py::gil_scoped_release>())
      .def("signal", &Channel::signal, py::arg("dst"), py::arg("stream"), py::arg("final"),
           py::call_guard<py::gil_scoped_release>())
      .def("quiet", &Channel::quiet, py::call_guard<py::gil_scoped_release>())
      .def("barrier", &Channel::barrier, py::call_guard<py::gil_scoped_release>())
      .def("wait_signal", &Channel::wait_signal, py::arg("src"), py::arg("stream"), py::arg("count"),
           py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>())
      .def("check_error", [](Channel& c) { c.proxies().check_error(); })
      .def("data_view", [](Channel& c) { return lease(c, c.data(), c.data_bytes()); })
      .def("signal_view", [](Channel& c) { return lease(c, c.signals(), c.signal_slots() * 8); })
      .def("device_data_lease", [](Channel& c) { return lease(c, c.device_address(kRegionData), c.data_bytes()); })
      .def(
          "write_rows",
          [](Channel& c, int dst, uintptr_t local_offs, uintptr_t remote_offs, size_t n, uint64_t row_bytes,
             uint32_t stream, bool merge) {
            return host::write_rows(c, dst, reinterpret_cast<const int64_t*>(local_offs),
                                    reinterpret_cast<const int64_t*>(remote_offs), n, row_bytes, stream, merge);
          },
          py::arg("dst"), py::arg("local_offsets_ptr"), py::arg("remote_offsets_ptr"), py::arg("n"),
          py::arg("row_bytes"), py::arg("stream"), py::arg("merge"), py::call_guard<py::gil_scoped_release>())
      .def(
          "write_rows_streams",
          [](Channel& c, int dst, uintptr_t lo, uintptr_t ro, uintptr_t streams, size_t n, uint64_t row_bytes) {
            host::write_rows_streams(c, dst, reinterpret_cast<const int64_t*>(lo), reinterpret_cast<const int64_t*>(ro),
                                     reinterpret_cast<const int64_t*>(streams), n, row_bytes);
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "signal_many",
          [](Channel& c, size_t n, uintptr_t dsts, uintptr_t streams, uintptr_t units, uintptr_t direct) {
            host::signal_many(c, n, reinterpret_cast<const int64_t*>(dsts), reinterpret_cast<const int64_t*>(streams),
                              reinterpret_cast<const int64_t*>(units), reinterpret_cast<const uint8_t*>(direct));
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "consume_many",
          [](Channel& c, size_t n, uintptr_t srcs, uintptr_t streams, uintptr_t units_out, uintptr_t wait_out,
             double timeout_s, uintptr_t mask) {
            host::consume_many(c, n, reinterpret_cast<const int64_t*>(srcs), reinterpret_cast<const int64_t*>(streams),
                               reinterpret_cast<int64_t*>(units_out), reinterpret_cast<int64_t*>(wait_out), timeout_s,
                               reinterpret_cast<uint8_t*>(mask));
          },
          py::arg("n"), py::arg("srcs"), py::arg("streams"), py::arg("units_out"), py::arg("wait_out"),
          py::arg("timeout_s"), py::arg("mask") = 0, py::call_guard<py::gil_scoped_release>())
      .def(
          "announce",
          [](Channel& c, int kind) {
            if (kind < 0 || kind >= kNumStatusEvents)
              throw std::invalid_argument("announce: kind " + std::to_string(kind));
            c.announce(StatusEvent(kind));
          },
          py::arg("kind"))
      .def("peer_status", &Channel::peer_status, py::arg("peer"))
      .def(
          "status_events",
          [](Channel& c, int src, int kind) {
            if (kind < 0 || kind >= kNumStatusEvents)
              throw std::invalid_argument("status_events: kind " + std::to_string(kind));
            return c.status_events(src, StatusEvent(kind));
          },
          py::arg("src"), py::arg("kind"))
      .def(
          "mirror_peer_status",
          [](Channel& c, uintptr_t words) {
            PeerWatch* w = c.proxies().peer_watch();
            if (!w) throw std::logic_error("mirror_peer_status: this Channel has no status streams");
            w->mirror_to(reinterpret_cast<uint32_t*>(words));
          },
          py::arg("words"))
      .def("peer_data_view",
           [](Channel& c, int dst) -> py::object {
             uint8_t* p = c.peer_data(dst);
             if (!p) return py::none();
             return py::cast(lease(c, p, c.peer_data_bytes(dst)));
           })
      .def("direct_signal", &Channel::direct_signal, py::arg("dst"), py::arg("stream"), py::arg("units"),
           py::arg("final"))
      .def("consume_signal", &Channel::consume_signal, py::arg("src"), py::arg("stream"), py::arg("min_units"),
           py::arg("need_final"), py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("alive", &Channel::alive)
      .def_property_readonly("transport_ordered", [](Channel& c) { return c.transport_props().ordered; })
      .def_property_readonly("transport_remote_atomics", [](Channel& c) { return c.transport_props().remote_atomics; })
      .def_property_readonly("transport_name", [](Channel& c) { return c.transport_props().name; })
      .def_property_readonly("transport_placed_writes", [](Channel& c) { return c.transport_props().placed_writes; })
      .def_property_readonly("native_signals", [](Channel& c) { return c.proxies().ordered_protocol(); })
      .def("describe_peer", &Channel::describe_peer, py::arg("peer"))
      .def("fifo_for", [](Channel& c, uint32_t dst, uint32_t stream) { return c.proxies().fifo_for(dst, stream); })
      .def("stats", [](Channel& c) {
        py::list l;
        for (auto& s : c.proxies().stats()) l.append(stats_dict(s));
        return l;
      });

  m.def(
      "copy_rows",
      [](uintptr_t dst, int64_t dst_pitch, uintptr_t dst_idx, uintptr_t src, int64_t src_pitch, uintptr_t src_idx,
         int64_t n, int64_t row_bytes) {
        host_copy_rows(reinterpret_cast<uint8_t*>(dst), dst_pitch, reinterpret_cast<const int64_t*>(dst_idx),
                       reinterpret_cast<const uint8_t*>(src), src_pitch, reinterpret_cast<const int64_t*>(src_idx), n,
                       row_bytes);
      },
      py::call_guard<py::gil_scoped_release>());
  m.def("reduce_rows",
        // sources: list of (base_ptr, pitch_bytes, dtype, index_ptr, weight_ptr or 0)
        [](uintptr_t out, int64_t out_pitch, int out_dtype, int64_t n, int64_t width,
           const std::vector<std::tuple<uintptr_t, int64_t, int, uintptr_t, uintptr_t>>& sources, uintptr_t init) {
          std::vector<ReduceSource> v;
          for (auto& [base, pitch, dtype, index, weight] : sources)
            v.push_back(ReduceSource{reinterpret_cast<const uint8_t*>(base), pitch, dtype,
                                     reinterpret_cast<const int64_t*>(index), reinterpret_cast<const float*>(weight)});
          py::gil_scoped_release nogil;
          host_reduce_rows(reinterpret_cast<uint8_t*>(out), out_pitch, out_dtype, n, width, v.data(), int(v.size()),
                           reinterpret_cast<const float*>(init));
        });
  m.def(
      "logfmt_encode_rows",
      [](uintptr_t dst, int64_t dst_pitch, uintptr_t dst_idx, uintptr_t src, int64_t src_pitch, uintptr_t src_idx,
         int64_t n, int hidden, uint32_t seq) {
        host_logfmt_encode_rows(reinterpret_cast<uint8_t*>(dst), dst_pitch, reinterpret_cast<const int64_t*>(dst_idx),
                                reinterpret_cast<const uint8_t*>(src), src_pitch,
                                reinterpret_cast<const int64_t*>(src_idx), n, hidden, seq);
      },
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "logfmt_row_seqs",
      [](uintptr_t out, uintptr_t base, int64_t pitch, uintptr_t idx, int64_t n, int hidden) {
        host_logfmt_row_seqs(reinterpret_cast<uint32_t*>(out), reinterpret_cast<const uint8_t*>(base), pitch,
                             reinterpret_cast<const int64_t*>(idx), n, hidden);
      },
      py::call_guard<py::gil_scoped_release>());
  m.def("logfmt_layout", [](int hidden) {  // gpu_kernels/logfmt.h's sizes for one hidden size
    py::dict d;
    d["ok"] = logfmt_hidden_ok(hidden);
    d["min_hidden"] = kLogfmtMinHidden;
    d["chunk"] = logfmt_chunk(hidden);
    d["meta_bytes"] = logfmt_meta_bytes(hidden);
    d["cast_row_bytes"] = logfmt_cast_row_bytes(hidden);
    d["max_row_bytes"] = logfmt_max_row_bytes(hidden);
    return d;
  });
  m.attr("ROW_LOGFMT") = int(kRowLogfmt);
  // The wire formats' limits, which Channel's argument checks name.
  m.attr("MAX_RANKS") = kMaxRanks;
  m.attr("MAX_STREAMS") = kMaxStreams;
  m.attr("IMM_MAX_STREAMS") = imm::kMaxStreams;
  m.attr("MAX_CMD_BYTES") = kMaxCmdBytes;
  m.attr("OFFSET_ALIGN") = kOffsetAlign;  // offsets and region sizes are multiples of this
  m.attr("ROW_BF16") = int(kRowBf16);     // the row kernels' dtypes (gpu_kernels/host/row_kernels.h)
  m.attr("ROW_F32") = int(kRowF32);
  m.def("live_proxy_threads", &ProxyGroup::live_threads);
  m.attr("PEER_OK") = int(kPeerOk);
  m.attr("PEER_REFUSED") = int(kPeerRefused);
  m.attr("PEER_FAILED") = int(kPeerFailed);
  m.attr("PEER_LEFT") = int(kPeerLeft);
  m.attr("PEER_GONE") = int(kPeerGone);
  m.attr("EVENT_REFUSED") = int(kEventRefused);
  m.attr("EVENT_FAILED") = int(kEventFailed);
  m.attr("EVENT_LEFT") = int(kEventLeft);
  m.attr("NUM_STATUS_EVENTS") = int(kNumStatusEvents);
  m.def("peer_status_text", [](uint32_t s) { return std::string(peer_status_text(s)); });
}
