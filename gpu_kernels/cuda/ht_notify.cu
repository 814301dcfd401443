// The HT notify kernel (ht_api.h): epoch, count exchange (or flags only, with a handle), the handle's prefix
// matrices.
#include "gpu_kernels/cuda/gpu_runtime.h"

#include "gpu_kernels/cuda/ht_common.cuh"

namespace portep::cuda {
namespace {

constexpr int kNotifyThreads = 1024;

// Count mode: this rank's tokens per (destination, channel) into channel_prefix [R][C] and, with forwarding, per
// (node, channel) into node_channel_prefix [Nn][C] (made inclusive over channels by prefix_channels). A thread per
// entry walks the channel's tokens, consecutive threads reading consecutive destinations: no table sized by R.
PORTEP_DEVICE void count_channels(const HTNotifyArgs& a) {
  const HTCommon& c = a.c;
  const int R = c.num_ranks, C = c.num_channels, L = c.ranks_per_node, Nn = num_nodes(c);
  for (int i = threadIdx.x; i < R * C; i += blockDim.x) {
    const int d = i % R, ch = i / R;
    int32_t n = 0;
    for (int t = channel_begin(a.num_tokens, C, ch); t < channel_begin(a.num_tokens, C, ch + 1); ++t)
      n += a.is_token_in_rank[int64_t(t) * R + d];
    a.channel_prefix[d * C + ch] = n;
  }
  for (int i = threadIdx.x; a.node_channel_prefix && i < Nn * C; i += blockDim.x) {
    const int n = i % Nn, ch = i / Nn;
    int32_t k = 0;
    for (int t = channel_begin(a.num_tokens, C, ch); t < channel_begin(a.num_tokens, C, ch + 1); ++t) {
      bool any = false;
      for (int l = 0; l < L; ++l) any |= a.is_token_in_rank[int64_t(t) * R + n * L + l];
      k += any;
    }
    a.node_channel_prefix[n * C + ch] = k;
  }
  __syncthreads();
}

// Counts per channel (count_channels) to inclusive prefixes over channels, in place.
PORTEP_DEVICE void prefix_channels(const HTNotifyArgs& a) {
  const HTCommon& c = a.c;
  const int C = c.num_channels;
  for (int d = threadIdx.x; d < c.num_ranks; d += blockDim.x)
    for (int ch = 1; ch < C; ++ch) a.channel_prefix[d * C + ch] += a.channel_prefix[d * C + ch - 1];
  for (int n = threadIdx.x; a.node_channel_prefix && n < num_nodes(c); n += blockDim.x)
    for (int ch = 1; ch < C; ++ch) a.node_channel_prefix[n * C + ch] += a.node_channel_prefix[n * C + ch - 1];
}

// The slot this rank writes for destination d: where it is stored (d's control area, directly or placed, or the
// outgoing slot a proxy WRITE carries there).
PORTEP_DEVICE uint8_t* slot_for(const HTCommon& c, int d, uint64_t epoch) {
  if (c.peers[d]) return notify_slot(c, c.peers[d], c.rank, epoch);
  return c.place[d] ? notify_slot(c, c.place[d], c.rank, epoch) : outgoing_slot(c, d, epoch);
}

// Count mode: every destination's slot from the counts (before prefix_channels).
PORTEP_DEVICE void write_count_slots(const HTNotifyArgs& a, uint64_t epoch) {
  const HTCommon& c = a.c;
  const int R = c.num_ranks, C = c.num_channels, E_l = a.num_experts / R;
  const int ranks = a.rank_prefix ? R : 0;  // one node: the counts to every rank (the intranode handle's matrix)
  const int per_dst = ranks + 2 * C + E_l;
  for (int i = threadIdx.x; i < R * per_dst; i += blockDim.x) {
    const int d = i / per_dst;
    int j = i % per_dst;
    uint8_t* slot = slot_for(c, d, epoch);
    if (j < ranks) {
      int32_t sum = 0;
      for (int ch = 0; ch < C; ++ch) sum += a.channel_prefix[j * C + ch];
      slot_counts(slot)[j] = sum;
    } else if ((j -= ranks) < C) {
      slot_channels(slot)[j] = a.channel_prefix[d * C + j];
    } else if ((j -= C) < C) {
      slot_node_channels(slot)[j] = a.node_channel_prefix ? a.node_channel_prefix[node_of(c, d) * C + j] : 0;
    } else {
      slot_experts(slot)[j - C] = a.tokens_per_expert[d * E_l + j - C];
    }
  }
}

// Thread d < R publishes this rank's slot to d: a flag after the stores (direct), or a WRITE + SIGNAL.
PORTEP_DEVICE void publish_slot(const HTCommon& c, uint64_t epoch) {
  for (int d = threadIdx.x; d < c.num_ranks; d += blockDim.x) {
    if (c.peers[d]) {
      fence_sys();  // every thread's stores into the slot (before the barrier) before the flag
      st_relaxed_sys_u64(slot_flag(slot_for(c, d, epoch)), epoch);
      continue;
    }
    *slot_flag(slot_for(c, d, epoch)) = epoch;
    fence_sys();  // the whole slot (outgoing or placed) before the WRITE that moves or announces it
    const LLCommon f = fifo_side(c);
    const uint64_t off = uint64_t(notify_slot(c, c.local, c.rank, epoch) - c.local);  // the same offset at d
    push_cmd(f, CmdFields{kOpWrite, write_flags(f, d), uint32_t(d), uint32_t(kHTSlotBytes), ht_notify_stream(c), off,
                          uint64_t(outgoing_slot(c, d, epoch) - c.local)});
    push_cmd(f, CmdFields{kOpSignal, 0, uint32_t(d), 0, ht_notify_stream(c), 0, 0});
  }
}

// Waits for every source's slot of this epoch (thread s for source s); returns (block-wide) whether all arrived.
PORTEP_DEVICE bool await_slots(const HTCommon& c, uint64_t epoch, int* ok) {
  for (int s = threadIdx.x; s < c.num_ranks; s += blockDim.x) {
    bool arrived;
    if (c.peers[s]) {
      arrived = await_word(c, slot_flag(notify_slot(c, c.local, s, epoch)), epoch, s, 0xFFFFFFFFu);
    } else {
      arrived = await_units(c, s, ht_notify_stream(c), 1) >= 1;
      if (arrived) consume_units(c, s, ht_notify_stream(c), 1);
    }
    if (!arrived) *ok = 0;
  }
  __syncthreads();
  return *ok != 0;
}

// Count mode with forwarding: the handle's forwarding matrices (ht_api.h) from the slots of the sources this rank
// serves; returns (thread 0) the rows it receives from other nodes.
PORTEP_DEVICE int64_t derive_forward_counts(const HTNotifyArgs& a, uint64_t epoch) {
  const HTCommon& c = a.c;
  const int C = c.num_channels, L = c.ranks_per_node, Nn = num_nodes(c), me = node_of(c, c.rank);
  auto served = [&](int n) { return slot_node_channels(notify_slot(c, c.local, n * L + local_of(c, c.rank), epoch)); };
  for (int i = threadIdx.x; i < Nn * C; i += blockDim.x) {
    const int n = i / C, ch = i % C;
    int32_t recv = 0;
    for (int j = 0; j < ch; ++j) recv += served(n)[j];
    a.fwd_channel_prefix[i] = recv;
  }
  if (threadIdx.x != 0) return 0;
  int64_t total = 0, others = 0;
  for (int n = 0; n < Nn; ++n) {
    int64_t rows = 0;
    for (int j = 0; j < C; ++j) rows += served(n)[j];
    total += rows;
    others += n == me ? 0 : rows;
    a.fwd_rank_prefix[n] = int32_t(total);
  }
  return others;
}

// Count mode: the handle's matrices and the receive counts from every source's slot. from: shared [R].
PORTEP_DEVICE void derive_counts(const HTNotifyArgs& a, uint64_t epoch, int32_t* from) {
  const HTCommon& c = a.c;
  const int64_t forward_rows = a.fwd_channel_prefix ? derive_forward_counts(a, epoch) : 0;
  const int R = c.num_ranks, C = c.num_channels, E_l = a.num_experts / R, me = c.rank;
  for (int s = threadIdx.x; s < R; s += blockDim.x) {
    const int32_t* ch_rows = slot_channels(notify_slot(c, c.local, s, epoch));
    int32_t n = 0;
    for (int ch = 0; ch < C; ++ch) n += ch_rows[ch];
    from[s] = n;
  }
  for (int i = threadIdx.x; a.rank_prefix && i < R * R; i += blockDim.x) {
    const int s = i / R, d = i % R;
    int32_t sum = 0;
    for (int j = 0; j <= s; ++j) sum += slot_counts(notify_slot(c, c.local, j, epoch))[d];
    a.rank_prefix[i] = sum;
  }
  for (int i = threadIdx.x; i < R * C; i += blockDim.x) {
    const int r = i / C, ch = i % C;
    const int32_t* from_r = slot_channels(notify_slot(c, c.local, r, epoch));
    int32_t recv = 0;
    for (int j = 0; j < ch; ++j) recv += from_r[j];
    a.recv_channel_prefix[i] = recv;
  }
  for (int i = threadIdx.x; i < E_l && a.ticket; i += blockDim.x) {
    int32_t sum = 0;
    for (int s = 0; s < R; ++s) sum += slot_experts(notify_slot(c, c.local, s, epoch))[i];
    c.host->expert[i] = sum;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  int64_t num_recv = 0, self_begin = 0;
  for (int s = 0; s < R; ++s) {
    num_recv += from[s];
    a.recv_rank_prefix[s] = int32_t(num_recv);
    self_begin += s < me ? from[s] : 0;
  }
  if (a.max_recv > 0 && num_recv > a.max_recv)
    report_error(c, kErrTooManyRecv, uint32_t(me), uint32_t(num_recv), uint32_t(a.max_recv));
  if (!a.ticket) return;
  c.host->num_recv = num_recv;
  c.host->self_begin = self_begin;
  c.host->self_rows = from[me];
  c.host->forward_rows = forward_rows;
  fence_sys();  // the counts before the ticket that says they are this op's
  st_relaxed_sys_u64(&c.host->ticket, a.ticket);
}

__global__ void __launch_bounds__(kNotifyThreads, 1) ht_notify_kernel(HTNotifyArgs a) {
  __shared__ int32_t from[kHTMaxRanks];
  __shared__ uint64_t epoch;
  __shared__ int ok;
  const HTCommon& c = a.c;
  if (threadIdx.x == 0) {
    epoch = *c.epoch + 1;
    ok = 1;
  }
  __syncthreads();
  if (a.count_mode) {
    count_channels(a);
    write_count_slots(a, epoch);
    __syncthreads();  // the slots read the counts before they become prefixes
    prefix_channels(a);
  }
  __syncthreads();
  publish_slot(c, epoch);
  const bool arrived = await_slots(c, epoch, &ok);
  if (arrived && a.count_mode) derive_counts(a, epoch, from);
  __syncthreads();         // every thread's error reports of this notify before the verdict
  if (threadIdx.x == 0) {  // the op's data kernel, next on the stream, reads both
    c.epoch[0] = epoch;
    c.epoch[1] = !arrived || error_stops_data(c);
  }
}

}  // namespace

int ht_notify(const HTNotifyArgs& a) {
  return int(launch_kernel<ht_notify_kernel>(1, kNotifyThreads, 0, static_cast<cudaStream_t>(a.c.stream), a));
}

int load_ht_notify_kernels() { return int(load_kernel(ht_notify_kernel)); }

}  // namespace portep::cuda
