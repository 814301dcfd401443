// portep_testing.nccl_records: the nccl transport's record format (transport/nccl/nccl_records.h) as the receiver
// reads it, for tests of its wrap-around at 2^24 and 2^32 that no run reaches.
#include <pybind11/pybind11.h>

#include "transport/nccl/nccl_records.h"

namespace py = pybind11;
namespace w = portep::nccl_wire;

namespace {
w::Record from_words(uint64_t word0, uint64_t word1) {
  return w::Record{uint32_t(word0), uint32_t(word0 >> 32), uint32_t(word1), uint32_t(word1 >> 32)};
}
}  // namespace

void bind_nccl_records(py::module_& m) {
  py::module_ r = m.def_submodule("nccl_records", "the nccl transport's records (transport/nccl/nccl_records.h)");
  r.attr("RECORD_SLOTS") = w::kRecordSlots;
  r.attr("RECORD_BYTES") = w::kRecordBytes;
  r.def(
      "encode",
      [](uint32_t imm, uint64_t seq, uint64_t put_count, int channel) {
        uint64_t words[2];
        w::words_of(w::encode(imm, seq, put_count, channel), words);
        return py::make_tuple(words[0], words[1]);
      },
      py::arg("imm"), py::arg("seq"), py::arg("put_count"), py::arg("channel"));
  r.def(
      "holds", [](uint64_t word0, uint64_t word1, uint64_t seq) { return w::holds(from_words(word0, word1), seq); },
      py::arg("word0"), py::arg("word1"), py::arg("seq"));
  r.def(
      "counted",
      [](uint64_t word0, uint64_t word1, uint64_t counted) { return w::counted(from_words(word0, word1), counted); },
      py::arg("word0"), py::arg("word1"), py::arg("counted"));
  r.def(
      "fields",
      [](uint64_t word0, uint64_t word1) {
        const w::Record rec = from_words(word0, word1);
        py::dict d;
        d["imm"] = rec.imm;
        d["put_count"] = rec.put_count;
        d["channel"] = w::channel_of(rec);
        return d;
      },
      py::arg("word0"), py::arg("word1"));
  r.def("slot_offset", &w::slot_offset, py::arg("src"), py::arg("seq"));
  r.def("inbox_offset", &w::inbox_offset, py::arg("src"));
}
