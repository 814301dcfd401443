// The HT notify kernel (ht_api.h): epoch, count exchange (or flags only, with a handle), the handle's prefix
// matrices.
#include "gpu_kernels/cuda/gpu_runtime.h"

#include "gpu_kernels/cuda/ht_common.cuh"

namespace portep::cuda {
namespace {

constexpr int kNotifyThreads = 1024;

// This rank's tokens per (destination, channel) and per (node, channel), from is_token_in_rank, into shared
// counts [R][C] and node_counts [Nn][C].
PORTEP_DEVICE void count_channels(const HTNotifyArgs& a, int32_t* counts, int32_t* node_counts) {
  const HTCommon& c = a.c;
  const int R = c.num_ranks, C = c.num_channels, L = c.ranks_per_node;
  for (int i = threadIdx.x; i < R * C; i += blockDim.x) counts[i] = node_counts[i] = 0;
  __syncthreads();
  const int per = channel_tokens(a.num_tokens, C);
  for (int t = threadIdx.x; t < a.num_tokens; t += blockDim.x) {
    uint32_t ranks = 0;
    for (int d = 0; d < R; ++d)
      if (a.is_token_in_rank[int64_t(t) * R + d]) {
        atomicAdd(&counts[d * C + t / per], 1);
        ranks |= 1u << d;
      }
    for (int n = 0; n < R / L; ++n)
      if (node_mask(c, ranks, n)) atomicAdd(&node_counts[n * C + t / per], 1);
  }
  __syncthreads();
}

// The slot this rank writes for destination d: where it is stored (d's control area, directly or placed, or the
// outgoing slot a proxy WRITE carries there).
PORTEP_DEVICE uint8_t* slot_for(const HTCommon& c, int d, uint64_t epoch) {
  if (c.peers[d]) return notify_slot(c, c.peers[d], c.rank, epoch);
  return c.place[d] ? notify_slot(c, c.place[d], c.rank, epoch) : outgoing_slot(c, d, epoch);
}

PORTEP_DEVICE void write_count_slots(const HTNotifyArgs& a, const int32_t* counts, const int32_t* node_counts,
                                     uint64_t epoch) {
  const HTCommon& c = a.c;
  const int R = c.num_ranks, C = c.num_channels, E_l = a.num_experts / R;
  const int per_dst = R + 2 * C + E_l;
  for (int i = threadIdx.x; i < R * per_dst; i += blockDim.x) {
    const int d = i / per_dst, j = i % per_dst;
    uint8_t* slot = slot_for(c, d, epoch);
    if (j < R) {
      int32_t sum = 0;
      for (int ch = 0; ch < C; ++ch) sum += counts[j * C + ch];
      slot_counts(slot)[j] = sum;
    } else if (j < R + C) {
      slot_channels(slot)[j - R] = counts[d * C + j - R];
    } else if (j < R + 2 * C) {
      slot_node_channels(slot)[j - R - C] = node_counts[node_of(c, d) * C + j - R - C];
    } else {
      slot_experts(slot)[j - R - 2 * C] = a.tokens_per_expert[d * E_l + j - R - 2 * C];
    }
  }
}

// Thread d < R publishes this rank's slot to d: a flag after the stores (direct), or a WRITE + SIGNAL.
PORTEP_DEVICE void publish_slot(const HTCommon& c, uint64_t epoch) {
  const int d = threadIdx.x;
  if (d >= c.num_ranks) return;
  if (c.peers[d]) {
    fence_sys();  // every thread's stores into the slot (before the barrier) before the flag
    st_relaxed_sys_u64(slot_flag(slot_for(c, d, epoch)), epoch);
    return;
  }
  *slot_flag(slot_for(c, d, epoch)) = epoch;
  fence_sys();  // the whole slot (outgoing or placed) before the WRITE that moves or announces it
  const LLCommon f = fifo_side(c);
  const uint64_t off = uint64_t(notify_slot(c, c.local, c.rank, epoch) - c.local);  // the same offset at d
  push_cmd(f, CmdFields{kOpWrite, write_flags(f, d), uint32_t(d), uint32_t(kHTSlotBytes), ht_notify_stream(c), off,
                        uint64_t(outgoing_slot(c, d, epoch) - c.local)});
  push_cmd(f, CmdFields{kOpSignal, 0, uint32_t(d), 0, ht_notify_stream(c), 0, 0});
}

// Thread s < R waits for source s's slot of this epoch; returns (block-wide) whether all arrived.
PORTEP_DEVICE bool await_slots(const HTCommon& c, uint64_t epoch, int* ok) {
  const int s = threadIdx.x;
  if (s < c.num_ranks) {
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

// Count mode with forwarding: the handle's node matrices (ht_api.h) from this rank's node counts and the slots of
// the sources it serves; returns (thread 0) the rows it receives from other nodes.
PORTEP_DEVICE int64_t derive_forward_counts(const HTNotifyArgs& a, const int32_t* node_counts, uint64_t epoch) {
  const HTCommon& c = a.c;
  const int C = c.num_channels, L = c.ranks_per_node, Nn = c.num_ranks / L, me = node_of(c, c.rank);
  auto served = [&](int n) { return slot_node_channels(notify_slot(c, c.local, n * L + local_of(c, c.rank), epoch)); };
  for (int i = threadIdx.x; i < Nn * C; i += blockDim.x) {
    const int n = i / C, ch = i % C;
    int32_t sent = 0, recv = 0;
    for (int j = 0; j <= ch; ++j) sent += node_counts[n * C + j];
    for (int j = 0; j < ch; ++j) recv += served(n)[j];
    a.node_channel_prefix[i] = sent;
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

// Count mode: the handle's matrices and the receive counts from every source's slot.
PORTEP_DEVICE void derive_counts(const HTNotifyArgs& a, const int32_t* counts, const int32_t* node_counts,
                                 uint64_t epoch) {
  const HTCommon& c = a.c;
  const int64_t forward_rows = a.fwd_channel_prefix ? derive_forward_counts(a, node_counts, epoch) : 0;
  const int R = c.num_ranks, C = c.num_channels, E_l = a.num_experts / R, me = c.rank;
  for (int i = threadIdx.x; i < R * R; i += blockDim.x) {
    const int s = i / R, d = i % R;
    int32_t sum = 0;
    for (int j = 0; j <= s; ++j) sum += slot_counts(notify_slot(c, c.local, j, epoch))[d];
    a.rank_prefix[i] = sum;
  }
  for (int i = threadIdx.x; i < R * C; i += blockDim.x) {
    const int r = i / C, ch = i % C;
    int32_t sent = 0, recv = 0;
    const int32_t* from_r = slot_channels(notify_slot(c, c.local, r, epoch));
    for (int j = 0; j <= ch; ++j) sent += counts[r * C + j];
    for (int j = 0; j < ch; ++j) recv += from_r[j];
    a.channel_prefix[i] = sent;
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
    const int32_t n = slot_counts(notify_slot(c, c.local, s, epoch))[me];
    num_recv += n;
    self_begin += s < me ? n : 0;
  }
  if (a.max_recv > 0 && num_recv > a.max_recv)
    report_error(c, kErrTooManyRecv, uint32_t(me), uint32_t(num_recv), uint32_t(a.max_recv));
  if (!a.ticket) return;
  c.host->num_recv = num_recv;
  c.host->self_begin = self_begin;
  c.host->self_rows = slot_counts(notify_slot(c, c.local, me, epoch))[me];
  c.host->forward_rows = forward_rows;
  fence_sys();  // the counts before the ticket that says they are this op's
  st_relaxed_sys_u64(&c.host->ticket, a.ticket);
}

__global__ void __launch_bounds__(kNotifyThreads, 1) ht_notify_kernel(HTNotifyArgs a) {
  __shared__ int32_t counts[kHTMaxRanks * kHTMaxChannels], node_counts[kHTMaxRanks * kHTMaxChannels];
  __shared__ uint64_t epoch;
  __shared__ int ok;
  const HTCommon& c = a.c;
  if (threadIdx.x == 0) {
    epoch = *c.epoch + 1;
    ok = 1;
  }
  __syncthreads();
  if (a.count_mode) {
    count_channels(a, counts, node_counts);
    write_count_slots(a, counts, node_counts, epoch);
  }
  __syncthreads();
  publish_slot(c, epoch);
  const bool arrived = await_slots(c, epoch, &ok);
  if (arrived && a.count_mode) derive_counts(a, counts, node_counts, epoch);
  __syncthreads();  // every thread's error reports of this notify before the verdict
  if (threadIdx.x == 0) {  // the op's data kernel, next on the stream, reads both
    c.epoch[0] = epoch;
    c.epoch[1] = !arrived || error_stops_data(c);
  }
}

}  // namespace

int ht_notify(const HTNotifyArgs& a) {
  return int(launch_kernel<ht_notify_kernel>(1, kNotifyThreads, 0, static_cast<cudaStream_t>(a.c.stream), a));
}

int load_ht_notify_kernels() {
  return int(load_kernel(ht_notify_kernel));
}

}  // namespace portep::cuda
