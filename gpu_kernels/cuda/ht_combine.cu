// The HT combine data kernel (ht_api.h): per channel one block sends this rank's rows back to their sources and
// one block reduces this rank's own tokens (bias, then the rows of its node's ranks ascending, then those of other
// ranks or nodes ascending, FP32, as the host backend); with forwarding a third block sums, for the sources of other
// nodes it serves, its node's rows of each token into one partial row for the source.
#include "gpu_kernels/cuda/gpu_runtime.h"

#include "gpu_kernels/cuda/ht_combine_send.cuh"
#include "gpu_kernels/cuda/ht_common.cuh"

namespace portep::cuda {
namespace {

// Rows of one token a RowSet holds besides bias; a token with rows from more peers is reduced by
// reduce_token_walk, which finds each row again per word instead of keeping its address.
constexpr int kHTMaxSetRows = 16;
static_assert(kHTMaxSetRows >= kHTMaxNodeRanks, "a forwarder's partial sums at most one row per local rank");

// FP32 sums of rows, as the host backend orders them: rows [0, nbias) are bias (BF16; the first is assigned, not
// added, when bias_assign, as bias0 is), then [nbias, nb) BF16 rows (x, contributions), then up to n FP32 rows
// (partials). weights[i] belongs to row nbias + i.
struct RowSet {
  const uint8_t* rows[2 + kHTMaxSetRows];
  const float* weights[kHTMaxSetRows];
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
#define PORTEP_SUM_CASE(k)                                        \
  case k:                                                         \
    sum_bf16_rows<k, kOutF32, kAssignFirst>(set, words, out_row); \
    return true
    PORTEP_SUM_CASE(1);
    PORTEP_SUM_CASE(2);
    PORTEP_SUM_CASE(3);
    PORTEP_SUM_CASE(4);
    PORTEP_SUM_CASE(5);
    PORTEP_SUM_CASE(6);
    PORTEP_SUM_CASE(7);
    PORTEP_SUM_CASE(8);
#undef PORTEP_SUM_CASE
    default:
      return false;
  }
}

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
  TokenPeers tp;                     // batch: the peers each warp's token has rows from, its node masks
  uint32_t base[kHTMaxPeers];        // rows of this channel from each peer reduced before this batch
  uint32_t batch[kHTMaxPeers];       // the batch's rows from each peer
  uint32_t have[kHTMaxPeers];        // rows known to be in place
  uint32_t credited[kHTMaxPeers];    // proxy peers: chunks credited back
  const uint8_t* ring[kHTMaxPeers];  // this rank's ring for each peer in this channel (null: this rank)
  int failed;
};

// Thread p waits until peer p's rows the batch needs are in place; false (block-wide) after a timeout.
PORTEP_DEVICE bool await_batch(const HTCombineArgs& a, ReduceState& st, int ch, uint64_t epoch) {
  const HTCommon& c = a.c;
  for (int p = threadIdx.x; p < ht_num_peers(c); p += blockDim.x) {
    const uint32_t need = st.base[p] + st.batch[p];
    if (peer_is_self(c, p) || need <= st.have[p]) continue;
    const int j = peer_rank(c, p);
    if (c.peers[j]) {
      const uint64_t* word = tail_word(c, c.local, true, j, ch);
      if (await_tail(c, word, epoch, need, j, ch))
        st.have[p] = uint32_t(ld_acquire_sys_u64(word));
      else
        st.failed = 1;
    } else {
      const int64_t units = await_units(c, j, ht_data_stream(c, true, ch), chunks(need));
      if (units >= 0)
        st.have[p] = uint32_t(units * kHTChunkRows);
      else
        st.failed = 1;
    }
  }
  __syncthreads();
  return !st.failed;
}

// Token t's row from peer p (ring row `index`, or this rank's own row of x) and its weights.
struct PeerRow {
  const uint8_t* row;
  const float* weights;
};
PORTEP_DEVICE PeerRow peer_row(const HTCombineArgs& a, const ReduceState& st, int p, uint32_t index, int ch) {
  const HTCommon& c = a.c;
  if (!st.ring[p]) {
    const int64_t row = rows_before(a.recv_prefix, a.recv_prefix_stride, c.rank) +
                        a.recv_channel_prefix[c.rank * c.num_channels + ch] + index;
    return {reinterpret_cast<const uint8_t*>(a.x + row * a.hidden),
            a.topk_weights ? a.topk_weights + row * a.num_topk : nullptr};
  }
  const uint8_t* row = st.ring[p] + ht_ring_slot(index, a.ring_rows, slot_bytes(a));
  const bool partial = ht_forwarding(c) && p >= c.ranks_per_node;  // other nodes' rows are FP32 partials
  return {row, reinterpret_cast<const float*>(row + ht_combine_weights(partial, a.hidden))};
}

// Warp-wide, a token with rows from more than kHTMaxSetRows peers: the same sum as reduce_rows, in the same order,
// each row's address found again per word.
PORTEP_DEVICE void reduce_token_walk(const HTCombineArgs& a, const ReduceState& st, int t, int ch, int warp) {
  const HTCommon& c = a.c;
  const int64_t base = int64_t(t) * a.hidden;
  const int L = c.ranks_per_node;
  const bool partials = ht_forwarding(c);
  for (int j = lane_id(); j < a.hidden / 8; j += kWarpSize) {
    float acc[8] = {};
    if (a.bias0) set_bf16x8(acc, reinterpret_cast<const uint4*>(a.bias0 + base)[j]);  // exactly bias0
    if (a.bias1) add_bf16x8(acc, reinterpret_cast<const uint4*>(a.bias1 + base)[j]);
    for (int p = 0; p < ht_num_peers(c); ++p) {
      if (!has_peer(st.tp, warp, p)) continue;
      const PeerRow r = peer_row(a, st, p, st.base[p] + rows_with_peer(st.tp, warp, p), ch);
      if (partials && p >= L) {
        const float4* q = reinterpret_cast<const float4*>(r.row) + 2 * j;
        const float4 lo = q[0], hi = q[1];
        acc[0] += lo.x, acc[1] += lo.y, acc[2] += lo.z, acc[3] += lo.w;
        acc[4] += hi.x, acc[5] += hi.y, acc[6] += hi.z, acc[7] += hi.w;
      } else {
        add_bf16x8(acc, reinterpret_cast<const uint4*>(r.row)[j]);
      }
    }
    store_word(reinterpret_cast<uint8_t*>(a.out + base), false, j, acc);
  }
  if (!a.out_weights) return;
  for (int k = lane_id(); k < a.num_topk; k += kWarpSize) {
    float acc = 0.0f;
    for (int p = 0; p < ht_num_peers(c); ++p) {
      if (!has_peer(st.tp, warp, p)) continue;
      const PeerRow r = peer_row(a, st, p, st.base[p] + rows_with_peer(st.tp, warp, p), ch);
      acc += r.weights ? r.weights[k] : 0.0f;
    }
    a.out_weights[int64_t(t) * a.num_topk + k] = acc;
  }
}

// Warp-wide: token t's sum of bias, its node's rows (local ranks ascending), then the other rows (other nodes'
// peers ascending: the ranks themselves without forwarding, the partials of nodes with it).
PORTEP_DEVICE void reduce_token(const HTCombineArgs& a, const ReduceState& st, int t, int ch, int warp) {
  const HTCommon& c = a.c;
  const int L = c.ranks_per_node;
  const bool partials = ht_forwarding(c);
  int rows = 0;
  for (int w = 0; w < kHTPeerWords; ++w) rows += __popc(st.tp.words[warp][w]);
  if (rows > kHTMaxSetRows) return reduce_token_walk(a, st, t, ch, warp);
  const int64_t base = int64_t(t) * a.hidden;
  RowSet set;
  set.n = set.nbias = 0;
  set.bias_assign = a.bias0 != nullptr;
  if (a.bias0) set.rows[set.n++] = reinterpret_cast<const uint8_t*>(a.bias0 + base);
  if (a.bias1) set.rows[set.n++] = reinterpret_cast<const uint8_t*>(a.bias1 + base);
  set.nbias = set.nb = set.n;
  for (int p = 0; p < ht_num_peers(c); ++p) {
    if (p == L && partials) set.nb = set.n;  // the BF16 rows end where other nodes' partials begin
    if (!has_peer(st.tp, warp, p)) continue;
    const PeerRow r = peer_row(a, st, p, st.base[p] + rows_with_peer(st.tp, warp, p), ch);  // its index among p's rows
    add_row(set, r.row, r.weights);
  }
  if (!partials) set.nb = set.n;
  reduce_rows(set, a.hidden, a.num_topk, reinterpret_cast<uint8_t*>(a.out + base), false,
              a.out_weights ? a.out_weights + int64_t(t) * a.num_topk : nullptr);
}

// The reducer of channel ch after its op failed: the channel's tokens' rows and weights poisoned (ll_common.cuh).
PORTEP_DEVICE void poison_combine_channel(const HTCombineArgs& a, int ch) {
  const int C = a.c.num_channels, t0 = channel_begin(a.num_tokens, C, ch), t1 = channel_begin(a.num_tokens, C, ch + 1);
  poison_rows(a.out, t0, t1, a.num_tokens, int64_t(a.hidden) * 2);
  if (a.out_weights) poison_rows(a.out_weights, t0, t1, a.num_tokens, 4 * int64_t(a.num_topk));
}

PORTEP_DEVICE void reduce_channel(const HTCombineArgs& a, int ch) {
  __shared__ ReduceState st;
  const HTCommon& c = a.c;
  const int C = c.num_channels, P = ht_num_peers(c), warp = threadIdx.x / kWarpSize;
  const uint64_t epoch = *c.epoch;
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    st.base[p] = st.have[p] = st.credited[p] = 0;
    st.ring[p] = peer_is_self(c, p) ? nullptr
                                    : c.local + c.recv_off +
                                          ht_ring_offset(c, c.rank, peer_rank(c, p), ch, a.ring_rows, slot_bytes(a));
  }
  if (threadIdx.x == 0) st.failed = 0;
  const int t0 = channel_begin(a.num_tokens, C, ch), t1 = channel_begin(a.num_tokens, C, ch + 1);
  for (int b = t0; b < t1; b += kHTWarps) {
    const int t = b + warp;
    __syncthreads();  // the previous batch's bookkeeping is done
    load_token_peers(c, a.is_token_in_rank, t < t1 ? t : -1, warp, st.tp);
    __syncthreads();
    for (int p = threadIdx.x; p < P; p += blockDim.x) st.batch[p] = rows_with_peer(st.tp, kHTWarps, p);
    __syncthreads();
    if (!await_batch(a, st, ch, epoch)) {
      poison_combine_channel(a, ch);
      return;
    }
    if (t < t1) reduce_token(a, st, t, ch, warp);
    __syncthreads();  // every reduce's loads returned before the slots go back
    for (int p = threadIdx.x; p < P; p += blockDim.x)
      if (st.batch[p]) {
        st.base[p] += st.batch[p];
        if (!peer_is_self(c, p)) return_rows(c, true, peer_rank(c, p), ch, epoch, st.base[p], &st.credited[p]);
      }
  }
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    const int j = peer_rank(c, p);
    if (!peer_is_self(c, p) && !c.peers[j]) consume_units(c, j, ht_data_stream(c, true, ch), chunks(st.base[p]));
  }
}

// ---- the forwarder (forwarding only) ----
struct PartialState {
  uint32_t masks[kHTWarps];         // batch: each warp's token's local ranks (from nvl_head)
  uint32_t used[kHTMaxNodeRanks];   // rows of local rank l's forward ring of this channel consumed so far
  uint32_t batch[kHTMaxNodeRanks];  // the batch's rows per local rank
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
  const int L = c.ranks_per_node, Nn = num_nodes(c), me = node_of(c, c.rank);
  const uint64_t epoch = *c.epoch;
  if (int(threadIdx.x) < L) st.used[threadIdx.x] = 0;
  if (threadIdx.x == 0) st.failed = 0;
  for (int n = 0; n < Nn; ++n)
    if (n != me && !partials_for(a, st, n, ch, epoch)) return;
  for (int n = threadIdx.x; n < Nn; n += blockDim.x)
    if (n != me)
      collect_credits(c, true, n * L + local_of(c, c.rank), ch,
                      served_rows(c, a.fwd_channel_prefix, a.fwd_rank_prefix, n, ch));
}

__global__ void __launch_bounds__(kHTThreads, 1) ht_combine_kernel(HTCombineArgs a) {
  const int per = ht_forwarding(a.c) ? 3 : 2, role = blockIdx.x % per, ch = blockIdx.x / per;
  if (failed_before(a.c)) {  // nothing moves; the outputs are poisoned
    if (role == 1) poison_combine_channel(a, ch);
    return;
  }
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
  const auto stream = static_cast<cudaStream_t>(a.c.stream);
  return int(launch_kernel<ht_combine_kernel>(blocks, kHTThreads, 0, stream, a));
}

int load_ht_combine_kernels() { return int(load_kernel(ht_combine_kernel)); }

}  // namespace portep::cuda
