// The HT notify kernel (ht_api.h): epoch, count exchange / barrier, the handle's prefix matrices.
#include <cuda_runtime.h>

#include "ht_common.cuh"

namespace portep::cuda {
namespace {

constexpr int kNotifyThreads = 1024;

// This rank's tokens per (destination, channel), from is_token_in_rank, into shared counts [R][C].
PORTEP_DEVICE void count_channels(const HTNotifyArgs& a, int32_t* counts) {
  const int R = a.c.num_ranks, C = a.c.num_channels;
  for (int i = threadIdx.x; i < R * C; i += blockDim.x) counts[i] = 0;
  __syncthreads();
  const int per = channel_tokens(a.num_tokens, C);
  for (int t = threadIdx.x; t < a.num_tokens; t += blockDim.x)
    for (int d = 0; d < R; ++d)
      if (a.is_token_in_rank[int64_t(t) * R + d]) atomicAdd(&counts[d * C + t / per], 1);
  __syncthreads();
}

// Every destination's slot for this rank: token counts per rank, per channel for it, its experts' selections.
PORTEP_DEVICE void write_slots(const HTNotifyArgs& a, const int32_t* counts) {
  const HTCommon& c = a.c;
  const int R = c.num_ranks, C = c.num_channels, E_l = a.num_experts / R;
  const int per_dst = R + C + E_l;
  for (int i = threadIdx.x; i < R * per_dst; i += blockDim.x) {
    const int d = i / per_dst, j = i % per_dst;
    uint8_t* slot = notify_slot(c, c.peers[d], c.rank);
    if (j < R) {
      int32_t sum = 0;
      for (int ch = 0; ch < C; ++ch) sum += counts[j * C + ch];
      slot_counts(slot)[j] = sum;
    } else if (j < R + C) {
      slot_channels(slot)[j - R] = counts[d * C + j - R];
    } else {
      slot_experts(slot)[j - R - C] = a.tokens_per_expert[d * E_l + j - R - C];
    }
  }
}

// Thread s < R waits for source s's flag of this epoch; returns (block-wide) whether all arrived.
PORTEP_DEVICE bool await_slots(const HTCommon& c, uint64_t epoch, int* ok) {
  if (int(threadIdx.x) < c.num_ranks) {
    const uint64_t* flag = reinterpret_cast<const uint64_t*>(notify_slot(c, c.local, threadIdx.x));
    uint64_t v = 0, waited = 0;
    if (!wait_until([&] { return ld_acquire_sys_u64(flag); }, [&](uint64_t x) { return x >= epoch; }, c.timeout_ns,
                    &v, &waited)) {
      report_error(c.error, kErrWaitTimeout, uint32_t(c.rank), threadIdx.x, 0xFFFFFFFFu);
      *ok = 0;
    }
  }
  __syncthreads();
  return *ok != 0;
}

// The handle's matrices and the receive counts from every source's slot (and this rank's own counts).
PORTEP_DEVICE void derive(const HTNotifyArgs& a, const int32_t* counts) {
  const HTCommon& c = a.c;
  const int R = c.num_ranks, C = c.num_channels, E_l = a.num_experts / R, me = c.rank;
  for (int i = threadIdx.x; i < R * R; i += blockDim.x) {
    const int s = i / R, d = i % R;
    int32_t sum = 0;
    for (int j = 0; j <= s; ++j) sum += slot_counts(notify_slot(c, c.local, j))[d];
    a.rank_prefix[i] = sum;
  }
  for (int i = threadIdx.x; i < R * C; i += blockDim.x) {
    const int r = i / C, ch = i % C;
    int32_t sent = 0, recv = 0;
    const int32_t* from_r = slot_channels(notify_slot(c, c.local, r));
    for (int j = 0; j <= ch; ++j) sent += counts[r * C + j];
    for (int j = 0; j < ch; ++j) recv += from_r[j];
    a.channel_prefix[i] = sent;
    a.recv_channel_prefix[i] = recv;
  }
  for (int i = threadIdx.x; i < E_l && a.ticket; i += blockDim.x) {
    int32_t sum = 0;
    for (int s = 0; s < R; ++s) sum += slot_experts(notify_slot(c, c.local, s))[i];
    c.host->expert[i] = sum;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  int64_t num_recv = 0, most = 0;
  for (int s = 0; s < R; ++s) num_recv += slot_counts(notify_slot(c, c.local, s))[me];
  for (int d = 0; d < R; ++d) most = max(most, int64_t(a.rank_prefix[(R - 1) * R + d]));
  if (a.max_recv > 0 && num_recv > a.max_recv)
    report_error(c.error, kErrTooManyRecv, uint32_t(me), uint32_t(num_recv), uint32_t(a.max_recv));
  if (!a.ticket) return;
  c.host->num_recv = num_recv;
  c.host->max_recv_any = most;
  fence_sys();  // the counts before the ticket that says they are this op's
  st_relaxed_sys_u64(&c.host->ticket, a.ticket);
}

__global__ void __launch_bounds__(kNotifyThreads, 1) ht_notify_kernel(HTNotifyArgs a) {
  __shared__ int32_t counts[kHTMaxRanks * kHTMaxChannels];
  __shared__ uint64_t epoch;
  __shared__ int ok;
  const HTCommon& c = a.c;
  if (threadIdx.x == 0) {
    epoch = *c.epoch + 1;
    ok = 1;
  }
  __syncthreads();
  if (a.exchange) {
    count_channels(a, counts);
    write_slots(a, counts);
  }
  __syncthreads();
  if (int(threadIdx.x) < c.num_ranks) {  // the slot's contents (all threads' stores above) before its flag
    fence_sys();
    st_relaxed_sys_u64(reinterpret_cast<uint64_t*>(notify_slot(c, c.peers[threadIdx.x], c.rank)), epoch);
  }
  const bool arrived = await_slots(c, epoch, &ok);
  if (arrived && a.exchange) derive(a, counts);
  if (threadIdx.x == 0) *c.epoch = epoch;  // the op's data kernel, next on the stream, reads it
}

}  // namespace

int ht_notify(const HTNotifyArgs& a) {
  ht_notify_kernel<<<1, kNotifyThreads, 0, static_cast<cudaStream_t>(a.c.stream)>>>(a);
  return int(cudaGetLastError());
}

}  // namespace portep::cuda
