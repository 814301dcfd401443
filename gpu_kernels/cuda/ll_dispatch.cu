// Low-latency dispatch: the send kernel writes one message per (token, expert) into the destination's receive
// slot (direct peers, through IPC pointers) or into the local staging area (proxy peers), and publishes each
// expert once all its messages are written; the receive kernel waits per (local expert, source), packs the
// messages expert-major and writes recv_count, src_info and layout_range. Layouts: ll_api.h.
#include "gpu_kernels/cuda/gpu_runtime.h"
#include "gpu_kernels/cuda/graph_cache.h"

#include "gpu_kernels/cuda/ll_common.cuh"

namespace portep::cuda {

namespace {

constexpr uint32_t kFp8Max = 448;
constexpr float kFp8MaxInv = 1.0f / 448.0f;  // rounded to float32 at compile time, as DeepEP's kernels hold it

// A proxy destination's chunk of experts [first, first + n) of rank dst, packed in the staging area (ll_api.h):
// hist holds this call's selections per expert (all tokens).
struct DispatchChunk {
  uint64_t staging;  // byte offset of message 0 in this rank's data region
  uint64_t remote;   // and in dst's
  uint32_t total;    // messages of the chunk's experts
  bool table;        // message 0 is the count table (false only when every slot of the chunk is taken)
  uint8_t* at;       // where message 0 is stored (proxy_bytes_at)
};
PORTEP_DEVICE DispatchChunk dispatch_chunk(const LLCommon& c, const uint32_t* hist, int dst, int chunk) {
  const int first = dst * c.num_local_experts + chunk * kChunkExperts, n = chunk_experts(c, chunk);
  uint32_t total = 0;
  for (int j = 0; j < n; ++j) total += hist[first + j];
  const uint64_t staging = c.send_off + uint64_t(first) * c.T * c.disp_bytes;
  const uint64_t remote =
      c.recv_off + (uint64_t(c.rank) * c.num_local_experts + chunk * kChunkExperts) * c.T * c.disp_bytes;
  return {staging, remote, total, total < uint32_t(n) * c.T, proxy_bytes_at(c, dst, staging, remote)};
}

// Where the message of (expert, slot) goes: a direct destination's receive slot, or its packed place in the
// staging area for a proxy destination.
PORTEP_DEVICE uint8_t* message_address(const LLCommon& c, const uint32_t* hist, int expert, int slot) {
  const int dst = expert / c.num_local_experts, le = expert % c.num_local_experts;
  if (c.peers[dst])
    return c.peers[dst] + c.recv_off + ((uint64_t(c.rank) * c.num_local_experts + le) * c.T + slot) * c.disp_bytes;
  const DispatchChunk ch = dispatch_chunk(c, hist, dst, le / kChunkExperts);
  uint32_t before = 0;
  for (int e = dst * c.num_local_experts + le / kChunkExperts * kChunkExperts; e < expert; ++e) before += hist[e];
  return ch.at + (uint64_t(ch.table) + before + uint32_t(slot)) * c.disp_bytes;
}

// Every message of proxy destination dst's chunk is staged: write the count table (when there is room) and hand
// the chunk to the proxies as one WRITE (split only past 16 MiB) and its final SIGNAL.
PORTEP_DEVICE void publish_dispatch_chunk(const LLCommon& c, const uint32_t* hist, int dst, int chunk) {
  const DispatchChunk ch = dispatch_chunk(c, hist, dst, chunk);
  const int first = dst * c.num_local_experts + chunk * kChunkExperts, n = chunk_experts(c, chunk);
  if (ch.table && ch.total) {
    *reinterpret_cast<int4*>(ch.at) = make_int4(-1, int(ch.total), 0, 0);
    for (int j = 0; j < n; ++j) reinterpret_cast<uint32_t*>(ch.at + 16)[j] = hist[first + j];
  }
  // The NIC reads the staged messages after the proxy sees the command; placed ones are in dst's memory, where dst
  // reads them after the proxies' signal: either way every store of the chunk comes first.
  fence_sys();
  const uint32_t stream = c.stream_base + uint32_t(chunk);
  if (ch.total && !push_write(c, dst, stream, ch.staging, ch.remote, uint64_t(ch.total + ch.table) * c.disp_bytes))
    return;
  push_signal(c, dst, stream);
}

// All `count` messages for expert are in place: make them visible to its owner (a proxy destination: once its
// whole chunk is). The caller fenced at GPU scope after counting them in.
PORTEP_DEVICE void publish_expert(const LLCommon& c, const uint32_t* hist, int expert, uint32_t count) {
  const int dst = expert / c.num_local_experts, le = expert % c.num_local_experts;
  if (c.peers[dst]) {
    uint32_t* flag = reinterpret_cast<uint32_t*>(c.peers[dst] + c.flag_off) + le * c.num_ranks + c.rank;
    st_release_sys_u32(flag, count + 1);
    return;
  }
  if (!chunk_complete(c, dst, le / kChunkExperts)) return;
  fence_gpu();  // every other expert of the chunk was counted in after its messages
  publish_dispatch_chunk(c, hist, dst, le / kChunkExperts);
}

// FP8: a scale group of 128 channels is 4 channels on each of kFp8GroupLanes lanes; a warp quantizes
// kFp8GroupsPerWarp groups at once (1 on CUDA, 2 on a 64-lane wavefront).
constexpr int kFp8GroupLanes = 32;
constexpr int kFp8GroupsPerWarp = kWarpSize / kFp8GroupLanes;
static_assert(kWarpSize % kFp8GroupLanes == 0, "a warp holds whole FP8 scale groups");

// Token t's payload into every non-null msgs[k] (block-cooperative). FP8: each warp quantizes whole groups of
// 128 channels (4 per lane) once and stores them K times.
PORTEP_DEVICE void write_payloads(const LLDispatchArgs& a, int t, uint8_t* const* msgs, int K) {
  const int lane = lane_id(), warp = int(threadIdx.x) / kWarpSize, H = a.c.hidden;
  if (!a.use_fp8) {
    const uint4* row = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(a.x) + uint64_t(t) * H);
    for (int i = threadIdx.x; i < H / 8; i += blockDim.x) {
      const uint4 v = row[i];
      for (int k = 0; k < K; ++k)
        if (msgs[k]) reinterpret_cast<uint4*>(msgs[k] + 16)[i] = v;
    }
    return;
  }
  const uint2* row = reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(a.x) + uint64_t(t) * H);
  const int groups = H / 128, glane = lane % kFp8GroupLanes;
  // The loop is warp-uniform (the max below takes every lane); a lane whose group lies past H takes part in the
  // max only.
  for (int g0 = warp * kFp8GroupsPerWarp; g0 < groups; g0 += kLLWarps * kFp8GroupsPerWarp) {
    const int g = g0 + lane / kFp8GroupLanes;
    const bool here = kFp8GroupsPerWarp == 1 || g < groups;  // (one group per warp: g = g0 < groups)
    const uint2 v = here ? row[g * kFp8GroupLanes + glane] : make_uint2(0, 0);
    float f[4] = {bf16_to_f32(uint16_t(v.x)), bf16_to_f32(uint16_t(v.x >> 16)), bf16_to_f32(uint16_t(v.y)),
                  bf16_to_f32(uint16_t(v.y >> 16))};
    float amax = fmaxf(fmaxf(fabsf(f[0]), fabsf(f[1])), fmaxf(fabsf(f[2]), fabsf(f[3])));
    amax = fmaxf(warp_group_max_f32<kFp8GroupLanes>(amax), 1e-4f);
    if (!here) continue;
    // DeepEP's scales (its calculate_fp8_scales): stored amax * float32(1/448), one rounding; x times 448 / amax,
    // one correctly rounded division. The host backend computes the same bits (backends/host/ll.py).
    float scale = __fmul_rn(amax, kFp8MaxInv), scale_inv;
    if (a.round_scale) {  // 2^ceil(log2(scale)) from the bits: exact, no transcendental rounding
      uint32_t bits = __float_as_uint(scale);
      if (bits & 0x7fffffu) bits = (bits & 0xff800000u) + 0x800000u;
      scale = __uint_as_float(bits);
      scale_inv = 1.0f / scale;
    } else {
      scale_inv = __fdiv_rn(float(kFp8Max), amax);
    }
    uint32_t q = 0;
    for (int j = 0; j < 4; ++j) q |= uint32_t(float_to_e4m3(__fmul_rn(f[j], scale_inv))) << (8 * j);
    for (int k = 0; k < K; ++k) {
      uint8_t* m = msgs[k];
      if (!m) continue;
      reinterpret_cast<uint32_t*>(m + 16 + g * 128)[glane] = q;
      if (glane == 0) reinterpret_cast<float*>(m + 16 + H)[g] = scale;
    }
  }
}

// One block per token: the block finds the K destinations and their slots, warp 0 writes the headers, the
// block writes the payloads, then warp 0 counts the messages in and the lane completing an expert publishes it.
// hist: shared [E], selections per expert over all tokens.
PORTEP_DEVICE void dispatch_send(const LLDispatchArgs& a, uint32_t* hist, uint32_t seq) {
  __shared__ uint8_t* msgs[kWarpSize];
  __shared__ int tok_experts[kWarpSize];
  __shared__ uint32_t tok_slots[kWarpSize];
  __shared__ int tok_dsts[kWarpSize];
  const LLCommon& c = a.c;
  const int E = c.num_experts, E_l = c.num_local_experts, K = a.num_topk, N = a.num_tokens, lane = lane_id();
  const bool warp0 = threadIdx.x < kWarpSize;
  for (int i = threadIdx.x; i < E; i += blockDim.x) hist[i] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < N * K; i += blockDim.x) {
    const int64_t e = a.topk_idx[i];
    if (e >= E || e < -1) {  // never checked on the host (that would synchronize): dropped and reported
      if (blockIdx.x == 0) report_error(c, kErrBadExpert, uint32_t(c.rank), uint32_t(i / K), uint32_t(i % K), e);
    } else if (e >= 0 && sending_to(c, int(e) / E_l)) {
      atomicAdd(&hist[e], 1u);
    }
  }
  __syncthreads();
  for (int e = int(blockIdx.x * blockDim.x + threadIdx.x); e < E; e += int(gridDim.x * blockDim.x))
    if (hist[e] == 0 && sending_to(c, e / E_l)) {  // nobody selected it: its stream ends empty
      fence_gpu();
      publish_expert(c, hist, e, 0);
    }

  for (int t = int(blockIdx.x); t < N; t += int(gridDim.x)) {
    token_selections(a.topk_idx, t, K, E, tok_experts, tok_slots);
    int my_expert = -1;
    bool valid = false;
    if (warp0) {
      my_expert = lane < K ? tok_experts[lane] : -1;
      const uint32_t slot = lane < K ? tok_slots[lane] : 0;
      if (my_expert >= 0 && slot >= uint32_t(c.T))
        report_error(c, kErrSlotOverflow, uint32_t(c.rank), uint32_t(t), uint32_t(my_expert));
      valid = my_expert >= 0 && slot < uint32_t(c.T) && sending_to(c, my_expert / E_l);
      uint8_t* m = valid ? message_address(c, hist, my_expert, int(slot)) : nullptr;
      // A direct destination gets the payload once per token, in the message of the token's first selection
      // on that rank; the token's other messages there carry only the header, whose third word is 1 + the
      // index of that message in the receiver's [R][E_l][T] area (0: the payload is in this message).
      const int dst = valid ? my_expert / c.num_local_experts : -1;
      tok_dsts[lane] = valid && c.peers[dst] ? dst : -1;
      warp_sync();
      int primary = lane;
      for (int j = 0; j < lane && tok_dsts[lane] >= 0; ++j)
        if (tok_dsts[j] == tok_dsts[lane]) {
          primary = j;
          break;
        }
      const uint32_t index =
          valid ? (uint32_t(c.rank) * c.num_local_experts + my_expert % c.num_local_experts) * c.T + slot : 0;
      const uint32_t primary_index = uint32_t(warp_broadcast_i32(int(index), primary));
      const int share = primary == lane ? 0 : int(primary_index + 1);
      if (valid) *reinterpret_cast<int4*>(m) = make_int4(t, int(hist[my_expert]), share, int(seq));
      if (lane < K) msgs[lane] = primary == lane ? m : nullptr;
    }
    __syncthreads();
    write_payloads(a, t, msgs, K);
    __syncthreads();
    if (warp0) {
      // The barrier put every thread's stores before this fence, which (cumulatively) orders them before the
      // finish count that lets some lane publish them.
      fence_sys();
      if (valid) {
        const uint32_t done = atomic_add_relaxed_gpu_u32(&c.finish[my_expert], 1u) + 1;
        if (done == hist[my_expert]) {
          c.finish[my_expert] = 0;  // every add of this call is in: ready for the next call
          fence_gpu();
          publish_expert(c, hist, my_expert, done);
        }
      }
    }
  }
}

// Message `slot` of (local expert le, source src) in this rank's receive area: a direct source's slot, or its
// place in the source's packed chunk (the relay stored where le's messages begin).
PORTEP_DEVICE const uint8_t* message_in(const LLCommon& c, int le, int src, uint32_t slot) {
  uint64_t index = (uint64_t(src) * c.num_local_experts + le) * c.T + slot;
  if (!c.peers[src])
    index = (uint64_t(src) * c.num_local_experts + le / kChunkExperts * kChunkExperts) * c.T +
            c.proxy_begin[le * c.num_ranks + src] + slot;
  return c.local + c.recv_off + index * c.disp_bytes;
}

// Warp 0: proxy source src's chunk arrived; store each expert's begin in the packed chunk and its flag (count + 1),
// lane j for local expert first + j: from the table, or T each when the chunk came full (no table).
PORTEP_DEVICE void relay_dispatch_chunk(const LLCommon& c, int src, int chunk) {
  __shared__ uint32_t counts[kChunkExperts];
  const int64_t units = await_chunk_signal(c, src, chunk);
  if (units < 0) return;
  const int first = chunk * kChunkExperts, n = chunk_experts(c, chunk), j = lane_id();
  const uint8_t* base = c.local + c.recv_off + (uint64_t(src) * c.num_local_experts + first) * c.T * c.disp_bytes;
  const bool table = units && reinterpret_cast<const volatile int32_t*>(base)[0] == -1;
  uint32_t count = 0;
  if (j < n && units) count = table ? reinterpret_cast<const volatile uint32_t*>(base + 16)[j] : uint32_t(c.T);
  if (j < kChunkExperts) counts[j] = j < n ? count : 0;
  warp_sync();
  const uint32_t begin = uint32_t(table) + lane_exclusive_sum(counts);
  warp_sync();  // counts is reused by this warp's next chunk
  if (j >= n) return;
  const int index = (first + j) * c.num_ranks + src;
  c.proxy_begin[index] = begin;
  st_release_sys_u32(signal_flag(c, index), count + 1);  // cumulative: the slot's acquire saw the bytes
}

// Local expert le of a failed call (call_failed): every row NaN (and its scales), its count -1. Its handle entries
// (src_info, layout_range) keep what arrived, so a combine given them stays inside the buffer.
PORTEP_DEVICE void poison_dispatch_expert(const LLDispatchArgs& a, int le) {
  const LLCommon& c = a.c;
  const uint64_t M = uint64_t(c.num_ranks) * c.T, row_bytes = uint64_t(c.hidden) * (a.use_fp8 ? 1 : 2);
  if (threadIdx.x == 0) a.recv_count[le] = -1;
  block_poison16(static_cast<uint8_t*>(a.recv_x) + uint64_t(le) * M * row_bytes, M * row_bytes / 16);
  if (!a.use_fp8 || !a.recv_scales) return;
  const uint64_t S = a.use_ue8m0 ? uint64_t(c.hidden) / 512 : uint64_t(c.hidden) / 128;  // words per row
  block_poison4(static_cast<uint32_t*>(a.recv_scales) + uint64_t(le) * S * M, S * M);
}

// Local expert le: wait for every source, then pack its messages. shared: [2R] (counts, begins).
PORTEP_DEVICE void dispatch_recv_expert(const LLDispatchArgs& a, int le, uint32_t* shared, uint32_t seq) {
  const LLCommon& c = a.c;
  const int R = c.num_ranks, H = c.hidden, M = R * c.T, lane = lane_id();
  uint32_t* counts = shared;
  uint32_t* begins = shared + R;
  __shared__ uint32_t total;
  for (int src = threadIdx.x; src < R; src += blockDim.x)  // proxy sources were relayed into flags
    counts[src] = take_flag(c, src, le * R + src, a.wait_stats);
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t run = 0;
    for (int src = 0; src < R; ++src) {
      begins[src] = run;
      run += counts[src];
    }
    total = run;
    a.recv_count[le] = int32_t(run);
    if (a.cumulative_stats) a.cumulative_stats[le] += int32_t(run);
  }
  __syncthreads();
  for (int src = threadIdx.x; src < R; src += blockDim.x)
    a.layout_range[le * R + src] = int64_t(uint64_t(begins[src]) << 32 | counts[src]);

  const int S = H / 128, warp = int(threadIdx.x) / kWarpSize;
  for (uint32_t i = warp; i < total; i += kLLWarps) {
    int src = 0;
    while (src + 1 < R && begins[src + 1] <= i) ++src;
    const uint8_t* msg = message_in(c, le, src, i - begins[src]);
    const int4 head = *reinterpret_cast<const int4*>(msg);
    if (lane == 0) a.src_info[uint64_t(le) * M + i] = head.x;
    if (uint32_t(head.w) != seq) {  // data of another call: the ranks are out of step
      if (lane == 0) report_error(c, kErrOutOfStep, uint32_t(c.rank), uint32_t(src), uint32_t(head.w));
      continue;
    }
    if (head.z) msg = c.local + c.recv_off + uint64_t(uint32_t(head.z) - 1) * c.disp_bytes;  // payload shared
    const uint4* payload = reinterpret_cast<const uint4*>(msg + 16);
    const uint64_t row = uint64_t(le) * M + i;
    if (!a.use_fp8) {
      warp_copy16(reinterpret_cast<uint4*>(static_cast<uint8_t*>(a.recv_x) + row * 2 * H), payload, H / 8);
      continue;
    }
    warp_copy16(reinterpret_cast<uint4*>(static_cast<uint8_t*>(a.recv_x) + row * H), payload, H / 16);
    const float* scales = reinterpret_cast<const float*>(msg + 16 + H);
    if (a.use_ue8m0) {  // exponent bytes of 4 consecutive groups per int32 (scales are powers of two)
      for (int q = lane; q < S / 4; q += kWarpSize) {
        uint32_t packed = 0;
        for (int j = 0; j < 4; ++j) packed |= ((__float_as_uint(scales[q * 4 + j]) >> 23) & 0xffu) << (8 * j);
        static_cast<int32_t*>(a.recv_scales)[(uint64_t(le) * (S / 4) + q) * M + i] = int32_t(packed);
      }
    } else {
      for (int g = lane; g < S; g += kWarpSize)
        static_cast<float*>(a.recv_scales)[(uint64_t(le) * S + g) * M + i] = scales[g];
    }
  }
  // A wait that ended short (or data of another call) failed the call: what le holds is not a result.
  if (block_call_failed(c)) poison_dispatch_expert(a, le);
}

// phases: kPhaseSend and/or kPhaseRecv; with both, every block sends, then receives. One kernel for every phase,
// chosen at run time, as DeepEP's: profilers then show one kernel named "dispatch" per call, and a hook's send and
// receive as two launches of it (DeepEP's bench_kineto relies on both). Every grid is at most one block per SM
// (the kernel needs more than half an SM's registers), so all its blocks are resident and a receiving block never
// waits for a relay (for_my_relay_chunks) that cannot run.
__global__ void __launch_bounds__(kLLThreads, 1) dispatch_kernel(LLDispatchArgs a, int phases) {
  extern __shared__ uint32_t shared[];  // send: hist [E]; receive: counts [R], begins [R]
  const uint32_t seq = ll_call_seq(a.c);
  if ((phases & kPhaseSend) && !block_call_failed(a.c)) dispatch_send(a, shared, seq);  // a failed Buffer sends nothing
  if (!(phases & kPhaseRecv)) return;
  for_my_relay_chunks(a.c, [&](int src, int chunk) { relay_dispatch_chunk(a.c, src, chunk); });
  for (int le = int(blockIdx.x); le < a.c.num_local_experts; le += int(gridDim.x)) {
    __syncthreads();  // shared memory is reused
    dispatch_recv_expert(a, le, shared, seq);
  }
}

}  // namespace

namespace {

struct DispatchLaunch {
  int blocks = 0;
  size_t smem = 0;
};

// The grid and dynamic shared memory of a dispatch launch, or the error that refuses it.
cudaError_t dispatch_launch(const LLDispatchArgs& a, int phases, DispatchLaunch* l) {
  if (a.num_topk > kMetaMaxTopk || phases < kPhaseSend || phases > (kPhaseSend | kPhaseRecv))
    return cudaErrorInvalidValue;
  const int N = std::max(a.num_tokens, 1), E_l = a.c.num_local_experts, sms = a.c.num_sms;
  l->blocks = phases == kPhaseSend   ? std::min(N, sms)
              : phases == kPhaseRecv ? std::min(E_l, sms)
                                     : send_recv_grid(N, E_l, sms);
  l->smem = size_t(a.c.num_ranks) * 8;
  if (phases & kPhaseSend) l->smem = std::max(l->smem, size_t(a.c.num_experts) * 4);
  return l->smem > 48 * 1024 ? allow_dynamic_smem(dispatch_kernel, int(l->smem)) : cudaSuccess;
}

}  // namespace

int ll_dispatch(const LLDispatchArgs& a, int phases) {
  DispatchLaunch l;
  if (cudaError_t e = dispatch_launch(a, phases, &l); e != cudaSuccess) return int(e);
  const cudaStream_t stream = static_cast<cudaStream_t>(a.c.stream);
  return int(launch_kernel<dispatch_kernel>(l.blocks, kLLThreads, l.smem, stream, a, phases));
}

int ll_dispatch_graphed(LLGraphs* graphs, const LLDispatchArgs& a) {
#if defined(__HIPCC__)
  (void)graphs;
  (void)a;
  return int(cudaErrorNotSupported);
#else
  const int phases = kPhaseSend | kPhaseRecv;
  DispatchLaunch l;
  if (cudaError_t e = dispatch_launch(a, phases, &l); e != cudaSuccess) return int(e);
  return launch_graphed(graphs->dispatch, reinterpret_cast<const void*>(dispatch_kernel), l.blocks, kLLThreads, l.smem,
                        a, phases);
#endif
}

int load_ll_dispatch_kernels() { return int(load_kernel(dispatch_kernel)); }

}  // namespace portep::cuda
