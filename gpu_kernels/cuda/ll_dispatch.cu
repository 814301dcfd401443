// Low-latency dispatch: the send kernel writes one message per (token, expert) into the destination's receive
// slot (direct peers, through IPC pointers) or into the local staging area (proxy peers), and publishes each
// expert once all its messages are written; the receive kernel waits per (local expert, source), packs the
// messages expert-major and writes recv_count, src_info and layout_range. Layouts: ll_api.h.
#include <cuda_runtime.h>

#include "ll_common.cuh"

namespace portep::cuda {

namespace {

constexpr uint32_t kFp8Max = 448;

// Where the message of (expert, slot) goes.
PORTEP_DEVICE uint8_t* message_address(const LLCommon& c, int expert, int slot) {
  const int dst = expert / c.num_local_experts, le = expert % c.num_local_experts;
  if (c.peers[dst])
    return c.peers[dst] + c.recv_off + ((uint64_t(le) * c.num_ranks + c.rank) * c.T + slot) * c.disp_bytes;
  return c.local + c.send_off + (uint64_t(expert) * c.T + slot) * c.disp_bytes;
}

// All `count` messages for expert are in place: make them visible to its owner.
PORTEP_DEVICE void publish_expert(const LLCommon& c, int expert, uint32_t count) {
  const int dst = expert / c.num_local_experts, le = expert % c.num_local_experts;
  if (c.peers[dst]) {
    uint32_t* flag = reinterpret_cast<uint32_t*>(c.peers[dst] + c.flag_off) + le * c.num_ranks + c.rank;
    st_release_sys_u32(flag, count + 1);
    return;
  }
  fence_sys();  // the copy engine reads the staged messages after the proxy sees the command
  push_stream(c, dst, c.stream_base + uint32_t(le), c.send_off + uint64_t(expert) * c.T * c.disp_bytes,
              c.recv_off + (uint64_t(le) * c.num_ranks + c.rank) * c.T * c.disp_bytes,
              uint64_t(count) * c.disp_bytes);
}

PORTEP_DEVICE uint8_t* broadcast_ptr(uint8_t* p, int lane) {
  const uint64_t v = reinterpret_cast<uint64_t>(p);
  const uint32_t lo = uint32_t(warp_broadcast_i32(int(uint32_t(v)), lane));
  const uint32_t hi = uint32_t(warp_broadcast_i32(int(uint32_t(v >> 32)), lane));
  return reinterpret_cast<uint8_t*>(uint64_t(hi) << 32 | lo);
}

// Writes token t's payload to the message of every lane k < K with a non-null dst (warp-cooperative).
PORTEP_DEVICE void write_payloads(const LLDispatchArgs& a, int t, uint8_t* dst, int K) {
  const int lane = lane_id(), H = a.c.hidden;
  if (!a.use_fp8) {
    const uint4* row = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(a.x) + uint64_t(t) * H);
    for (int k = 0; k < K; ++k) {
      uint8_t* m = broadcast_ptr(dst, k);
      if (!m) continue;
      uint4* out = reinterpret_cast<uint4*>(m + 16);
      for (int i = lane; i < H / 8; i += kWarpSize) out[i] = row[i];
    }
    return;
  }
  // FP8: one group of 128 channels per warp step, 4 channels per lane; quantized once, stored K times.
  const uint2* row = reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(a.x) + uint64_t(t) * H);
  for (int g = 0; g < H / 128; ++g) {
    const uint2 v = row[g * 32 + lane];
    float f[4] = {bf16_to_f32(uint16_t(v.x)), bf16_to_f32(uint16_t(v.x >> 16)), bf16_to_f32(uint16_t(v.y)),
                  bf16_to_f32(uint16_t(v.y >> 16))};
    float amax = fmaxf(fmaxf(fabsf(f[0]), fabsf(f[1])), fmaxf(fabsf(f[2]), fabsf(f[3])));
    amax = fmaxf(warp_max_f32(amax), 1e-4f);
    float scale = amax / float(kFp8Max), scale_inv;
    if (a.round_scale) {  // 2^ceil(log2(scale)) from the bits: exact, no transcendental rounding
      uint32_t bits = __float_as_uint(scale);
      if (bits & 0x7fffffu) bits = (bits & 0xff800000u) + 0x800000u;
      scale = __uint_as_float(bits);
      scale_inv = 1.0f / scale;
    } else {
      scale_inv = float(kFp8Max) / amax;
    }
    uint32_t q = 0;
    for (int j = 0; j < 4; ++j) q |= uint32_t(float_to_e4m3(__fmul_rn(f[j], scale_inv))) << (8 * j);
    for (int k = 0; k < K; ++k) {
      uint8_t* m = broadcast_ptr(dst, k);
      if (!m) continue;
      reinterpret_cast<uint32_t*>(m + 16 + g * 128)[lane] = q;
      if (lane == 0) reinterpret_cast<float*>(m + 16 + H)[g] = scale;
    }
  }
}

__global__ void __launch_bounds__(kLLThreads) dispatch_send_kernel(LLDispatchArgs a) {
  extern __shared__ uint32_t hist[];  // [E]: selections per expert, over all tokens
  const LLCommon& c = a.c;
  const int E = c.num_experts, K = a.num_topk, N = a.num_tokens, lane = lane_id();
  for (int i = threadIdx.x; i < E; i += blockDim.x) hist[i] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < N * K; i += blockDim.x) {
    const int64_t e = a.topk_idx[i];
    if (e >= 0) atomicAdd(&hist[e], 1u);
  }
  __syncthreads();
  const int warp = int(threadIdx.x) / kWarpSize, global_warp = int(blockIdx.x) * kLLWarps + warp;
  const int num_warps = int(gridDim.x) * kLLWarps;
  for (int e = global_warp * kWarpSize + lane; e < E; e += num_warps * kWarpSize)
    if (hist[e] == 0) publish_expert(c, e, 0);  // nobody selected it: its stream ends empty

  for (int t = global_warp; t < N; t += num_warps) {
    const int my_expert = lane < K ? int(a.topk_idx[uint64_t(t) * K + lane]) : -1;
    const int my_slot = selection_slot(a.topk_idx, t, K, my_expert);
    const bool mine = my_expert >= 0 && my_slot >= 0;
    if (mine && my_slot >= c.T) report_error(c.error, kErrSlotOverflow, uint32_t(c.rank), uint32_t(t), uint32_t(my_expert));
    const bool valid = mine && my_slot < c.T;
    uint8_t* msg = valid ? message_address(c, my_expert, my_slot) : nullptr;
    if (valid) *reinterpret_cast<int4*>(msg) = make_int4(t, int(hist[my_expert]), 0, 0);
    write_payloads(a, t, msg, K);
    // Every lane's stores are ordered before the finish count that lets some lane publish them.
    fence_sys();
    warp_sync();
    if (valid) {
      const uint32_t done = atomic_add_relaxed_gpu_u32(&c.finish[my_expert], 1u) + 1;
      if (done == hist[my_expert]) {
        c.finish[my_expert] = 0;  // every add of this call is in: ready for the next call
        fence_gpu();
        publish_expert(c, my_expert, done);
      }
    }
  }
}

__global__ void __launch_bounds__(kLLThreads) dispatch_recv_kernel(LLDispatchArgs a) {
  extern __shared__ uint32_t shared[];  // counts [R], begins [R]
  const LLCommon& c = a.c;
  const int R = c.num_ranks, le = int(blockIdx.x), H = c.hidden, M = R * c.T, lane = lane_id();
  uint32_t* counts = shared;
  uint32_t* begins = shared + R;
  __shared__ uint32_t total;
  for (int src = threadIdx.x; src < R; src += blockDim.x) {
    const uint8_t* first = c.local + c.recv_off + (uint64_t(le) * R + src) * c.T * c.disp_bytes;
    counts[src] = take_signal(c, src, le * R + src, le,
                              [&] { return uint32_t(reinterpret_cast<const volatile int32_t*>(first)[1]); },
                              a.wait_stats);
  }
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
    const uint32_t slot = i - begins[src];
    const uint8_t* msg = c.local + c.recv_off + ((uint64_t(le) * R + src) * c.T + slot) * c.disp_bytes;
    if (lane == 0) a.src_info[uint64_t(le) * M + i] = reinterpret_cast<const int32_t*>(msg)[0];
    const uint4* payload = reinterpret_cast<const uint4*>(msg + 16);
    const uint64_t row = uint64_t(le) * M + i;
    if (!a.use_fp8) {
      uint4* out = reinterpret_cast<uint4*>(static_cast<uint8_t*>(a.recv_x) + row * 2 * H);
      for (int j = lane; j < H / 8; j += kWarpSize) out[j] = payload[j];
      continue;
    }
    uint4* out = reinterpret_cast<uint4*>(static_cast<uint8_t*>(a.recv_x) + row * H);
    for (int j = lane; j < H / 16; j += kWarpSize) out[j] = payload[j];
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
}

int launch_checked() { return int(cudaGetLastError()); }

}  // namespace

int ll_dispatch_send(const LLDispatchArgs& a) {
  const int warps_needed = a.num_tokens > a.c.num_experts / kWarpSize ? a.num_tokens : a.c.num_experts / kWarpSize;
  int blocks = (warps_needed + kLLWarps - 1) / kLLWarps;
  blocks = blocks < 1 ? 1 : (blocks > a.c.num_sms ? a.c.num_sms : blocks);
  const size_t smem = size_t(a.c.num_experts) * 4;
  if (smem > 48 * 1024) {
    if (cudaError_t e = cudaFuncSetAttribute(dispatch_send_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             int(smem));
        e != cudaSuccess)
      return int(e);
  }
  dispatch_send_kernel<<<blocks, kLLThreads, smem, static_cast<cudaStream_t>(a.c.stream)>>>(a);
  return launch_checked();
}

int ll_dispatch_recv(const LLDispatchArgs& a) {
  dispatch_recv_kernel<<<a.c.num_local_experts, kLLThreads, size_t(a.c.num_ranks) * 8,
                         static_cast<cudaStream_t>(a.c.stream)>>>(a);
  return launch_checked();
}

}  // namespace portep::cuda
