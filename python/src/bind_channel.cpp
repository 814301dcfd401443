// Bindings of Channel (transport + regions + proxies) and the host row kernels.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "gpu_kernels/host/channel_ops.h"
#include "gpu_kernels/host/logfmt_rows.h"
#include "gpu_kernels/host/row_kernels.h"
#include "gpu_kernels/logfmt.h"
#include "python/src/region_lease.h"
#include "python/src/tensor_arg.h"
#include "ordering/imm.h"
#include "proxy/channel.h"
#include "proxy/transfer_cmd.h"

namespace py = pybind11;
using namespace portep;
using portep::bind::check_entries;
using portep::bind::host_tensor;
using portep::bind::RegionLease;
using portep::bind::TensorArg;

namespace {
std::unique_ptr<Channel> make_channel(int rank, int num_ranks, uint64_t nbytes, const std::string& transport,
                                      int num_proxy_threads, int num_fifos, uint32_t fifo_capacity,
                                      uint32_t num_streams, uint32_t max_inflight_cmds, uint64_t max_inflight_bytes,
                                      double timeout_s, uint32_t unordered_window, uint64_t seed, bool skip_ordering,
                                      int device, double idle_spin_us, int status_stream,
                                      const std::vector<std::string>& nccl_libraries) {
  ChannelOptions o;
  o.transport.device = device;
  o.data_bytes = nbytes;
  o.transport.name = transport;
  o.transport.window = unordered_window;
  o.transport.seed = seed;
  o.transport.skip_ordering = skip_ordering;
  o.transport.nccl_libraries = nccl_libraries;
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

RegionLease lease(const Channel& c, void* data, size_t bytes, bool device = false) {
  if (!data) throw std::runtime_error("this Channel's region is not mapped here");
  return RegionLease{c.memory_owner(), static_cast<uint8_t*>(data), bytes, device};
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
      .def_property_readonly("nbytes", [](const RegionLease& l) { return l.bytes; })
      .def_property_readonly("__cuda_array_interface__", &portep::bind::cuda_array_interface);
  py::class_<Channel>(m, "Channel")
      .def(py::init(&make_channel), py::arg("rank"), py::arg("num_ranks"), py::arg("nbytes"), py::arg("transport"),
           py::arg("num_proxy_threads"), py::arg("num_fifos"), py::arg("fifo_capacity"), py::arg("num_streams"),
           py::arg("max_inflight_cmds"), py::arg("max_inflight_bytes"), py::arg("timeout_s"),
           py::arg("unordered_window"), py::arg("seed"), py::arg("skip_ordering"), py::arg("device") = -1,
           py::arg("idle_spin_us") = 0.0, py::arg("status_stream") = -1,
           py::arg("nccl_libraries") = std::vector<std::string>{})
      // The C++ object's address, for native test hooks built from the same sources (portep_testing).
      .def_property_readonly("native_handle", [](Channel& c) { return reinterpret_cast<uintptr_t>(&c); })
      .def(
          "attach_device_fifos",
          [](Channel& c, uintptr_t host_views, int count) {
            auto* v = reinterpret_cast<const FifoView*>(host_views);
            c.proxies().attach_device_fifos(std::vector<FifoView>(v, v + count));
          },
          py::arg("host_views"), py::arg("count"))
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
      .def("device_data_lease",
           [](Channel& c) { return lease(c, c.device_address(kRegionData), c.data_bytes(), true); })
      .def(
          "peer_mapped", [](Channel& c, int dst) { return c.peer_data(dst) != nullptr; }, py::arg("dst"),
          "whether peer dst's data region is mapped in this process (shm, CUDA IPC): kernels may store into it")
      .def(
          "write_rows",
          [](Channel& c, int dst, py::handle local_offsets, py::handle remote_offsets, uint64_t row_bytes,
             uint32_t stream, bool merge) {
            const TensorArg lo = host_tensor(local_offsets, "local_offsets", "int64");
            const TensorArg ro = host_tensor(remote_offsets, "remote_offsets", "int64");
            check_entries(ro, lo.numel, "remote_offsets");
            py::gil_scoped_release nogil;
            return host::write_rows(c, dst, lo.as<int64_t>(), ro.as<int64_t>(), size_t(lo.numel), row_bytes, stream,
                                    merge);
          },
          py::arg("dst"), py::arg("local_offsets"), py::arg("remote_offsets"), py::arg("row_bytes"), py::arg("stream"),
          py::arg("merge"))
      .def(
          "write_rows_streams",
          [](Channel& c, int dst, py::handle local_offsets, py::handle remote_offsets, py::handle streams,
             uint64_t row_bytes) {
            const TensorArg lo = host_tensor(local_offsets, "local_offsets", "int64");
            const TensorArg ro = host_tensor(remote_offsets, "remote_offsets", "int64");
            const TensorArg st = host_tensor(streams, "streams", "int64");
            check_entries(ro, lo.numel, "remote_offsets");
            check_entries(st, lo.numel, "streams");
            py::gil_scoped_release nogil;
            host::write_rows_streams(c, dst, lo.as<int64_t>(), ro.as<int64_t>(), st.as<int64_t>(), size_t(lo.numel),
                                     row_bytes);
          },
          py::arg("dst"), py::arg("local_offsets"), py::arg("remote_offsets"), py::arg("streams"), py::arg("row_bytes"))
      .def(
          "signal_many",
          [](Channel& c, py::handle dsts, py::handle streams, py::handle units, py::handle direct) {
            const TensorArg d = host_tensor(dsts, "dsts", "int64"), s = host_tensor(streams, "streams", "int64");
            const TensorArg u = host_tensor(units, "units", "int64"), dir = host_tensor(direct, "direct", "uint8");
            for (const auto& [h, name] : {std::pair{&s, "streams"}, {&u, "units"}, {&dir, "direct"}})
              check_entries(*h, d.numel, name);
            py::gil_scoped_release nogil;
            host::signal_many(c, size_t(d.numel), d.as<int64_t>(), s.as<int64_t>(), u.as<int64_t>(), dir.as<uint8_t>());
          },
          py::arg("dsts"), py::arg("streams"), py::arg("units"), py::arg("direct"))
      .def(
          "consume_many",
          [](Channel& c, py::handle srcs, py::handle streams, py::handle units_out, py::handle wait_out,
             double timeout_s, py::handle mask) {
            const TensorArg s = host_tensor(srcs, "srcs", "int64"), st = host_tensor(streams, "streams", "int64");
            const TensorArg u = host_tensor(units_out, "units_out", "int64");
            const TensorArg w = host_tensor(wait_out, "wait_out", "int64");
            const TensorArg m = host_tensor(mask, "mask", "uint8", true);
            for (const auto& [h, name] : {std::pair{&st, "streams"}, {&u, "units_out"}, {&w, "wait_out"}})
              check_entries(*h, s.numel, name);
            check_entries(m, c.options().proxy.num_ranks, "mask");
            py::gil_scoped_release nogil;
            host::consume_many(c, size_t(s.numel), s.as<int64_t>(), st.as<int64_t>(), u.as<int64_t>(), w.as<int64_t>(),
                               timeout_s, m.as<uint8_t>());
          },
          py::arg("srcs"), py::arg("streams"), py::arg("units_out"), py::arg("wait_out"), py::arg("timeout_s"),
          py::arg("mask") = py::none())
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
      [](py::handle dst, int64_t dst_pitch, py::handle dst_idx, py::handle src, int64_t src_pitch, py::handle src_idx,
         int64_t row_bytes) {
        const TensorArg d = host_tensor(dst, "dst", nullptr), s = host_tensor(src, "src", nullptr);
        const TensorArg di = host_tensor(dst_idx, "dst_idx", "int64", true);
        const TensorArg si = host_tensor(src_idx, "src_idx", "int64", true);
        if (!di.present && !si.present) throw py::value_error("copy_rows: dst_idx or src_idx is needed");
        const int64_t n = di.present ? di.numel : si.numel;
        check_entries(si, n, "src_idx");
        py::gil_scoped_release nogil;
        host_copy_rows(d.span, dst_pitch, di.as<int64_t>(), s.span, src_pitch, si.as<int64_t>(), n, row_bytes);
      },
      py::arg("dst"), py::arg("dst_pitch"), py::arg("dst_idx"), py::arg("src"), py::arg("src_pitch"),
      py::arg("src_idx"), py::arg("row_bytes"));
  m.def(
      "reduce_rows",
      // sources: (rows, pitch in bytes, row dtype, index int64 [n], weights float32 [n] or None)
      [](py::handle out, int64_t out_pitch, int out_dtype, int64_t n, int64_t width, const py::list& sources,
         py::handle init) {
        const TensorArg o = host_tensor(out, "out", nullptr), in = host_tensor(init, "init", "float32", true);
        check_entries(in, n * width, "init");
        std::vector<ReduceSource> v;
        for (const py::handle item : sources) {
          const py::tuple t = item.cast<py::tuple>();
          const TensorArg rows = host_tensor(t[0], "a source's rows", nullptr);
          const TensorArg index = host_tensor(t[3], "a source's index", "int64");
          const TensorArg weight = host_tensor(t[4], "a source's weights", "float32", true);
          check_entries(index, n, "a source's index");
          check_entries(weight, n, "a source's weights");
          v.push_back(ReduceSource{rows.span, t[1].cast<int64_t>(), t[2].cast<int>(), index.as<const int64_t>(),
                                   weight.as<const float>()});
        }
        py::gil_scoped_release nogil;
        host_reduce_rows(o.span, out_pitch, out_dtype, n, width, v.data(), int(v.size()), in.as<const float>());
      },
      py::arg("out"), py::arg("out_pitch"), py::arg("out_dtype"), py::arg("n"), py::arg("width"), py::arg("sources"),
      py::arg("init") = py::none());
  m.def(
      "logfmt_encode_rows",
      [](py::handle dst, int64_t dst_pitch, py::handle dst_idx, py::handle src, int64_t src_pitch, py::handle src_idx,
         int hidden, uint32_t seq) {
        const TensorArg d = host_tensor(dst, "dst", nullptr), s = host_tensor(src, "src", nullptr);
        const TensorArg di = host_tensor(dst_idx, "dst_idx", "int64");
        const TensorArg si = host_tensor(src_idx, "src_idx", "int64");
        check_entries(si, di.numel, "src_idx");
        py::gil_scoped_release nogil;
        host_logfmt_encode_rows(d.span, dst_pitch, di.as<int64_t>(), s.span, src_pitch, si.as<int64_t>(), di.numel,
                                hidden, seq);
      },
      py::arg("dst"), py::arg("dst_pitch"), py::arg("dst_idx"), py::arg("src"), py::arg("src_pitch"),
      py::arg("src_idx"), py::arg("hidden"), py::arg("seq"));
  m.def(
      "logfmt_row_seqs",
      [](py::handle out, py::handle rows, int64_t pitch, py::handle idx, int hidden) {
        const TensorArg o = host_tensor(out, "out", "int32"), r = host_tensor(rows, "rows", nullptr);
        const TensorArg i = host_tensor(idx, "idx", "int64");
        check_entries(o, i.numel, "out");
        py::gil_scoped_release nogil;
        host_logfmt_row_seqs(o.as<uint32_t>(), r.span, pitch, i.as<int64_t>(), i.numel, hidden);
      },
      py::arg("out"), py::arg("rows"), py::arg("pitch"), py::arg("idx"), py::arg("hidden"));
  m.def("logfmt_layout", [](int hidden) {  // gpu_kernels/logfmt.h's sizes for one hidden size
    py::dict d;
    d["ok"] = logfmt_hidden_ok(hidden);
    d["min_hidden"] = kLogfmtMinHidden;
    d["max_hidden"] = kLogfmtMaxChunks * logfmt_chunk(hidden);  // for hidden's chunk size
    d["max_chunks"] = kLogfmtMaxChunks;
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
