// portep_testing: test and benchmark hooks into the native core, built only with PORTEP_BUILD_TESTING=ON and
// never part of the portep package: the wire formats and the pure ordering logic, the FIFO self-test, host
// traffic through a Channel (channel_traffic.h) and, with GPU kernels, the FIFO probe kernels.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "tests/native/channel_traffic.h"
#include "tests/native/fifo_selftest.h"
#include "gpu_kernels/fp8_e4m3.h"
#include "ordering/imm.h"
#include "proxy/inflight.h"
#include "ordering/pending_signals.h"
#include "ordering/signal_protocol.h"
#include "proxy/transfer_cmd.h"
#include "transport/own_regions.h"

namespace py = pybind11;
using namespace portep;

namespace {
py::tuple encode_cmd(uint32_t op, uint32_t flags, uint64_t dst_rank, uint64_t size, uint64_t stream,
                     uint64_t remote_off, uint64_t local_off) {
  // Values wider than the 32-bit fields are refused here, before they could be truncated.
  auto too_wide = [](uint64_t v) { return v > 0xffffffffull; };
  if (too_wide(dst_rank)) throw py::value_error(cmd_encode_status_text(kEncodeRankTooLarge));
  if (too_wide(size)) throw py::value_error(cmd_encode_status_text(kEncodeSizeTooLarge));
  if (too_wide(stream)) throw py::value_error(cmd_encode_status_text(kEncodeStreamTooLarge));
  CmdFields f{op, flags, uint32_t(dst_rank), uint32_t(size), uint32_t(stream), remote_off, local_off};
  TransferCmd c;
  int st = cmd_encode(f, &c);
  if (st != kEncodeOk) throw py::value_error(cmd_encode_status_text(st));
  return py::make_tuple(c.lo, c.hi);
}

py::dict decode_cmd(uint64_t lo, uint64_t hi) {
  CmdFields f = cmd_decode(TransferCmd{lo, hi});
  py::dict d;
  d["op"] = f.op;
  d["flags"] = f.flags;
  d["dst_rank"] = f.dst_rank;
  d["size"] = f.size;
  d["stream"] = f.stream;
  d["remote_off"] = f.remote_off;
  d["local_off"] = f.local_off;
  return d;
}

py::dict decode_imm(uint32_t v) {
  imm::Decoded x = imm::decode(v);
  py::dict d;
  d["kind"] = uint32_t(x.kind);
  d["stream"] = x.stream;
  d["epoch"] = x.epoch;
  d["units"] = x.units;
  d["final"] = x.final_signal;
  d["slot"] = x.slot;
  d["seq"] = x.seq;
  d["value"] = x.value;
  d["op"] = x.op;
  d["arg"] = x.arg;
  d["valid"] = x.valid;
  return d;
}

// FP8 E4M3 bytes of a contiguous 1-D float32 buffer, as the AMD kernels convert (fp8_e4m3.h).
py::bytes e4m3_from_float32(py::buffer values) {
  py::buffer_info info = values.request();
  if (info.format != py::format_descriptor<float>::format() || info.ndim != 1 || info.strides[0] != 4)
    throw py::value_error("values: a contiguous 1-D float32 buffer is needed, got format '" + info.format +
                          "' with ndim " + std::to_string(info.ndim));
  std::string out(size_t(info.shape[0]), '\0');
  const float* in = static_cast<const float*>(info.ptr);
  for (size_t i = 0; i < out.size(); ++i) out[i] = char(e4m3_from_float(in[i]));
  return py::bytes(out);
}

TrafficPlan make_plan(int producers, int messages_per_producer, uint32_t max_message_bytes, uint32_t signal_every,
                      uint64_t seed) {
  TrafficPlan p;
  p.producers = producers;
  p.messages_per_producer = messages_per_producer;
  p.max_message_bytes = max_message_bytes;
  p.signal_every = signal_every;
  p.seed = seed;
  return p;
}

// The native Channel behind a portep._C.Channel (its native_handle).
Channel& channel_at(uintptr_t handle) {
  if (!handle) throw py::value_error("channel: a null native handle");
  return *reinterpret_cast<Channel*>(handle);
}

// A SignalProtocol driven from Python with a poster that records what it is asked to post: ("write", peer, local,
// remote, bytes, imm or None), ("add", peer, stream, units, final) and ("wait", seq, peer); posts get sequence
// numbers 0, 1, 2, ...
class RecordingPoster final : public SignalPoster {
 public:
  uint64_t post_write(int peer, uint64_t local_off, uint64_t remote_off, uint32_t bytes, const uint32_t* imm,
                      const char*) override {
    log.append(py::make_tuple("write", peer, local_off, remote_off, bytes,
                              imm ? py::object(py::int_(*imm)) : py::object(py::none())));
    return seq++;
  }
  uint64_t post_slot_add(int peer, uint32_t stream, uint32_t units, bool final_signal) override {
    log.append(py::make_tuple("add", peer, stream, units, final_signal));
    return seq++;
  }
  void wait_retired_past(uint64_t s, const char*, int peer) override { log.append(py::make_tuple("wait", s, peer)); }
  py::list log;
  uint64_t seq = 0;
};

struct ProtocolUnderTest {
  ProtocolUnderTest(uint32_t ranks, uint32_t streams, bool native) : protocol(ranks, streams, native, false) {}
  SignalProtocol protocol;
  RecordingPoster poster;
};

py::list to_list(const std::vector<SignalRelease>& v) {
  py::list out;
  for (auto& r : v) out.append(py::make_tuple(r.src, r.stream, r.units, r.final_signal));
  return out;
}
}  // namespace

void bind_wire(py::module_& m);
void bind_wire(py::module_& m) {
  py::module_ w = m.def_submodule("wire", "TransferCmd and immediate-data encodings");
  w.attr("OP_WRITE") = uint32_t(kOpWrite);
  w.attr("OP_SIGNAL") = uint32_t(kOpSignal);
  w.attr("OP_QUIET") = uint32_t(kOpQuiet);
  w.attr("OP_BARRIER") = uint32_t(kOpBarrier);
  w.attr("OP_NOP") = uint32_t(kOpNop);
  w.attr("MAX_RANKS") = kMaxRanks;
  w.attr("MAX_CMD_BYTES") = kMaxCmdBytes;
  w.attr("MAX_STREAMS") = kMaxStreams;
  w.attr("MAX_OFFSET") = kMaxOffset;
  w.attr("SIGNAL_FINAL_MARK") = kSignalFinalMark;
  w.def("encode_cmd", &encode_cmd, py::arg("op"), py::arg("flags"), py::arg("dst_rank"), py::arg("size"),
        py::arg("stream"), py::arg("remote_off"), py::arg("local_off"));
  w.def("decode_cmd", &decode_cmd, py::arg("lo"), py::arg("hi"));

  w.attr("IMM_MAX_STREAMS") = imm::kMaxStreams;
  w.attr("IMM_MAX_UNITS") = imm::kMaxUnits;
  w.attr("IMM_NUM_EPOCHS") = imm::kNumEpochs;
  w.attr("IMM_MAX_SLOTS") = imm::kMaxSlots;
  w.attr("IMM_SEQ_SPACE") = imm::kSeqSpace;
  w.def("imm_stream_write", &imm::encode_stream_write, py::arg("stream"), py::arg("epoch"));
  w.def("imm_stream_signal", &imm::encode_stream_signal, py::arg("stream"), py::arg("epoch"), py::arg("units"),
        py::arg("final"));
  w.def("imm_seq_add", &imm::encode_seq_add, py::arg("slot"), py::arg("seq"), py::arg("value"));
  w.def("imm_control", &imm::encode_control, py::arg("op"), py::arg("arg"));
  w.def("decode_imm", &decode_imm, py::arg("imm"));
  w.def("e4m3_from_float32", &e4m3_from_float32, py::arg("values"));

  py::module_ o =
      m.def_submodule("ordering", "pure ordering logic (docs/design.md §5, Ordering on unordered transports)");
  py::class_<PendingSignalTable>(o, "PendingSignalTable")
      .def(py::init<uint32_t, uint32_t>(), py::arg("num_sources"), py::arg("num_streams"))
      .def("on_write",
           [](PendingSignalTable& t, uint32_t src, uint32_t stream, uint32_t epoch) {
             std::vector<SignalRelease> out;
             t.on_write(src, stream, epoch, &out);
             return to_list(out);
           })
      .def("on_signal",
           [](PendingSignalTable& t, uint32_t src, uint32_t stream, uint32_t epoch, uint32_t units, bool fin) {
             std::vector<SignalRelease> out;
             t.on_signal(src, stream, epoch, units, fin, &out);
             return to_list(out);
           })
      .def_property_readonly("held", &PendingSignalTable::held)
      .def_property_readonly("released", &PendingSignalTable::released);
  py::class_<ProtocolUnderTest>(o, "SignalProtocol")
      .def(py::init<uint32_t, uint32_t, bool>(), py::arg("num_ranks"), py::arg("num_streams"), py::arg("native"))
      .def(
          "write",
          [](ProtocolUnderTest& t, int peer, uint32_t stream, uint64_t local, uint64_t remote, uint32_t bytes,
             bool placed) { t.protocol.write(peer, stream, local, remote, bytes, placed, t.poster); },
          py::arg("peer"), py::arg("stream"), py::arg("local_off"), py::arg("remote_off"), py::arg("bytes"),
          py::arg("placed") = false)
      .def(
          "signal",
          [](ProtocolUnderTest& t, int peer, uint32_t stream, bool fin) {
            t.protocol.signal(peer, stream, fin, t.poster);
          },
          py::arg("peer"), py::arg("stream"), py::arg("final"))
      .def(
          "on_notice",
          [](ProtocolUnderTest& t, uint32_t src, uint32_t imm) {
            std::vector<SignalRelease> out;
            const NoticeResult r = t.protocol.on_notice(src, imm, &out);
            static const char* kinds[] = {"write", "signal", "barrier"};
            return py::make_tuple(kinds[r.kind], r.barrier_epoch, r.signal_held, to_list(out));
          },
          py::arg("src"), py::arg("imm"))
      .def_static("barrier_imm", &SignalProtocol::barrier_imm)
      .def_property_readonly("posted", [](ProtocolUnderTest& t) { return t.poster.log; })
      .def_property_readonly("held", [](ProtocolUnderTest& t) { return t.protocol.held(); });
  py::class_<InflightTracker>(o, "InflightTracker")
      .def(py::init<uint32_t, uint64_t>(), py::arg("max_cmds"), py::arg("max_bytes"))
      .def("has_room", &InflightTracker::has_room)
      .def("on_post", &InflightTracker::on_post)
      .def("on_complete", &InflightTracker::on_complete)
      .def_property_readonly("posted", &InflightTracker::posted)
      .def_property_readonly("retired", &InflightTracker::retired)
      .def_property_readonly("inflight_bytes", &InflightTracker::inflight_bytes);

  py::module_ own = m.def_submodule("own_regions", "regions this process exported, by handle (own_regions.h)");
  own.def("add", [](const py::bytes& handle, uintptr_t address, int device) {
    own_region_add(std::string(handle), reinterpret_cast<void*>(address), device);
  });
  own.def("remove", [](uintptr_t address) { own_region_remove(reinterpret_cast<void*>(address)); });
  py::class_<OwnRegionsOpened>(own, "Opened")
      .def(py::init<>())
      .def("add", [](OwnRegionsOpened& o, uintptr_t address) { o.add(reinterpret_cast<void*>(address)); })
      .def("release",
           [](OwnRegionsOpened& o, uintptr_t address) { return o.release(reinterpret_cast<void*>(address)); });
  own.def("find", [](const py::bytes& handle) {
    const OwnRegion r = own_region_find(std::string(handle));
    return py::make_tuple(reinterpret_cast<uintptr_t>(r.address), r.device);
  });

  m.def(
      "fifo_selftest",
      [](int producers, uint64_t per_producer, uint32_t capacity, double timeout_s) {
        FifoSelftestResult r;
        {
          py::gil_scoped_release nogil;
          r = fifo_selftest(producers, per_producer, capacity, timeout_s);
        }
        py::dict d;
        d["popped"] = r.popped;
        d["out_of_order"] = r.out_of_order;
        d["producer_timeout"] = r.producer_timeout;
        d["seconds"] = r.seconds;
        return d;
      },
      py::arg("producers"), py::arg("per_producer"), py::arg("capacity"), py::arg("timeout_s") = 30.0);
  m.def("traffic_region_bytes", [](int producers, int messages, uint32_t max_bytes, int num_ranks) {
    return traffic_region_bytes(make_plan(producers, messages, max_bytes, 1, 0), num_ranks);
  });
  m.def(
      "run_producers",
      [](uintptr_t channel, int producers, int messages, uint32_t max_bytes, uint32_t signal_every, uint64_t seed) {
        ProducerResult r;
        {
          py::gil_scoped_release nogil;
          r = run_producers(channel_at(channel), make_plan(producers, messages, max_bytes, signal_every, seed));
        }
        py::dict d;
        d["commands"] = r.commands;
        d["push_seconds"] = r.push_seconds;
        d["total_seconds"] = r.total_seconds;
        return d;
      },
      py::arg("channel"), py::arg("producers"), py::arg("messages_per_producer"), py::arg("max_message_bytes"),
      py::arg("signal_every"), py::arg("seed"));
  m.def(
      "run_checker",
      [](uintptr_t channel, int producers, int messages, uint32_t max_bytes, uint32_t signal_every, uint64_t seed,
         double timeout_s) {
        CheckResult r;
        {
          py::gil_scoped_release nogil;
          r = run_checker(channel_at(channel), make_plan(producers, messages, max_bytes, signal_every, seed),
                          timeout_s);
        }
        py::dict d;
        d["observations"] = r.observations;
        d["messages_checked"] = r.messages_checked;
        d["violations"] = r.violations;
        d["streams_final"] = r.streams_final;
        d["first_violation"] = r.first_violation;
        return d;
      },
      py::arg("channel"), py::arg("producers"), py::arg("messages_per_producer"), py::arg("max_message_bytes"),
      py::arg("signal_every"), py::arg("seed"), py::arg("timeout_s"));
  m.def(
      "run_pingpong",
      [](uintptr_t channel, int peer, bool initiator, int iterations, uint32_t bytes, uint64_t base, double timeout_s) {
        return run_pingpong(channel_at(channel), peer, initiator, iterations, bytes, base, timeout_s);
      },
      py::arg("channel"), py::arg("peer"), py::arg("initiator"), py::arg("iterations"), py::arg("nbytes"),
      py::arg("base"), py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>());
}

#ifdef PORTEP_TESTING_WITH_GPU
#include "tests/native/fifo_probe.h"

namespace {
void check_cuda(int err, const char* what) {
  if (err) throw std::runtime_error(std::string(what) + ": " + portep::cuda::cuda_error_string(err));
}
}  // namespace

void bind_fifo_probes(py::module_& m) {
  m.def(
      "cuda_fifo_probe",
      [](int num_fifos, int consumer_threads, int warps, int commands_per_warp, double timeout_s) {
        portep::cuda::FifoProbeConfig cfg;
        cfg.num_fifos = num_fifos;
        cfg.consumer_threads = consumer_threads;
        cfg.warps = warps;
        cfg.commands_per_warp = commands_per_warp;
        cfg.timeout_s = timeout_s;
        portep::cuda::FifoProbeResult r;
        int err;
        {
          py::gil_scoped_release nogil;
          err = portep::cuda::run_fifo_probe(cfg, &r);
        }
        if (err) throw std::runtime_error(std::string("cuda_fifo_probe: ") + portep::cuda::cuda_error_string(err));
        py::dict d;
        d["seconds"] = r.seconds;
        d["popped"] = r.popped;
        d["out_of_order"] = r.out_of_order;
        d["producer_timeout"] = r.producer_timeout;
        return d;
      },
      py::arg("num_fifos"), py::arg("consumer_threads"), py::arg("warps"), py::arg("commands_per_warp"),
      py::arg("timeout_s") = 30.0);
  m.def(
      "cuda_fifo_rtt",
      [](int iterations, double timeout_s) {
        portep::cuda::FifoRttTimes t;
        int err;
        {
          py::gil_scoped_release nogil;
          err = portep::cuda::run_fifo_rtt(iterations, timeout_s, &t);
        }
        if (err) throw std::runtime_error(std::string("cuda_fifo_rtt: ") + portep::cuda::cuda_error_string(err));
        py::dict d;
        d["publish_ns"] = t.publish_ns;
        d["pop_ns"] = t.pop_ns;
        d["release_ns"] = t.release_ns;
        d["seen_ns"] = t.seen_ns;
        d["host_read_ns"] = t.host_read_ns;
        d["host_clock_before_ns"] = t.host_clock_before_ns;
        return d;
      },
      py::arg("iterations"), py::arg("timeout_s") = 30.0);
  m.def(
      "cuda_push_nops",
      [](uintptr_t fifo_views, int num_fifos, int warps, int commands_per_warp, double timeout_s, uintptr_t stream) {
        portep::cuda::FifoProbeArgs a{reinterpret_cast<portep::FifoView*>(fifo_views),
                                      num_fifos,
                                      commands_per_warp,
                                      warps,
                                      1,
                                      uint64_t(timeout_s * 1e9),
                                      reinterpret_cast<void*>(stream),
                                      true};
        check_cuda(portep::cuda::launch_fifo_probe(a), "cuda_push_nops");
      },
      py::arg("fifo_views"), py::arg("num_fifos"), py::arg("warps"), py::arg("commands_per_warp"), py::arg("timeout_s"),
      py::arg("stream"));
}
#endif

void bind_ll_chain(py::module_& m);      // ll_chain_model.cpp
void bind_nccl_records(py::module_& m);  // nccl_records_hooks.cpp

PYBIND11_MODULE(portep_testing, m) {
  m.doc() = "portep's test hooks (not installed with portep)";
  bind_wire(m);
  bind_ll_chain(m);
  bind_nccl_records(m);
#ifdef PORTEP_TESTING_WITH_GPU
  bind_fifo_probes(m);
  m.attr("gpu_built") = true;
#else
  m.attr("gpu_built") = false;
#endif
}
