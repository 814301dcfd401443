// The HT combine data kernel (ht_api.h): per channel one block sends this rank's rows back to their sources and
// one block reduces this rank's own tokens (bias, then the rows of its node's ranks ascending, then those of other
// ranks or nodes ascending, FP32, as the host backend); with forwarding a third block sums, for the sources of other
// nodes it serves, its node's rows of each token into one partial row for the source.
#include "gpu_kernels/cuda/gpu_runtime.h"

#include "gpu_kernels/cuda/ht_common.cuh"

namespace portep::cuda {
namespace {

// Row stride of every combine ring (ht_layout.h).
PORTEP_DEVICE uint32_t slot_bytes(const HTCombineArgs& a) {
  return ht_combine_row_bytes(ht_forwarding(a.c), a);
}

// Warp-wide: x's row `row` (and its weights) as one contribution at dst.
PORTEP_DEVICE void write_contribution(const HTCombineArgs& a, uint8_t* dst, int64_t row) {
  warp_copy16(reinterpret_cast<uint4*>(dst), reinterpret_cast<const uint4*>(a.x + row * a.hidden), a.hidden * 2 / 16);
  if (a.topk_weights) {
    float* w = reinterpret_cast<float*>(dst + ht_combine_weights(false, a.hidden));
    for (int k = lane_id(); k < a.num_topk; k += kWarpSize) w[k] = a.topk_weights[row * a.num_topk + k];
  }
}

struct SendState {
  uint32_t fwd_sent[kHTMaxRanks];  // forwarding: rows stored into local rank l's forward ring (l the forwarder)
  int failed;
};

// The rows of source s's tokens in channel ch back to s: through ring (s, ch), or with forwarding for a source of
// another node through the forward ring of its forwarder here; batch by batch, each batch announced. false after a
// timeout (reported).
PORTEP_DEVICE bool send_to(const HTCombineArgs& a, int ch, int s, uint64_t epoch, SendState& st) {
  const HTCommon& c = a.c;
  const int C = c.num_channels, warp = threadIdx.x / kWarpSize, stride = a.recv_prefix_stride;
  const bool via_forwarder = ht_forwarding(c) && node_of(c, s) != node_of(c, c.rank);
  const int dst = via_forwarder ? node_of(c, c.rank) * c.ranks_per_node + local_of(c, s) : s;
  const uint32_t bytes = slot_bytes(a), Q = a.ring_rows;
  const int64_t begin = a.recv_channel_prefix[s * C + ch];
  const uint32_t n = uint32_t(received_end(a.recv_channel_prefix, a.recv_prefix, stride, C, s, ch) - begin);
  const int64_t local_row0 = rows_before(a.recv_prefix, stride, s) + begin;  // in x
  __syncthreads();  // the previous source's bookkeeping is done
  const uint32_t first = via_forwarder ? st.fwd_sent[local_of(c, s)] : 0;  // ring index of the first row
  const uint64_t remote_ring = via_forwarder ? ht_fwd_ring_offset(c, local_of(c, c.rank), ch, Q, bytes)
                                             : ht_ring_offset(c, s, c.rank, ch, Q, bytes);
  const uint64_t stage_ring = ht_ring_offset(c, c.rank, s, ch, Q, bytes);
  uint32_t flushed = 0;  // thread 0's
  for (uint32_t b = 0; b < n; b += kHTWarps) {
    const uint32_t r = b + warp, done = min(b + kHTWarps, n);
    if (threadIdx.x == 0 && !(via_forwarder ? await_fwd_room(c, true, dst, ch, epoch, first + done, Q)
                                            : await_room(c, true, s, ch, epoch, done, Q)))
      st.failed = 1;
    __syncthreads();
    if (st.failed) return false;
    if (r < n) {
      const uint64_t slot = ht_ring_slot(first + r, Q, bytes);
      uint8_t* to = c.peers[dst] ? c.peers[dst] + c.recv_off + remote_ring + slot
                                 : proxy_ring_slot(c, dst, stage_ring, remote_ring, slot);
      write_contribution(a, to, local_row0 + r);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      if (via_forwarder) {
        publish_tail(fwd_tail_word(c, c.peers[dst], true, c.rank, ch), epoch, first + done);
      } else if (c.peers[s]) {
        publish_tail(tail_word(c, c.peers[s], true, c.rank, ch), epoch, done);
      } else {
        fence_sys();  // the rows (staged or placed) before the WRITEs that move or announce them
        flush_rows(c, s, ht_data_stream(c, true, ch), stage_ring, remote_ring, bytes, Q, &flushed, done, done == n);
      }
    }
  }
  if (threadIdx.x == 0 && via_forwarder) st.fwd_sent[local_of(c, s)] = first + n;
  return true;
}

// Sources ascending (every rank sends in this order, and forwarders serve in it: no circular wait).
PORTEP_DEVICE void send_channel(const HTCombineArgs& a, int ch) {
  __shared__ SendState st;
  const HTCommon& c = a.c;
  const uint64_t epoch = *c.epoch;
  if (int(threadIdx.x) < c.ranks_per_node) st.fwd_sent[threadIdx.x] = 0;
  if (threadIdx.x == 0) st.failed = 0;
  for (int s = 0; s < c.num_ranks; ++s)
    if (s != c.rank && !send_to(a, ch, s, epoch, st)) return;
  const int d = threadIdx.x;
  if (d < c.num_ranks && !(ht_forwarding(c) && node_of(c, d) != node_of(c, c.rank)))
    collect_credits(c, true, d, ch, rows_from_source(a, d, ch));
}

// FP32 sums of rows, as the host backend orders them: rows [0, nbias) are bias (BF16; the first is assigned, not
// added, when bias_assign, as bias0 is), then [nbias, nb) BF16 rows (x, contributions), then up to n FP32 rows
// (partials). weights[i] belongs to row nbias + i.
struct RowSet {
  const uint8_t* rows[kHTMaxRanks + 2];
  const float* weights[kHTMaxRanks];
  int nbias, nb, n;
  bool bias_assign;
};

PORTEP_DEVICE void add_row(RowSet& set, const uint8_t* row, const float* weights) {
  set.weights[set.n - set.nbias] = weights;
  set.rows[set.n++] = row;
}

PORTEP_DEVICE void store_word(uint8_t* out_row, bool out_f32, int j, const float* acc) {
  if (out_f32) {
    float4* o = reinterpret_cast<float4*>(out_row) + 2 * j;
    o[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    o[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
  } else {
    reinterpret_cast<uint4*>(out_row)[j] = pack_bf16x8(acc);
  }
}

// Warp-wide, the common case: out_row = the sum of kRows BF16 rows (kAssignFirst: the first, bias0, is assigned,
// not added to 0, as the host backend's sum starts). Each lane loads kWords words of every row
// (about kReduceLoads 16-byte loads in flight) before it sums the first. The reduction is bound by issued
// instructions (a build timing its phases, commit 0437ce3: 286 of a reducer's 362 us went to summing, 25 us to
// waiting for rows; more loads in flight through shared memory made it slower), so the row pointers stay in registers
// and BF16 output uses the conversion instruction.
constexpr int kReduceLoads = 8;  // 16-byte loads a reducing lane has in flight (more spill: 64 registers a thread)

template <int kRows, bool kOutF32, bool kAssignFirst>
PORTEP_DEVICE void sum_bf16_rows(const RowSet& set, int words, uint8_t* out_row) {
  constexpr int kWords = kRows >= kReduceLoads ? 1 : kReduceLoads / kRows;
  const uint4* rows[kRows];
#pragma unroll
  for (int q = 0; q < kRows; ++q) rows[q] = reinterpret_cast<const uint4*>(set.rows[q]);
  auto sum_and_store = [&](const uint4* v, int j) {  // v[kRows]: word j of every row
    float acc[8];
    if (kAssignFirst) {
      set_bf16x8(acc, v[0]);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = 0.0f;  // (0 + the first row: a -0 sums to +0, as the host's)
      add_bf16x8(acc, v[0]);
    }
#pragma unroll
    for (int q = 1; q < kRows; ++q) add_bf16x8(acc, v[q]);
    store_word(out_row, kOutF32, j, acc);
  };
  int j = lane_id();
  for (; j + (kWords - 1) * kWarpSize < words; j += kWords * kWarpSize) {
    uint4 v[kWords][kRows];
#pragma unroll
    for (int u = 0; u < kWords; ++u)
#pragma unroll
      for (int q = 0; q < kRows; ++q) v[u][q] = rows[q][j + u * kWarpSize];
#pragma unroll
    for (int u = 0; u < kWords; ++u) sum_and_store(v[u], j + u * kWarpSize);
  }
  for (; j < words; j += kWarpSize) {
    uint4 v[kRows];
#pragma unroll
    for (int q = 0; q < kRows; ++q) v[q] = rows[q][j];
    sum_and_store(v, j);
  }
}

// Warp-wide, any set (FP32 partials, more rows than the templates take): word by word, row by row.
PORTEP_DEVICE void sum_rows(const RowSet& set, int words, uint8_t* out_row, bool out_f32) {
  for (int j = lane_id(); j < words; j += kWarpSize) {
    float acc[8] = {};
    int q = 0;
    if (set.bias_assign) set_bf16x8(acc, reinterpret_cast<const uint4*>(set.rows[q++])[j]);  // exactly bias0
    for (; q < set.nb; ++q) add_bf16x8(acc, reinterpret_cast<const uint4*>(set.rows[q])[j]);
    for (; q < set.n; ++q) {
      const float4* p = reinterpret_cast<const float4*>(set.rows[q]) + 2 * j;
      const float4 lo = p[0], hi = p[1];
      acc[0] += lo.x, acc[1] += lo.y, acc[2] += lo.z, acc[3] += lo.w;
      acc[4] += hi.x, acc[5] += hi.y, acc[6] += hi.z, acc[7] += hi.w;
    }
    store_word(out_row, out_f32, j, acc);
  }
}

template <bool kOutF32, bool kAssignFirst>
PORTEP_DEVICE bool sum_bf16_rows_fast(const RowSet& set, int words, uint8_t* out_row) {
  switch (set.n) {
#define PORTEP_SUM_CASE(k) \
  case k: sum_bf16_rows<k, kOutF32, kAssignFirst>(set, words, out_row); return true;
    PORTEP_SUM_CASE(1) PORTEP_SUM_CASE(2) PORTEP_SUM_CASE(3) PORTEP_SUM_CASE(4)
    PORTEP_SUM_CASE(5) PORTEP_SUM_CASE(6) PORTEP_SUM_CASE(7) PORTEP_SUM_CASE(8)
#undef PORTEP_SUM_CASE
    default: return false;
  }
}
static_assert(kHTMaxRanks <= 8, "sum_bf16_rows_fast has a case for each row count up to kHTMaxRanks");

// Warp-wide: out_row (BF16, or FP32 for a partial) = the set's rows summed; out_w = their weights summed.
PORTEP_DEVICE void reduce_rows(const RowSet& set, int hidden, int num_topk, uint8_t* out_row, bool out_f32,
                               float* out_w) {
  const int lane = lane_id(), words = hidden / 8;
  bool done = false;
  if (set.nb == set.n) {  // BF16 rows only (bias rows, if any, come with BF16 output: no partial has them)
    if (set.bias_assign)
      done = !out_f32 && sum_bf16_rows_fast<false, true>(set, words, out_row);
    else
      done = out_f32 ? sum_bf16_rows_fast<true, false>(set, words, out_row)
                     : sum_bf16_rows_fast<false, false>(set, words, out_row);
  }
  if (!done) sum_rows(set, words, out_row, out_f32);
  if (out_w) {
    for (int k = lane; k < num_topk; k += kWarpSize) {
      float acc = 0.0f;
      for (int q = 0; q < set.n - set.nbias; ++q) acc += set.weights[q] ? set.weights[q][k] : 0.0f;
      out_w[k] = acc;
    }
  }
}

// ---- the reducer (the source's tokens) ----
struct ReduceState {
  uint32_t masks[kHTWarps];        // batch: the ranks each warp's token has rows from (effective_mask)
  uint32_t base[kHTMaxRanks];      // rows of this channel from each rank reduced before this batch
  uint32_t batch[kHTMaxRanks];     // the batch's rows from each rank
  uint32_t have[kHTMaxRanks];      // rows known to be in place
  uint32_t credited[kHTMaxRanks];  // proxy ranks: chunks credited back
  int failed;
};

// Thread j < R waits until rank j's rows the batch needs are in place; false (block-wide) after a timeout.
PORTEP_DEVICE bool await_batch(const HTCombineArgs& a, ReduceState& st, int ch, uint64_t epoch) {
  const HTCommon& c = a.c;
  const int j = threadIdx.x;
  const uint32_t need = j < c.num_ranks ? st.base[j] + st.batch[j] : 0;
  if (j < c.num_ranks && j != c.rank && need > st.have[j]) {
    if (c.peers[j]) {
      const uint64_t* word = tail_word(c, c.local, true, j, ch);
      if (await_tail(c, word, epoch, need, j, ch))
        st.have[j] = uint32_t(ld_acquire_sys_u64(word));
      else
        st.failed = 1;
    } else {
      const int64_t units = await_units(c, j, ht_data_stream(c, true, ch), chunks(need));
      if (units >= 0)
        st.have[j] = uint32_t(units * kHTChunkRows);
      else
        st.failed = 1;
    }
  }
  __syncthreads();
  return !st.failed;
}

// Warp-wide: token t's sum of bias, its node's rows (ranks ascending), then the other rows (ranks, i.e. with
// forwarding the partials of nodes, ascending).
PORTEP_DEVICE void reduce_token(const HTCombineArgs& a, const ReduceState& st, int t, int ch, int warp) {
  const HTCommon& c = a.c;
  const int R = c.num_ranks, me = c.rank, C = c.num_channels;
  const uint32_t bytes = slot_bytes(a), mask = st.masks[warp];
  const bool partials = ht_forwarding(c);  // the rows of other nodes (pass 1) are FP32 partials
  const int64_t base = int64_t(t) * a.hidden;
  RowSet set;
  set.n = set.nbias = 0;
  set.bias_assign = a.bias0 != nullptr;
  if (a.bias0) set.rows[set.n++] = reinterpret_cast<const uint8_t*>(a.bias0 + base);
  if (a.bias1) set.rows[set.n++] = reinterpret_cast<const uint8_t*>(a.bias1 + base);
  set.nbias = set.nb = set.n;
  for (int pass = 0; pass < 2; ++pass) {
    for (int j = 0; j < R; ++j) {
      if (!(mask >> j & 1) || (node_of(c, j) == node_of(c, me)) != (pass == 0)) continue;
      const uint32_t index = st.base[j] + rows_with_bit(st.masks, warp, j);  // among this channel's rows from j
      if (j == me) {
        const int64_t row = rows_before(a.recv_prefix, a.recv_prefix_stride, me) + a.recv_channel_prefix[me * C + ch] +
                            index;
        add_row(set, reinterpret_cast<const uint8_t*>(a.x + row * a.hidden),
                a.topk_weights ? a.topk_weights + row * a.num_topk : nullptr);
      } else {
        const uint8_t* row = c.local + c.recv_off + ht_ring_offset(c, me, j, ch, a.ring_rows, bytes) +
                             ht_ring_slot(index, a.ring_rows, bytes);
        add_row(set, row, reinterpret_cast<const float*>(row + ht_combine_weights(partials && pass == 1, a.hidden)));
      }
    }
    if (pass == 0 || !partials) set.nb = set.n;
  }
  reduce_rows(set, a.hidden, a.num_topk, reinterpret_cast<uint8_t*>(a.out + base), false,
              a.out_weights ? a.out_weights + int64_t(t) * a.num_topk : nullptr);
}

PORTEP_DEVICE void reduce_channel(const HTCombineArgs& a, int ch) {
  __shared__ ReduceState st;
  const HTCommon& c = a.c;
  const int R = c.num_ranks, C = c.num_channels, warp = threadIdx.x / kWarpSize, lane = lane_id(), j = threadIdx.x;
  const uint64_t epoch = *c.epoch;
  if (j < R) st.base[j] = st.have[j] = st.credited[j] = 0;
  if (j == 0) st.failed = 0;
  const int t0 = channel_begin(a.num_tokens, C, ch), t1 = channel_begin(a.num_tokens, C, ch + 1);
  for (int b = t0; b < t1; b += kHTWarps) {
    const int t = b + warp;
    const bool in = lane < R && t < t1 && a.is_token_in_rank[int64_t(t) * R + lane];
    const uint32_t ranks = uint32_t(warp_ballot(in));  // lanes < R <= kHTMaxRanks
    __syncthreads();  // the previous batch's bookkeeping is done
    if (lane == 0) st.masks[warp] = effective_mask(c, ranks);
    __syncthreads();
    if (j < R) st.batch[j] = rows_with_bit(st.masks, kHTWarps, j);
    __syncthreads();
    if (!await_batch(a, st, ch, epoch)) return;
    if (t < t1) reduce_token(a, st, t, ch, warp);
    __syncthreads();  // every reduce's loads returned before the slots go back
    if (j < R && st.batch[j]) {
      st.base[j] += st.batch[j];
      if (j != c.rank) return_rows(c, true, j, ch, epoch, st.base[j], &st.credited[j]);
    }
  }
  if (j < R && j != c.rank && !c.peers[j]) consume_units(c, j, ht_data_stream(c, true, ch), chunks(st.base[j]));
}

// ---- the forwarder (forwarding only) ----
struct PartialState {
  uint32_t masks[kHTWarps];     // batch: each warp's token's local ranks (from nvl_head)
  uint32_t used[kHTMaxRanks];   // rows of local rank l's forward ring of this channel consumed so far
  uint32_t batch[kHTMaxRanks];  // the batch's rows per local rank
  int failed;
};

// Warp-wide: one partial row at dst: the token's rows of this node's ranks summed, local ranks ascending.
PORTEP_DEVICE void reduce_partial(const HTCommon& c, const HTCombineArgs& a, const PartialState& st, int warp,
                                  uint8_t* dst, int ch) {
  const uint32_t bytes = slot_bytes(a), mask = st.masks[warp];
  RowSet set;
  set.n = set.nbias = 0;
  set.bias_assign = false;
  for (int l = 0; l < c.ranks_per_node; ++l) {
    if (!(mask >> l & 1)) continue;
    const uint32_t index = st.used[l] + rows_with_bit(st.masks, warp, l);
    const uint8_t* row = c.local + c.recv_off + ht_fwd_ring_offset(c, l, ch, a.ring_rows, bytes) +
                         ht_ring_slot(index, a.ring_rows, bytes);
    add_row(set, row, reinterpret_cast<const float*>(row + ht_combine_weights(false, a.hidden)));
  }
  set.nb = set.n;
  float* weights = a.num_topk ? reinterpret_cast<float*>(dst + ht_combine_weights(true, a.hidden)) : nullptr;
  reduce_rows(set, a.hidden, a.num_topk, dst, true, weights);
}

// The partial rows of node n's served source in this channel, batch by batch, through the proxies.
PORTEP_DEVICE bool partials_for(const HTCombineArgs& a, PartialState& st, int n, int ch, uint64_t epoch) {
  const HTCommon& c = a.c;
  const int L = c.ranks_per_node, l = threadIdx.x, warp = threadIdx.x / kWarpSize, lane = lane_id();
  const int s = n * L + local_of(c, c.rank), base = node_of(c, c.rank) * L;
  const uint32_t rows = served_rows(c, a.fwd_channel_prefix, a.fwd_rank_prefix, n, ch), bytes = slot_bytes(a);
  const int64_t row0 = served_row0(c, a.fwd_channel_prefix, a.fwd_rank_prefix, n, ch);
  const uint64_t stage_ring = ht_ring_offset(c, c.rank, s, ch, a.ring_rows, bytes);
  const uint64_t remote_ring = ht_ring_offset(c, s, c.rank, ch, a.ring_rows, bytes);
  uint32_t flushed = 0;  // thread 0's
  for (uint32_t b = 0; b < rows; b += kHTWarps) {
    const uint32_t end = min(b + kHTWarps, rows), r = b + warp;
    uint32_t mask = 0;
    if (r < end && lane < L) mask = a.nvl_head[(row0 + r) * kHTNvlHeadColumns + lane] >= 0;
    mask = uint32_t(warp_ballot(mask != 0));
    __syncthreads();  // the previous batch's bookkeeping is done
    if (lane == 0) st.masks[warp] = mask;
    __syncthreads();
    if (l < L) {
      const uint32_t k = rows_with_bit(st.masks, kHTWarps, l);
      st.batch[l] = k;
      if (k && !await_tail(c, fwd_tail_word(c, c.local, true, base + l, ch), epoch, st.used[l] + k, base + l, ch))
        st.failed = 1;
    }
    if (threadIdx.x == 0 && !await_room(c, true, s, ch, epoch, end, a.ring_rows)) st.failed = 1;
    __syncthreads();
    if (st.failed) return false;
    uint8_t* staged = proxy_ring_slot(c, s, stage_ring, remote_ring, ht_ring_slot(r, a.ring_rows, bytes));
    if (r < end) reduce_partial(c, a, st, warp, staged, ch);
    __syncthreads();  // every load returned (slots go back) and the partials are staged
    if (l < L && st.batch[l]) {
      st.used[l] += st.batch[l];
      st_relaxed_sys_u64(fwd_head_word(c, c.peers[base + l], true, c.rank, ch), ht_word_value(epoch, st.used[l]));
    }
    if (threadIdx.x == 0) {
      fence_sys();  // the rows (staged or placed) before the WRITEs that move or announce them
      flush_rows(c, s, ht_data_stream(c, true, ch), stage_ring, remote_ring, bytes, a.ring_rows, &flushed, end,
                 end == rows);
    }
  }
  return true;
}

// Serves the sources of other nodes with this rank's local index one after another, nodes ascending, then collects
// their credits.
PORTEP_DEVICE void forward_channel(const HTCombineArgs& a, int ch) {
  __shared__ PartialState st;
  const HTCommon& c = a.c;
  const int L = c.ranks_per_node, Nn = c.num_ranks / L, me = node_of(c, c.rank);
  const uint64_t epoch = *c.epoch;
  if (int(threadIdx.x) < L) st.used[threadIdx.x] = 0;
  if (threadIdx.x == 0) st.failed = 0;
  for (int n = 0; n < Nn; ++n)
    if (n != me && !partials_for(a, st, n, ch, epoch)) return;
  const int n = threadIdx.x;
  if (n < Nn && n != me)
    collect_credits(c, true, n * L + local_of(c, c.rank), ch,
                    served_rows(c, a.fwd_channel_prefix, a.fwd_rank_prefix, n, ch));
}

__global__ void __launch_bounds__(kHTThreads, 1) ht_combine_kernel(HTCombineArgs a) {
  if (failed_before(a.c)) return;
  const int per = ht_forwarding(a.c) ? 3 : 2, role = blockIdx.x % per, ch = blockIdx.x / per;
  if (role == 0)
    send_channel(a, ch);
  else if (role == 1)
    reduce_channel(a, ch);
  else
    forward_channel(a, ch);
}

}  // namespace

int ht_combine(const HTCombineArgs& a) {
  const int blocks = ht_blocks_per_channel(a.c) * a.c.num_channels;
  return int(launch_kernel<ht_combine_kernel>(blocks, kHTThreads, 0, static_cast<cudaStream_t>(a.c.stream), a));
}

int load_ht_combine_kernels() {
  return int(load_kernel(ht_combine_kernel));
}

}  // namespace portep::cuda
