// The host backend's bulk operations on a Channel: what its EP protocols (backends/host/) push and wait for, in
// vector form so one Python call moves many rows. Built on the Channel's single operations (proxy/channel.h),
// which know nothing of them; shrink mode's mask lives here, not in the proxy layer.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "proxy/channel.h"

namespace portep::host {

// One WRITE per row i (local_offs[i] -> remote_offs[i], row_bytes each) to dst on stream; rows contiguous on both
// sides are merged into one command of at most kMaxCmdBytes when `merge` (a signal then counts commands, not rows).
// Returns the number of commands pushed.
uint64_t write_rows(Channel& ch, int dst, const int64_t* local_offs, const int64_t* remote_offs, size_t n,
                    uint64_t row_bytes, uint32_t stream, bool merge);

// One WRITE per row with its own stream (never merged): the LL protocols' per-expert streams.
void write_rows_streams(Channel& ch, int dst, const int64_t* local_offs, const int64_t* remote_offs,
                        const int64_t* streams, size_t n, uint64_t row_bytes);

// A final signal for each of the n (dsts[i], streams[i]): by a direct store counting units[i] where direct[i],
// else through the proxies.
void signal_many(Channel& ch, size_t n, const int64_t* dsts, const int64_t* streams, const int64_t* units,
                 const uint8_t* direct);

// Waits for a final signal on each (srcs[i], streams[i]) in order and takes it: units_out[i] = its units, and
// wait_ns_out[i] (if not null) the nanoseconds waited. mask (uint8 per rank, or null) is shrink mode: a masked
// source gives 0 units without a wait, and one that times out, left or whose process is gone is masked instead of
// raising. Without a mask, and for a refused call always, the wait's failure raises naming the rank.
void consume_many(Channel& ch, size_t n, const int64_t* srcs, const int64_t* streams, int64_t* units_out,
                  int64_t* wait_ns_out, double timeout_s, uint8_t* mask);

}  // namespace portep::host
