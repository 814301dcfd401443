#include "gpu_kernels/host/channel_ops.h"

#include <chrono>
#include <string>

namespace portep::host {

uint64_t write_rows(Channel& ch, int dst, const int64_t* local_offs, const int64_t* remote_offs, size_t n,
                    uint64_t row_bytes, uint32_t stream, bool merge) {
  uint64_t commands = 0;
  size_t i = 0;
  while (i < n) {
    uint64_t bytes = row_bytes;
    size_t j = i + 1;
    while (merge && j < n && local_offs[j] == local_offs[j - 1] + int64_t(row_bytes) &&
           remote_offs[j] == remote_offs[j - 1] + int64_t(row_bytes) && bytes + row_bytes <= kMaxCmdBytes) {
      bytes += row_bytes;
      ++j;
    }
    if (local_offs[i] < 0 || remote_offs[i] < 0)
      throw std::invalid_argument("rows [" + std::to_string(local_offs[i]) + " -> " + std::to_string(remote_offs[i]) +
                                  ", +" + std::to_string(bytes) + ") have a negative offset");
    ch.write(dst, uint64_t(local_offs[i]), uint64_t(remote_offs[i]), bytes, stream);
    ++commands;
    i = j;
  }
  return commands;
}

void write_rows_streams(Channel& ch, int dst, const int64_t* local_offs, const int64_t* remote_offs,
                        const int64_t* streams, size_t n, uint64_t row_bytes) {
  for (size_t i = 0; i < n; ++i)
    write_rows(ch, dst, local_offs + i, remote_offs + i, 1, row_bytes, uint32_t(streams[i]), false);
}

void signal_many(Channel& ch, size_t n, const int64_t* dsts, const int64_t* streams, const int64_t* units,
                 const uint8_t* direct) {
  for (size_t i = 0; i < n; ++i) {
    if (direct[i])
      ch.direct_signal(int(dsts[i]), uint32_t(streams[i]), uint64_t(units[i]), true);
    else
      ch.signal(int(dsts[i]), uint32_t(streams[i]), true);
  }
}

void consume_many(Channel& ch, size_t n, const int64_t* srcs, const int64_t* streams, int64_t* units_out,
                  int64_t* wait_ns_out, double timeout_s, uint8_t* mask) {
  for (size_t i = 0; i < n; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const int src = int(srcs[i]);
    units_out[i] = 0;
    if (mask && mask[src]) {
      if (wait_ns_out) wait_ns_out[i] = 0;
      continue;
    }
    const uint32_t stream = uint32_t(streams[i]);
    uint64_t units = 0;
    const uint32_t why = ch.try_consume_final(src, stream, timeout_s, &units);
    if (why == kPeerOk)
      units_out[i] = int64_t(units);
    else if (mask && why != kPeerRefused)  // shrink mode: a rank that left, is gone or timed out is masked
      mask[src] = 1;
    else  // a refusal is not a failed rank but a call the ranks disagree on, which masking cannot mend
      ch.raise_wait_failure(
          src, why, timeout_s,
          "no final signal on (src " + std::to_string(src) + ", stream " + std::to_string(stream) + ")");
    if (wait_ns_out)
      wait_ns_out[i] =
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  }
}

}  // namespace portep::host
