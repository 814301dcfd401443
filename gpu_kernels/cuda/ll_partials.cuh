// Combine partials between direct peers (layout and meta block in ll_api.h): the source's expert indices and
// weights go to every direct peer first; each owner then returns, per token of that source, one BF16 row (a
// single selection held here) or the FP32 sum of its selections held here, in top-k order. The receive side
// (ll_combine.cu) groups each token's selections by owner rank, so its sum is the same either way.
#pragma once

#include "gpu_kernels/cuda/ll_common.cuh"

namespace portep::cuda {

struct MetaHeader {
  uint32_t ready;  // 1: the block below is written (release); the owner zeroes it when every token is done
  int32_t tokens, topk, unused;
};
static_assert(sizeof(MetaHeader) == kMetaHeaderBytes, "meta header size");

// Owner rank r sends partial sums to direct peer r (and r to us) in this call (shrink mode: r is not masked).
PORTEP_DEVICE bool partial_peer(const LLCommon& c, int r) {
  return c.meta_off != 0 && r != c.rank && c.peers[r] != nullptr && sending_to(c, r);
}

PORTEP_DEVICE int nth_partial_peer(const LLCommon& c, int n) {
  for (int r = 0; r < c.num_ranks; ++r)
    if (partial_peer(c, r) && n-- == 0) return r;
  return -1;
}

PORTEP_DEVICE uint8_t* meta_block(const LLCommon& c, uint8_t* region, int src) {
  return region + c.meta_off + uint64_t(src) * c.meta_stride;
}

// Block-wide: this rank's combine expert indices and weights into its meta block at every partial peer, then
// the blocks' ready flags (one release each, after a system fence covering every thread's stores).
PORTEP_DEVICE void write_combine_meta(const LLCombineArgs& a) {
  const LLCommon& c = a.c;
  const int n = a.num_tokens * a.num_topk;
  for (int d = 0; d < c.num_ranks; ++d) {
    if (!partial_peer(c, d)) continue;
    uint8_t* block = meta_block(c, c.peers[d], c.rank);
    int32_t* experts = reinterpret_cast<int32_t*>(block + kMetaHeaderBytes);
    float* weights = reinterpret_cast<float*>(experts + n);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const int64_t e = a.topk_idx[i];
      experts[i] = e >= 0 && e < c.num_experts ? int32_t(e) : -1;
      weights[i] = a.topk_weights[i];
    }
    if (threadIdx.x == 0) {
      reinterpret_cast<MetaHeader*>(block)->tokens = a.num_tokens;
      reinterpret_cast<MetaHeader*>(block)->topk = a.num_topk;
    }
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  fence_sys();
  for (int d = 0; d < c.num_ranks; ++d)
    if (partial_peer(c, d))
      st_release_sys_u32(&reinterpret_cast<MetaHeader*>(meta_block(c, c.peers[d], c.rank))->ready, 1u);
}

// Position of token t's nth row among the rows this rank received from src for local expert le (they are in
// token order; a token that selected the expert twice has two consecutive rows), or -1.
PORTEP_DEVICE int find_row(const LLCombineArgs& a, int le, int src, int t, int nth) {
  const LLCommon& c = a.c;
  const uint64_t lr = uint64_t(a.layout_range[le * c.num_ranks + src]);
  const int32_t* tokens = a.src_info + uint64_t(le) * c.num_ranks * c.T + uint32_t(lr >> 32);
  int lo = 0, hi = int(uint32_t(lr));
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (tokens[mid] < t)
      lo = mid + 1;
    else
      hi = mid;
  }
  lo += nth;
  return lo < int(uint32_t(lr)) && tokens[lo] == t ? lo : -1;
}

// Owner side, token t of partial peer dst: its selections held here (dst's meta, top-k order), then one BF16 row
// or their FP32 sum into dst's receive rows (ll_api.h). The block done with dst's last token clears dst's meta
// flag and sets dst's flags of every local expert.
PORTEP_DEVICE void combine_partial_token(const LLCombineArgs& a, int dst, int t) {
  __shared__ const uint4* rows[kWarpSize];
  __shared__ float weights[kWarpSize];
  __shared__ uint64_t dst_rows[kWarpSize];  // byte offsets of the selections' receive rows in dst's region
  __shared__ int found[kWarpSize];          // per k: the row's position among dst's rows of that expert, or -1
  __shared__ int selected[kWarpSize];       // per k: the expert
  __shared__ int count;
  __shared__ bool ready, last;
  const LLCommon& c = a.c;
  MetaHeader* meta = reinterpret_cast<MetaHeader*>(meta_block(c, c.local, dst));
  if (threadIdx.x == 0) {
    uint64_t v = 0, waited = 0;
    // After any failure (this call's results are void) the items stop waiting: each would wait out the timeout.
    uint32_t end = reported_error(c) ? uint32_t(kWaitCallFailed) : uint32_t(kWaitDone);
    if (end == kWaitDone)
      end = wait_until([&] { return uint64_t(ld_acquire_sys_u32(&meta->ready)); }, [](uint64_t x) { return x != 0; },
                       limits_for(c, dst), &v, &waited);
    ready = end == kWaitDone;
    if (!ready) lost_peer(c, dst, end, uint32_t(t));
  }
  __syncthreads();  // thread 0's acquire, then the barrier: the meta block is visible to the block
  const int K = meta->topk, N = meta->tokens, E_l = c.num_local_experts;
  if (threadIdx.x < kWarpSize) {
    const int k = lane_id();
    const int32_t* all = reinterpret_cast<const int32_t*>(meta + 1);
    const int e = ready && t < N && k < K ? all[uint64_t(t) * K + k] : -1;
    selected[k] = e;
    warp_sync();
    int earlier = 0;  // selections of the same expert before this one (duplicates have consecutive rows)
    for (int j = 0; j < k; ++j) earlier += selected[j] == e;
    const int le = e % E_l, i = e >= 0 && e / E_l == c.rank ? find_row(a, le, dst, t, earlier) : -1;
    found[k] = i;
    if (i >= 0) {
      const uint32_t begin = uint32_t(uint64_t(a.layout_range[le * c.num_ranks + dst]) >> 32);
      rows[k] = reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(a.x) +
                                               (uint64_t(le) * c.num_ranks * c.T + begin + i) * a.x_pitch);
      weights[k] = reinterpret_cast<const float*>(all + uint64_t(N) * K)[uint64_t(t) * K + k];
      dst_rows[k] = c.recv_off + (uint64_t(e) * c.T + i) * c.comb_pitch;
    }
    warp_sync();
    if (k == 0) {  // compact the selections held here, in top-k order
      int n = 0;
      for (int j = 0; j < K && j < kWarpSize; ++j)
        if (found[j] >= 0) {
          rows[n] = rows[j];
          weights[n] = weights[j];
          dst_rows[n++] = dst_rows[j];
        }
      count = n;
    }
  }
  __syncthreads();
  const int n = count, H = c.hidden;
  uint8_t* peer = c.peers[dst];
  if (n == 1) {
    uint4* out = reinterpret_cast<uint4*>(peer + dst_rows[0]);
    for (int j = threadIdx.x; j < H / 8; j += blockDim.x) out[j] = rows[0][j];
  } else if (n >= 2) {
    for (int j = threadIdx.x; j < H / 8; j += blockDim.x) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int k0 = 0; k0 < n; k0 += 8) {  // up to 8 rows' loads in flight
        uint4 v[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) v[q] = k0 + q < n ? rows[k0 + q][j] : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int q = 0; q < 8; ++q)
          if (k0 + q < n) accumulate_row(acc, v[q], weights[k0 + q]);
      }
      const int f = 8 * j;  // floats [0, H/2) go to the first selection's row, [H/2, H) to the second's
      uint4* out = reinterpret_cast<uint4*>(f < H / 2 ? peer + dst_rows[0] + 4 * uint64_t(f)
                                                      : peer + dst_rows[1] + 4 * uint64_t(f - H / 2));
      out[0] = make_uint4(__float_as_uint(acc[0]), __float_as_uint(acc[1]), __float_as_uint(acc[2]),
                          __float_as_uint(acc[3]));
      out[1] = make_uint4(__float_as_uint(acc[4]), __float_as_uint(acc[5]), __float_as_uint(acc[6]),
                          __float_as_uint(acc[7]));
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    fence_sys();  // after the barrier: (cumulatively) every thread's stores before the count
    last = atomic_add_relaxed_gpu_u32(&c.dest_done[dst], 1u) + 1 == uint32_t(c.T);
    if (last) {
      c.dest_done[dst] = 0;
      meta->ready = 0;  // dst writes it again only after it has seen the flags below (a later call)
    }
  }
  __syncthreads();
  if (!last) return;
  fence_sys();
  for (int le = threadIdx.x; le < c.num_local_experts; le += blockDim.x)
    st_release_sys_u32(reinterpret_cast<uint32_t*>(peer + c.flag_off) + c.rank * c.num_local_experts + le, 1u);
}

}  // namespace portep::cuda
