// Low-latency combine: the send kernel returns every received row to its source (into the source's
// [E][T] receive rows, direct or through the proxies) and publishes each (local expert, source) once its
// rows are written; a direct peer gets, per token, the FP32 sum of its two or more selections held here
// instead of their rows (partials, ll_api.h). The receive phase waits for every expert's signal, then reduces
// each token per owner rank (top-k order, FP32), then over owner ranks in rank order: the host backend's order
// and roundings, so both give the same bits. In one launch (no hook) this rank's rows for itself are not
// copied: the reduce reads them from the input, which cannot change before it runs. With use_logfmt every row,
// this rank's too, travels encoded as LogFMT-10 (ll_logfmt.cuh) and no peer sends partials.
#include "gpu_kernels/cuda/gpu_runtime.h"
#include "gpu_kernels/cuda/graph_cache.h"

#include <climits>

#include "gpu_kernels/cuda/ll_logfmt.cuh"
#include "gpu_kernels/cuda/ll_partials.cuh"

namespace portep::cuda {

namespace {

constexpr int kMaxPartsPerExpert = 8;

PORTEP_DEVICE void copy_row(uint8_t* dst, const uint8_t* src, int bytes) {
  warp_copy16(reinterpret_cast<uint4*>(dst), reinterpret_cast<const uint4*>(src), bytes / 16);
}

// Warp-wide: a BF16 expert output row into its combine row slot, as it is or LogFMT-encoded.
PORTEP_DEVICE void put_row(const LLCombineArgs& a, uint8_t* dst, const uint8_t* row) {
  if (a.use_logfmt)
    warp_logfmt_encode(dst, row, a.c.hidden);
  else
    copy_row(dst, row, 2 * a.c.hidden);
}

// Without zero-copy, proxy destination dst's rows of a chunk are staged packed from this row of the send area
// (ll_api.h); with zero-copy the proxies read them where the caller wrote them. Placed (c.place[dst]) they are
// stored packed straight into dst's receive area, from the chunk's first row there on.
PORTEP_DEVICE uint64_t combine_staging_row(const LLCommon& c, int dst, int chunk) {
  return uint64_t(chunk) * kChunkExperts * c.num_ranks * c.T + uint64_t(dst) * chunk_experts(c, chunk) * c.T;
}
PORTEP_DEVICE uint64_t combine_remote_chunk(const LLCommon& c, int chunk) {
  return c.recv_off + (uint64_t(c.rank) * c.num_local_experts + chunk * kChunkExperts) * c.T * c.comb_pitch;
}
// Whether proxy destination dst's rows are copied packed by the kernel (into staging or placed), not read by the
// proxies from the caller's zero-copy rows.
PORTEP_DEVICE bool rows_packed_here(const LLCombineArgs& a, int dst) { return !a.zero_copy || a.c.place[dst]; }

// Every local expert of `chunk` has its rows for proxy destination dst in place: one WRITE of the packed rows
// (zero-copy without placing: one per expert, from the caller's rows), into the chunk's rows of dst's receive area,
// then the chunk's final SIGNAL.
PORTEP_DEVICE void publish_combine_chunk(const LLCombineArgs& a, int dst, int chunk) {
  const LLCommon& c = a.c;
  const int R = c.num_ranks, first = chunk * kChunkExperts, n = chunk_experts(c, chunk);
  const uint64_t M = uint64_t(R) * c.T, pitch = c.comb_pitch;
  const uint32_t stream = c.stream_base + uint32_t(chunk);
  const uint64_t remote = combine_remote_chunk(c, chunk);
  fence_sys();  // the NIC reads the rows after the proxy sees the command (placed: dst reads them after the signal)
  const bool packed_here = rows_packed_here(a, dst);
  uint32_t packed = 0;
  for (int le = first; le < first + n; ++le) {
    const uint64_t lr = uint64_t(a.layout_range[le * R + dst]);
    const uint32_t begin = uint32_t(lr >> 32), count = uint32_t(lr);
    if (!packed_here && count &&
        !push_write(c, dst, stream, c.send_off + (uint64_t(le) * M + begin) * pitch, remote + uint64_t(packed) * pitch,
                    uint64_t(count) * pitch))
      return;
    packed += count;
  }
  if (packed_here && packed &&
      !push_write(c, dst, stream, c.send_off + combine_staging_row(c, dst, chunk) * pitch, remote,
                  uint64_t(packed) * pitch))
    return;
  push_signal(c, dst, stream);
}

// Rows of (local expert le, source src) are written: publish them to src (a proxy source: once the whole chunk's
// are). The caller fenced at GPU scope after counting the rows in.
PORTEP_DEVICE void publish_rows(const LLCombineArgs& a, int le, int src) {
  const LLCommon& c = a.c;
  if (c.peers[src]) {
    st_release_sys_u32(reinterpret_cast<uint32_t*>(c.peers[src] + c.flag_off) + c.rank * c.num_local_experts + le, 1u);
    return;
  }
  if (!chunk_complete(c, src, le / kChunkExperts)) return;
  fence_gpu();  // every other expert of the chunk was counted in after its rows
  publish_combine_chunk(a, src, le / kChunkExperts);
}

// Part `part` of `parts` of local expert le's rows; the last part to finish publishes them. shared: [3R].
PORTEP_DEVICE void combine_send_part(const LLCombineArgs& a, int le, int part, int parts, uint32_t* shared) {
  const LLCommon& c = a.c;
  const int R = c.num_ranks, chunk = le / kChunkExperts;
  const uint64_t M = uint64_t(R) * c.T;
  uint32_t* begins = shared;
  uint32_t* counts = shared + R;
  uint32_t* packed_before = shared + 2 * R;  // proxy sources: rows of the chunk's earlier experts
  __shared__ uint32_t total;
  __shared__ bool last;
  for (int src = threadIdx.x; src < R; src += blockDim.x) {
    const uint64_t lr = uint64_t(a.layout_range[le * R + src]);
    begins[src] = uint32_t(lr >> 32);
    counts[src] = uint32_t(lr);
    uint32_t before = 0;
    if (!c.peers[src] && rows_packed_here(a, src))
      for (int e = chunk * kChunkExperts; e < le; ++e) before += uint32_t(uint64_t(a.layout_range[e * R + src]));
    packed_before[src] = before;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t n = 0;
    for (int src = 0; src < R; ++src) n += counts[src];
    total = n;
  }
  __syncthreads();
  const int warp = int(threadIdx.x) / kWarpSize, expert = c.rank * c.num_local_experts + le;
  for (uint32_t i = uint32_t(part * kLLWarps + warp); i < total; i += uint32_t(parts * kLLWarps)) {
    int src = 0;
    while (src + 1 < R && !(i >= begins[src] && i < begins[src] + counts[src])) ++src;
    const uint8_t* row = static_cast<const uint8_t*>(a.x) + (uint64_t(le) * M + i) * a.x_pitch;
    if ((src == c.rank && a.own_rows_in_input) || partial_peer(c, src) || !sending_to(c, src)) continue;
    if (c.peers[src])
      put_row(a, c.peers[src] + c.recv_off + (uint64_t(expert) * c.T + (i - begins[src])) * c.comb_pitch, row);
    else if (rows_packed_here(a, src)) {  // proxy peers' rows packed per chunk: staged, or placed at src
      const uint64_t p = packed_before[src] + (i - begins[src]);
      put_row(a,
              proxy_bytes_at(c, src, c.send_off + (combine_staging_row(c, src, chunk) + p) * c.comb_pitch,
                             combine_remote_chunk(c, chunk) + p * c.comb_pitch),
              row);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    fence_sys();  // after the barrier: (cumulatively) every thread's row stores before the count
    last = atomic_add_relaxed_gpu_u32(&c.finish[le], 1u) + 1 == uint32_t(parts);
    if (last) c.finish[le] = 0;
  }
  __syncthreads();
  if (!last) return;
  fence_gpu();
  for (int src = threadIdx.x; src < R; src += blockDim.x)
    if (!partial_peer(c, src) && sending_to(c, src)) publish_rows(a, le, src);
}

// Warp 0: proxy source src's chunk of rows; this rank's selections of each of the chunk's experts (the numbers the
// sender packed by) give where each expert's rows begin, counted while the rows travel. Then its flags.
PORTEP_DEVICE void relay_combine_chunk(const LLCombineArgs& a, int src, int chunk) {
  __shared__ uint32_t counts[kChunkExperts];
  const LLCommon& c = a.c;
  const int first = src * c.num_local_experts + chunk * kChunkExperts, n = chunk_experts(c, chunk), j = lane_id();
  if (j < kChunkExperts) counts[j] = 0;
  warp_sync();
  for (int i = j; i < a.num_tokens * a.num_topk; i += kWarpSize) {
    const int64_t e = a.topk_idx[i];
    if (e >= first && e < first + n) atomicAdd(&counts[e - first], 1u);
  }
  warp_sync();
  const uint32_t begin = lane_exclusive_sum(counts);
  warp_sync();  // counts is reused by this warp's next chunk
  if (await_chunk_signal(c, src, chunk) < 0 || j >= n) return;
  c.proxy_begin[first + j] = begin;
  st_release_sys_u32(signal_flag(c, first + j), 1u);  // cumulative: the slot's acquire saw the rows
}

// Waits (without consuming it) until expert e's rows have arrived (proxy sources: relayed into its flag); false
// after the timeout (reported). timed: the nanoseconds waited add to the owner's wait statistics.
PORTEP_DEVICE bool wait_expert_rows(const LLCombineArgs& a, int e, bool timed = false) {
  const int src = e / a.c.num_local_experts;
  if (masked(a.c, src)) return false;
  uint64_t v = 0, waited = 0;
  const bool ok = await_flag(a.c, src, e, &v, &waited);
  if (timed && waited) atomicAdd(reinterpret_cast<unsigned long long*>(a.wait_stats + src), (unsigned long long)waited);
  return ok;
}

// Every expert's flag of this call was read: back to zero for the next call on this half.
PORTEP_DEVICE void reset_combine_signals(const LLCommon& c) {
  for (int e = threadIdx.x; e < c.num_experts; e += blockDim.x) clear_flag(c, e);
}

// Where the reduce finds the row of (expert e, slot): in one launch a local expert's row is still in the
// combine input, at this rank's packed position (layout_range gives where this rank's messages begin); the
// others arrived in the receive area.
PORTEP_DEVICE const uint4* row_address(const LLCombineArgs& a, int e, uint32_t slot) {
  const LLCommon& c = a.c;
  if (a.own_rows_in_input && e / c.num_local_experts == c.rank) {
    const int le = e % c.num_local_experts;
    const uint32_t begin = uint32_t(uint64_t(a.layout_range[le * c.num_ranks + c.rank]) >> 32);
    return reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(a.x) +
                                          (uint64_t(le) * c.num_ranks * c.T + begin + slot) * a.x_pitch);
  }
  const int src = e / c.num_local_experts;
  uint64_t row = uint64_t(e) * c.T + slot;
  if (!c.peers[src])  // packed per chunk; the relay stored where e's rows begin
    row = uint64_t(e - e % c.num_local_experts % kChunkExperts) * c.T + c.proxy_begin[e] + slot;
  return reinterpret_cast<const uint4*>(c.local + c.recv_off + row * c.comb_pitch);
}

// Token t's terms for the reduce, in shared memory, as load slots of 16 bytes per channel group (8 channels): its
// rows grouped by owner rank (ranks ascending, top-k order within), where a partial peer holding two or more of them
// gives one FP32 term instead (its two halves in the first two rows' places), which takes two slots (the group's
// 8 floats). Slot i of channel group j lies at (j < H/16 ? lo[i] : hi[i]) + j * stride, stride 16 for a BF16 row,
// 32 for a partial. So a batch of loads is the same code for both kinds, and a thread needs 4 registers per slot.
constexpr uint8_t kSlotPartialLow = 1, kSlotPartialHigh = 2, kSlotNewGroup = 4;  // kind bits; BF16 row: neither
struct ReduceSlots {  // at most K <= 32 slots: a partial's two slots replace two or more selections
  uint64_t lo[kWarpSize];
  uint64_t hi[kWarpSize];
  float weight[kWarpSize];  // BF16 rows
  uint8_t kind[kWarpSize];
  int count;
};

// Warp 0, lane k for selection k (K <= 32): where selection k's term goes in the (owner, k) order, found by
// counting instead of sorting, so no lane waits for a serial sort. Invalid selections (null rows) give no term.
PORTEP_DEVICE void place_slots(const LLCombineArgs& a, const uint4* const* rows, const float* weights,
                               const int* owners, ReduceSlots* slots) {
  const int K = a.num_topk, H = a.c.hidden, k = lane_id();
  const bool valid = k < K && rows[k];
  const int owner = valid ? owners[k] : INT_MAX;
  int same_before = 0, group_size = 0, next_same = -1;  // within this selection's owner group
  for (int j = 0; j < K; ++j) {
    if (!rows[j] || owners[j] != owner) continue;
    ++group_size;
    if (j < k) ++same_before;
    if (j > k && next_same < 0) next_same = j;
  }
  const bool collapsed = valid && partial_peer(a.c, owner) && group_size >= 2;
  const bool emits = valid && (!collapsed || same_before == 0);
  const int size = emits ? (collapsed ? 2 : 1) : 0;
  int before = 0, count = 0;  // slots of lower owner ranks; all slots
  for (int j = 0; j < K; ++j) {
    const int owner_j = warp_broadcast_i32(owner, j);
    const int size_j = warp_broadcast_i32(size, j);
    count += size_j;
    if (owner_j < owner) before += size_j;
  }
  const uint8_t new_group = same_before == 0 ? kSlotNewGroup : 0;
  const uint64_t row = uint64_t(rows[k]);
  if (emits && !collapsed) {
    const int m = before + same_before;
    slots->lo[m] = slots->hi[m] = row;
    slots->weight[m] = weights[k];
    slots->kind[m] = new_group;
  } else if (emits) {  // floats [0, H/2) from this row, [H/2, H) = groups from H/16 from the next selection's row
    const uint64_t high = uint64_t(rows[next_same]) - 2 * uint64_t(H);
    slots->lo[before] = row;
    slots->hi[before] = high;
    slots->kind[before] = kSlotPartialLow | new_group;
    slots->lo[before + 1] = row + 16;
    slots->hi[before + 1] = high + 16;
    slots->kind[before + 1] = kSlotPartialHigh;
  }
  if (k == 0) slots->count = count;
}

// Channels [8j, 8j + 8) of a token: sum over owner groups in order of (sum over the group's terms in order),
// FP32, each product and sum rounded on its own.
PORTEP_DEVICE void reduce_channels(const ReduceSlots& slots, int j, int H, float* acc) {
  float group[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const int n = slots.count;
  const bool high = j >= H / 16;
  for (int i0 = 0; i0 < n; i0 += 8) {  // the loads of up to 8 slots are in flight together
    uint4 v[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const int i = i0 + q;
      v[q] = make_uint4(0, 0, 0, 0);
      if (i >= n) continue;
      const uint64_t stride = slots.kind[i] & (kSlotPartialLow | kSlotPartialHigh) ? 32 : 16;
      v[q] = *reinterpret_cast<const uint4*>((high ? slots.hi[i] : slots.lo[i]) + uint64_t(j) * stride);
    }
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const int i = i0 + q;
      if (i >= n) continue;
      const uint8_t kind = slots.kind[i];
      if ((kind & kSlotNewGroup) && i > 0) {
#pragma unroll
        for (int x = 0; x < 8; ++x) {
          acc[x] = __fadd_rn(acc[x], group[x]);
          group[x] = 0;
        }
      }
      if (!(kind & (kSlotPartialLow | kSlotPartialHigh))) {
        accumulate_row(group, v[q], slots.weight[i]);
        continue;
      }
      const float f[4] = {__uint_as_float(v[q].x), __uint_as_float(v[q].y), __uint_as_float(v[q].z),
                          __uint_as_float(v[q].w)};
      if (kind & kSlotPartialHigh) {
#pragma unroll
        for (int x = 0; x < 4; ++x) group[4 + x] = __fadd_rn(group[4 + x], f[x]);
      } else {
#pragma unroll
        for (int x = 0; x < 4; ++x) group[x] = __fadd_rn(group[x], f[x]);
      }
    }
  }
  if (n)
#pragma unroll
    for (int x = 0; x < 8; ++x) acc[x] = __fadd_rn(acc[x], group[x]);
}

// Channels [16j, 16j + 16) of a token whose rows are LogFMT-10 (masks[i]: slot i's cast chunks): the same sums in
// the same order as reduce_channels (no slot is a partial: LogFMT combines send none).
PORTEP_DEVICE void reduce_logfmt_channels(const ReduceSlots& slots, const uint32_t* masks, int j, int H, float* acc) {
  float group[16];
#pragma unroll
  for (int x = 0; x < 16; ++x) group[x] = 0;
  for (int i = 0; i < slots.count; ++i) {
    if ((slots.kind[i] & kSlotNewGroup) && i > 0)
#pragma unroll
      for (int x = 0; x < 16; ++x) {
        acc[x] = __fadd_rn(acc[x], group[x]);
        group[x] = 0;
      }
    logfmt_accumulate(group, reinterpret_cast<const uint8_t*>(slots.lo[i]), masks[i], j, H, slots.weight[i]);
  }
  if (slots.count)
#pragma unroll
    for (int x = 0; x < 16; ++x) acc[x] = __fadd_rn(acc[x], group[x]);
}

// Waits for the experts of this block's tokens, then counts the block done; the last block resets every flag.
// Before the reduce's output stores: so the fence has no stores to wait for, and the last block resets while the
// others reduce. Every read of a flag happens here, so the reset cannot hide one from a block.
PORTEP_DEVICE void await_block_experts(const LLCombineArgs& a) {
  const LLCommon& c = a.c;
  const int K = a.num_topk;
  // With wait statistics every expert is first waited for once, by block e % gridDim (as DeepEP's per-rank receive
  // cost: a sum over experts), so that no expert's wait is counted by every block holding one of its tokens.
  if (a.wait_stats)
    for (int e = int(blockIdx.x) + int(threadIdx.x) * int(gridDim.x); e < c.num_experts;
         e += int(blockDim.x * gridDim.x))
      wait_expert_rows(a, e, true);
  for (int t = int(blockIdx.x); t < a.num_tokens; t += int(gridDim.x)) {
    if (int(threadIdx.x) >= K) break;
    const int64_t e = a.topk_idx[uint64_t(t) * K + threadIdx.x];
    if (e >= 0 && e < c.num_experts) wait_expert_rows(a, int(e));  // a timeout is reported; the results are void
  }
  __syncthreads();
  __shared__ bool last;
  if (threadIdx.x == 0) {
    fence_gpu();
    uint32_t* done = c.finish + c.num_experts;
    last = atomic_add_relaxed_gpu_u32(done, 1u) + 1 == gridDim.x;
    if (last) *done = 0;
  }
  __syncthreads();
  if (!last) return;
  // Blocks waited only for their own tokens' experts, but every (expert, source) pair is signalled on every call:
  // wait for the rest too, or a late signal would survive the reset and satisfy a later call's wait before its rows
  // arrive.
  for (int e = threadIdx.x; e < c.num_experts; e += blockDim.x) wait_expert_rows(a, e);
  __syncthreads();
  fence_gpu();
  reset_combine_signals(c);
  __syncthreads();
}

// One block per token: the block waits for its tokens' experts (await_block_experts), then finds each token's K rows
// and reduces them (reduce_channels).
PORTEP_DEVICE void combine_reduce(const LLCombineArgs& a) {
  __shared__ const uint4* rows[kWarpSize];
  __shared__ float weights[kWarpSize];
  __shared__ int tok_experts[kWarpSize];
  __shared__ uint32_t tok_slots[kWarpSize];
  __shared__ int owners[kWarpSize];  // the rank holding each selection's expert (divided once, in parallel)
  __shared__ ReduceSlots slots;
  __shared__ uint32_t cast_masks[kWarpSize];  // LogFMT: each slot's cast chunks
  const LLCommon& c = a.c;
  const int K = a.num_topk, H = c.hidden;
  for_my_relay_chunks(c, [&](int src, int chunk) { relay_combine_chunk(a, src, chunk); });
  await_block_experts(a);
  if (block_call_failed(c)) {  // a wait ended short, or the Buffer had failed: no token of this block is a result
    for (int t = int(blockIdx.x); t < a.num_tokens; t += int(gridDim.x))
      block_poison16(static_cast<uint8_t*>(a.out) + uint64_t(t) * a.out_pitch, uint64_t(H) / 8);
    return;
  }
  for (int t = int(blockIdx.x); t < a.num_tokens; t += int(gridDim.x)) {
    token_selections(a.topk_idx, t, K, c.num_experts, tok_experts, tok_slots);
    if (int(threadIdx.x) < K) {
      const int k = int(threadIdx.x), e = tok_experts[k];
      const uint32_t slot = tok_slots[k];
      // (shrink mode: a masked owner's selection is absent)
      const bool valid = e >= 0 && slot < uint32_t(c.T) && !masked(c, e / c.num_local_experts);
      rows[k] = valid ? row_address(a, e, slot) : nullptr;
      weights[k] = a.topk_weights[uint64_t(t) * K + k];
      owners[k] = valid ? e / c.num_local_experts : 0;
    }
    __syncthreads();
    if (int(threadIdx.x) < kWarpSize) place_slots(a, rows, weights, owners, &slots);
    __syncthreads();
    uint4* out = reinterpret_cast<uint4*>(static_cast<uint8_t*>(a.out) + uint64_t(t) * a.out_pitch);
    if (a.use_logfmt) {
      logfmt_cast_masks(slots.lo, slots.count, H, cast_masks);
      __syncthreads();
      for (int j = threadIdx.x; j < H / 16; j += blockDim.x) {
        float acc[16];
#pragma unroll
        for (int x = 0; x < 16; ++x) acc[x] = 0;
        reduce_logfmt_channels(slots, cast_masks, j, H, acc);
        out[2 * j] = pack_bf16x8(acc);
        out[2 * j + 1] = pack_bf16x8(acc + 8);
      }
      __syncthreads();
      continue;
    }
    for (int j = threadIdx.x; j < H / 8; j += blockDim.x) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      reduce_channels(slots, j, H, acc);
      out[j] = pack_bf16x8(acc);
    }
    __syncthreads();  // rows/weights/slots are rewritten for the next token
  }
}

// phases: kPhaseSend and/or kPhaseRecv (both: every block sends its parts, then reduces its tokens). One kernel for
// every phase, chosen at run time, as in dispatch_kernel (one kernel named "combine" per call; a hook's two phases
// are two launches of it). At most one block per SM in every grid: the reduce needs more than half an SM's
// registers, and every block of a receiving grid must be resident (for_my_relay_chunks).
__global__ void __launch_bounds__(kLLThreads, 1) combine_kernel(LLCombineArgs a, int parts, int phases) {
  extern __shared__ uint32_t shared[];                     // begins [R], counts [R]
  if (a.c.seq_mode) (void)ll_call_seq(a.c);                // combine carries no number, but advances the chain
  if ((phases & kPhaseSend) && !block_call_failed(a.c)) {  // a failed Buffer sends nothing
    const LLCommon& c = a.c;
    int partial_peers = 0;
    for (int r = 0; r < c.num_ranks; ++r) partial_peers += partial_peer(c, r);
    if (partial_peers && blockIdx.x == 0) write_combine_meta(a);
    // items: (partial peer, token) first, then (local expert, part) for the rows of every other peer
    const int token_items = partial_peers * c.T;
    for (int item = int(blockIdx.x); item < token_items + c.num_local_experts * parts; item += int(gridDim.x)) {
      __syncthreads();  // shared memory is reused
      if (item < token_items) {
        combine_partial_token(a, nth_partial_peer(c, item / c.T), item % c.T);
      } else {
        const int part_item = item - token_items;
        combine_send_part(a, part_item / parts, part_item % parts, parts, shared);
      }
    }
  }
  if (phases & kPhaseRecv) combine_reduce(a);
}

}  // namespace

namespace {

struct CombineLaunch {
  int blocks = 0, parts = 1;
  size_t smem = 0;
  LLCombineArgs args;
};

// The grid, parts per expert, dynamic shared memory and kernel arguments of a combine launch.
cudaError_t combine_launch(const LLCombineArgs& a, int phases, CombineLaunch* l) {
  if (a.num_topk > kMetaMaxTopk || phases < kPhaseSend || phases > (kPhaseSend | kPhaseRecv) ||
      (a.use_logfmt && (!logfmt_hidden_ok(a.c.hidden) || a.c.meta_off != 0 || a.zero_copy)))
    return cudaErrorInvalidValue;
  const LLCommon& c = a.c;
  l->smem = size_t(c.num_ranks) * 12;
  const int N = std::max(a.num_tokens, 1), E_l = std::max(c.num_local_experts, 1), sms = c.num_sms;
  auto parts_for = [E_l](int blocks) { return std::clamp(blocks / E_l, 1, kMaxPartsPerExpert); };
  l->args = a;
  if (phases == (kPhaseSend | kPhaseRecv)) {
    l->blocks = send_recv_grid(N, E_l, sms);
    l->parts = parts_for(l->blocks);
    // one launch: the reduce reads this rank's rows from x, which cannot change (LogFMT: decodes them, as any row)
    l->args.own_rows_in_input = !a.use_logfmt;
  } else if (phases == kPhaseSend) {
    l->parts = parts_for(sms);
    l->blocks = std::min(E_l * l->parts, sms);
  } else {
    l->blocks = std::min(N, sms);
  }
  return cudaSuccess;
}

}  // namespace

int ll_combine(const LLCombineArgs& a, int phases) {
  CombineLaunch l;
  if (cudaError_t e = combine_launch(a, phases, &l); e != cudaSuccess) return int(e);
  const cudaStream_t stream = static_cast<cudaStream_t>(a.c.stream);
  return int(launch_kernel<combine_kernel>(l.blocks, kLLThreads, l.smem, stream, l.args, l.parts, phases));
}

int ll_combine_graphed(LLGraphs* graphs, const LLCombineArgs& a) {
#if defined(__HIPCC__)
  (void)graphs;
  (void)a;
  return int(cudaErrorNotSupported);
#else
  const int phases = kPhaseSend | kPhaseRecv;
  CombineLaunch l;
  if (cudaError_t e = combine_launch(a, phases, &l); e != cudaSuccess) return int(e);
  return launch_graphed(graphs->combine, reinterpret_cast<const void*>(combine_kernel), l.blocks, kLLThreads, l.smem,
                        l.args, l.parts, phases);
#endif
}

int load_ll_combine_kernels() { return int(load_kernel(combine_kernel)); }

}  // namespace portep::cuda
