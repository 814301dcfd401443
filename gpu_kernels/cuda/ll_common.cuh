// Device helpers shared by the low-latency dispatch and combine kernels (layouts in ll_api.h).
#pragma once

#include <stdint.h>

#include <algorithm>

#include "gpu_kernels/cuda/kernel_errors.cuh"
#include "gpu_kernels/cuda/ll_api.h"
#include "proxy/peer_status.h"
#include "gpu_kernels/fifo_device.cuh"
#include "gpu_kernels/portability.cuh"

namespace portep::cuda {

constexpr int kLLWarps = 16;  // warps per block
constexpr int kLLThreads = kLLWarps * kWarpSize;
// Warp 0's lanes hold a token's selections (shared arrays of kWarpSize entries, one per k) and a relay's chunk
// of experts (one per lane).
static_assert(kMetaMaxTopk <= kWarpSize, "a token's selections fit one warp's lanes");
static_assert(kChunkExperts <= kWarpSize, "a chunk's experts fit one warp's lanes");
// Grid of a launch that sends, then receives (no hook): one block per unit of work (tokens or local experts),
// at most one per SM, so that on a GPU the launch can fill every block is resident and a receiving block never
// waits for a send that cannot run. When other work holds SMs (MPS limits, long kernels on other streams) some
// blocks wait for those; a wait past the timeout is reported, not hung.
inline int send_recv_grid(int tokens, int local_experts, int num_sms) {
  return std::min(std::max(tokens, local_experts), num_sms);
}

// The call's sequence number: the host's, or the chain's (kSeqFromChain); with kSeqWriteChain thread 0 of block 0
// leaves the next call's in the other half's word (ll_api.h, "The sequence-number chain").
PORTEP_DEVICE uint32_t ll_call_seq(const LLCommon& c) {
  const uint32_t seq = (c.seq_mode & kSeqFromChain) ? c.seq_chain[c.half] : c.seq;
  if ((c.seq_mode & kSeqWriteChain) && blockIdx.x == 0 && threadIdx.x == 0)
    c.seq_chain[c.half ^ 1u] = seq == 0xFFFFFFFFu ? 1u : seq + 1u;  // lockstep.wire_seq's successor
  return seq;
}

PORTEP_DEVICE float bf16_to_f32(uint16_t v) { return __uint_as_float(uint32_t(v) << 16); }

PORTEP_DEVICE uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN kept quiet (as the host kernels)
  uint32_t bits = __float_as_uint(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

// acc[q] += w * x[q] for the 8 BF16 values of v, rounded twice and never fused (the host's arithmetic).
PORTEP_DEVICE void accumulate_row(float* acc, const uint4& v, float w) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int q = 0; q < 8; ++q)
    acc[q] = __fadd_rn(acc[q], __fmul_rn(w, bf16_to_f32(uint16_t(words[q / 2] >> (16 * (q % 2))))));
}

// acc[q] = x[q], and acc[q] += x[q] (what accumulate_row does with w = 1, without the multiply), for the 8 BF16
// values of v.
PORTEP_DEVICE void set_bf16x8(float* acc, const uint4& v) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int q = 0; q < 8; ++q) acc[q] = bf16_to_f32(uint16_t(words[q / 2] >> (16 * (q % 2))));
}
PORTEP_DEVICE void add_bf16x8(float* acc, const uint4& v) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int q = 0; q < 8; ++q) acc[q] = __fadd_rn(acc[q], bf16_to_f32(uint16_t(words[q / 2] >> (16 * (q % 2)))));
}

// Two floats as BF16 (lo in bits 0-15) as f32_to_bf16 rounds them, with the conversion instruction where there is
// one and no NaN is involved (a ninth of the instructions).
PORTEP_DEVICE uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t v;
  if (lo != lo || hi != hi || !bf16x2_rne(lo, hi, &v)) v = uint32_t(f32_to_bf16(lo)) | uint32_t(f32_to_bf16(hi)) << 16;
  return v;
}

// 8 floats as 8 BF16 values in one 16-byte word (round to nearest even).
PORTEP_DEVICE uint4 pack_bf16x8(const float* acc) {
  return make_uint4(pack_bf16x2(acc[0], acc[1]), pack_bf16x2(acc[2], acc[3]), pack_bf16x2(acc[4], acc[5]),
                    pack_bf16x2(acc[6], acc[7]));
}

PORTEP_DEVICE int lane_id() { return int(threadIdx.x) % kWarpSize; }

// Token t's selections, for the whole block: experts[k] is the expert of selection (t, k) (-1 for none and for
// entries outside [0, E), reported elsewhere) and slots[k] its rank among all selections of that expert in
// row-major (token, k) order. One block-wide pass over the earlier entries; ends with __syncthreads().
// experts and slots are shared arrays of kWarpSize entries.
PORTEP_DEVICE void token_selections(const int64_t* idx, int t, int K, int E, int* experts, uint32_t* slots) {
  if (int(threadIdx.x) < K) {
    const int64_t e = idx[uint64_t(t) * K + threadIdx.x];
    experts[threadIdx.x] = e >= 0 && e < E ? int(e) : -1;
    slots[threadIdx.x] = 0;
  }
  __syncthreads();
  const int first = t * K;
  for (int j = int(threadIdx.x); j < first + K - 1; j += int(blockDim.x)) {
    const int64_t e = idx[j];
    if (e < 0 || e >= E) continue;
    for (int k = 0; k < K; ++k)
      if (experts[k] == int(e) && j < first + k) atomicAdd(&slots[k], 1u);
  }
  __syncthreads();
}

// Rounds of kUnroll words per lane, each lane's loads of a round before its stores (to each of dsts[0, n): a word is
// loaded once however many copies it gets), while whole rounds remain.
template <int kUnroll>
PORTEP_DEVICE int warp_copy16_rounds(uint4* const* dsts, int n, const uint4* __restrict__ src, int n16, int j) {
  for (; j + (kUnroll - 1) * kWarpSize < n16; j += kUnroll * kWarpSize) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = src[j + u * kWarpSize];
    for (int d = 0; d < n; ++d) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) dsts[d][j + u * kWarpSize] = v[u];
    }
  }
  return j;
}

// Warp-cooperative copy of n16 16-byte words to each of dsts[0, n). A load-store pair per word would wait out a
// memory round trip each time, so lanes copy in rounds of 8 words, then at most one round each of 4, 2 and 1 (a 14 KB
// row: 4 round trips; a word at a time after the rounds of 8 took 7).
PORTEP_DEVICE void warp_copy16_to(uint4* const* dsts, int n, const uint4* src, int n16) {
  int j = warp_copy16_rounds<8>(dsts, n, src, n16, lane_id());
  j = warp_copy16_rounds<4>(dsts, n, src, n16, j);
  j = warp_copy16_rounds<2>(dsts, n, src, n16, j);
  warp_copy16_rounds<1>(dsts, n, src, n16, j);
}

PORTEP_DEVICE void warp_copy16(uint4* dst, const uint4* src, int n16) {
  uint4* const dsts[1] = {dst};
  warp_copy16_to(dsts, 1, src, n16);
}

// A failed call (its failure word set, kernel_errors.h: by this launch, or by an earlier kernel of the Buffer, which
// stream order makes visible) poisons every output it could not complete, so that none can pass for a result: NaN in
// float rows, -1 in counts (docs/design.md §7). A kernel launched on a failed Buffer sends nothing: its peers' waits
// end by their timeout or this rank's FAILED status, and poison theirs.
// Poison is all-ones bytes: a NaN in every output dtype alike (BF16 0xFFFF, float8_e4m3fn 0xFF, float32 0xFFFFFFFF,
// a UE8M0 exponent 0xFF).
constexpr uint32_t kPoisonWord = 0xFFFFFFFFu;
template <class Common>
PORTEP_DEVICE bool call_failed(const Common& c) {
  return reported_error(c) != 0;
}
// call_failed as the whole block sees it: read once, by thread 0 (a word that another kernel sets between two threads'
// reads must not split the block at a later barrier). Every thread of the block calls it.
PORTEP_DEVICE bool block_call_failed(const LLCommon& c) {
  __shared__ bool failed;
  __syncthreads();  // every thread took the previous answer
  if (threadIdx.x == 0) failed = call_failed(c);
  __syncthreads();
  return failed;
}
// Block-wide: n 16-byte words from dst poisoned (dst 16-byte aligned).
PORTEP_DEVICE void block_poison16(void* dst, uint64_t n) {
  uint4* d = static_cast<uint4*>(dst);
  for (uint64_t i = threadIdx.x; i < n; i += blockDim.x)
    d[i] = make_uint4(kPoisonWord, kPoisonWord, kPoisonWord, kPoisonWord);
}
// Block-wide: n 32-bit words from dst poisoned.
PORTEP_DEVICE void block_poison4(void* dst, uint64_t n) {
  uint32_t* d = static_cast<uint32_t*>(dst);
  for (uint64_t i = threadIdx.x; i < n; i += blockDim.x) d[i] = kPoisonWord;
}

// How a wait on a peer ended: done, or short of it: its timeout; a failure reported elsewhere in the call (the
// call's results are void, and every other wait would wait out its own timeout, one after another); or the peer
// watch's word for the peer (peer_status.h) says the peer will not answer, once the wait lasted kPeerGraceNs (what
// the peer sent before its status changed had that long to arrive).
enum WaitEnd : uint32_t { kWaitDone = 0, kWaitTimedOut = 1, kWaitCallFailed = 2, kWaitPeerDown = 3 };
struct WaitLimits {
  const uint32_t* failed;  // the call's failure word (kernel_errors.h), or null
  const uint32_t* status;  // the peer's status word (mapped host memory), or null
  uint64_t timeout_ns;
};
template <class Common>
PORTEP_DEVICE WaitLimits limits_for(const Common& c, int peer) {
  return WaitLimits{c.failed, c.peer_status ? c.peer_status + peer : nullptr, c.timeout_ns};
}
// The clock of one wait: check() now and then (it reads device and host memory) says whether to give up.
struct WaitClock {
  uint64_t start = globaltimer_ns();
  PORTEP_DEVICE uint32_t check(const WaitLimits& w) const {
    const uint64_t waited = globaltimer_ns() - start;
    if (waited > w.timeout_ns) return kWaitTimedOut;
    if (w.failed && *reinterpret_cast<const volatile uint32_t*>(w.failed)) return kWaitCallFailed;
    if (waited > kPeerGraceNs && w.status && *reinterpret_cast<const volatile uint32_t*>(w.status))
      return kWaitPeerDown;
    return kWaitDone;
  }
  PORTEP_DEVICE uint64_t elapsed() const { return globaltimer_ns() - start; }
};

// Waits until pred(load()); returns how it ended (WaitEnd), with the last value loaded and the nanoseconds spent.
// backoff_ns spaces the loads out (polls of host memory cross PCIe; hundreds of tight pollers slow the proxies'
// traffic).
template <class Load, class Pred>
PORTEP_DEVICE uint32_t wait_until(Load load, Pred pred, const WaitLimits& limits, uint64_t* value, uint64_t* waited_ns,
                                  uint32_t backoff_ns = 0) {
  uint64_t v = load();
  *waited_ns = 0;
  if (pred(v)) {
    *value = v;
    return kWaitDone;
  }
  WaitClock clock;
  uint32_t end = kWaitDone;
  for (uint32_t iter = 1;; ++iter) {
    if (backoff_ns) sleep_ns(backoff_ns);
    v = load();
    if (pred(v)) break;
    if ((iter & 1023) == 0 && (end = clock.check(limits)) != kWaitDone) break;
  }
  *value = v;
  *waited_ns = clock.elapsed();
  return end;
}

// Proxy peers' data travels per chunk of kChunkExperts consecutive local experts (layout in ll_api.h).
PORTEP_DEVICE int chunk_experts(const LLCommon& c, int chunk) {
  return min(kChunkExperts, c.num_local_experts - chunk * kChunkExperts);
}
PORTEP_DEVICE int num_chunks(const LLCommon& c) { return (c.num_local_experts + kChunkExperts - 1) / kChunkExperts; }

// An expert of `chunk` is ready for proxy peer `peer`: true for the call that completes the chunk, which also
// resets the count for the next call. The caller fenced (release) before; the winner fences (acquire) after.
PORTEP_DEVICE bool chunk_complete(const LLCommon& c, int peer, int chunk) {
  uint32_t* n = c.chunk_done + peer * c.max_chunks + chunk;
  if (atomic_add_relaxed_gpu_u32(n, 1u) + 1 != uint32_t(chunk_experts(c, chunk))) return false;
  *n = 0;
  return true;
}

PORTEP_DEVICE int fifo_of(const LLCommon& c, uint32_t dst, uint32_t stream) {
  const uint32_t h = dst * 0x9E3779B1u ^ stream * 0x85EBCA77u;
  return int((h ^ (h >> 15)) % uint32_t(c.num_fifos));
}

PORTEP_DEVICE bool push_cmd(const LLCommon& c, const CmdFields& f) {
  TransferCmd cmd;
  if (cmd_encode(f, &cmd) != kEncodeOk) {
    report_error(c, kErrFifoTimeout, uint32_t(c.rank), f.dst_rank, f.stream);
    return false;
  }
  const int q = fifo_of(c, f.dst_rank, f.stream);
  if (!fifo_device_push_shared_tail(c.fifos[q], cmd, c.fifo_tails + q, c.timeout_ns)) {
    report_error(c, kErrFifoTimeout, uint32_t(c.rank), f.dst_rank, f.stream);
    return false;
  }
  return true;
}

// Where the bytes of a WRITE to proxy peer dst are stored: at remote_off in dst's region when the kernels store them
// there themselves (c.place[dst]: the WRITE is then placed), else at local_off in this rank's staging area, from
// where the WRITE moves them.
PORTEP_DEVICE uint8_t* proxy_bytes_at(const LLCommon& c, int dst, uint64_t local_off, uint64_t remote_off) {
  return c.place[dst] ? c.place[dst] + remote_off : c.local + local_off;
}
PORTEP_DEVICE uint32_t write_flags(const LLCommon& c, int dst) { return c.place[dst] ? uint32_t(kFlagPlaced) : 0u; }

// Through the proxies: WRITE commands for bytes (in pieces of at most kMaxCmdBytes), on the FIFO of (dst, stream),
// so the proxy sees them in order; then push_signal ends the stream's part of this call. The caller fenced at
// system scope after storing the bytes (proxy_bytes_at). false: a push failed (reported).
PORTEP_DEVICE bool push_write(const LLCommon& c, int dst, uint32_t stream, uint64_t local_off, uint64_t remote_off,
                              uint64_t bytes) {
  for (uint64_t done = 0; done < bytes; done += kMaxCmdBytes) {
    const uint64_t n = bytes - done < kMaxCmdBytes ? bytes - done : kMaxCmdBytes;
    if (!push_cmd(c, CmdFields{kOpWrite, write_flags(c, dst), uint32_t(dst), uint32_t(n), stream, remote_off + done,
                               local_off + done}))
      return false;
  }
  return true;
}
PORTEP_DEVICE void push_signal(const LLCommon& c, int dst, uint32_t stream) {
  push_cmd(c, CmdFields{kOpSignal, kFlagFinal, uint32_t(dst), 0, stream, 0, 0});
}

// Where this rank learns that src's part of flag_index arrived: a flag of this rank's data region, stored by a
// direct peer (value + 1) or, for a proxy peer, by the receive kernel's relay (for_my_relay_chunks), so every
// wait reads device memory. A proxy peer's final signal adds to a host signal slot (bits 63..32: final signals so
// far, 31..0: units so far). Only the host writes a slot (the proxies' atomic adds): a GPU store into the same host
// word would race with them, and PCIe gives a CPU atomic no atomicity against GPU stores. So kernels keep the
// value they consumed last in device memory (`signal_seen`): a new final signal is a change of the final count,
// and its units are the difference of the low words.
PORTEP_DEVICE uint32_t* signal_flag(const LLCommon& c, int flag_index) {
  return reinterpret_cast<uint32_t*>(c.local + c.flag_off) + flag_index;
}
PORTEP_DEVICE uint64_t slot_index(const LLCommon& c, int src, int chunk) {
  return uint64_t(src) * c.num_streams + c.stream_base + uint32_t(chunk);
}
PORTEP_DEVICE bool new_final_signal(uint64_t slot, uint64_t seen) { return (slot >> 32) != (seen >> 32); }
PORTEP_DEVICE uint32_t units_since(uint64_t slot, uint64_t seen) { return uint32_t(slot) - uint32_t(seen); }

// Shrink mode (c.mask): a masked rank is neither sent to nor waited for; its part of a call counts as absent. A
// receive side may mask a rank during the call; send sides decide from the mask as the call began (send_mask), so
// that every block of a launch sends alike.
PORTEP_DEVICE bool masked(const LLCommon& c, int r) {
  return c.mask && *reinterpret_cast<const volatile uint32_t*>(c.mask + r) != 0;
}
PORTEP_DEVICE bool sending_to(const LLCommon& c, int r) { return !c.send_mask || c.send_mask[r] == 0; }

// A wait on src ended short of done (end): in shrink mode a peer that stopped answering (it timed out, left, is
// gone or failed a call) is masked for this and later calls, which then complete without it; a refusal, or any lost
// peer without shrink mode, fails the call (index: what the wait was for).
PORTEP_DEVICE void lost_peer(const LLCommon& c, int src, uint32_t end, uint32_t index) {
  if (end == kWaitCallFailed) return;  // reported already
  const uint32_t status = c.peer_status ? *reinterpret_cast<const volatile uint32_t*>(c.peer_status + src) : 0;
  if (c.mask && !(end == kWaitPeerDown && status == kPeerRefused)) {
    atomicExch(c.mask + src, 1u);
    return;
  }
  if (end == kWaitPeerDown)
    report_error(c, kErrPeerDown, uint32_t(c.rank), uint32_t(src), status);
  else
    report_error(c, kErrWaitTimeout, uint32_t(c.rank), uint32_t(src), index);
}

// Waits, without consuming it, until src's flag is set; false when the wait ended short (lost_peer: masked or
// reported). *value is the flag read last, *waited the nanoseconds spent.
PORTEP_DEVICE bool await_flag(const LLCommon& c, int src, int flag_index, uint64_t* value, uint64_t* waited) {
  const uint32_t* flag = signal_flag(c, flag_index);
  const uint32_t end = wait_until([&] { return uint64_t(ld_acquire_sys_u32(flag)); }, [](uint64_t x) { return x != 0; },
                                  limits_for(c, src), value, waited);
  if (end != kWaitDone) lost_peer(c, src, end, uint32_t(flag_index));
  return end == kWaitDone;
}

// A flag back to zero for the next call on this half: the next store to it comes from a later call.
PORTEP_DEVICE void clear_flag(const LLCommon& c, int flag_index) { *signal_flag(c, flag_index) = 0; }

// Waits for src's flag and consumes it; returns the count it carries (its value - 1; 0 for a masked source or after
// a wait that ended short).
PORTEP_DEVICE uint32_t take_flag(const LLCommon& c, int src, int flag_index, int64_t* wait_stats) {
  if (masked(c, src)) return 0;
  uint64_t v = 0, waited = 0;
  const bool ok = await_flag(c, src, flag_index, &v, &waited);
  clear_flag(c, flag_index);
  if (wait_stats) atomicAdd(reinterpret_cast<unsigned long long*>(wait_stats + src), (unsigned long long)waited);
  return ok ? uint32_t(v) - 1 : 0;
}

// Polls of host memory cross PCIe, which the proxies' own traffic shares (the kernels' FIFO commands, the copy
// engines' work): hundreds of threads polling their own slots there slowed the proxy path many times over. So one
// warp per (proxy source, chunk) polls the chunk's slot and turns its final signal into the device flags (and
// begins) a direct peer's stores would have given; every other wait reads device memory. Chunk i of all (proxy
// source, chunk) goes to warp 0 of block i % gridDim: relay(src, chunk) runs there, the other warps skip it. No
// barrier inside.
template <class Relay>
PORTEP_DEVICE void for_my_relay_chunks(const LLCommon& c, Relay relay) {
  if (threadIdx.x >= kWarpSize) return;
  int i = 0;
  for (int src = 0; src < c.num_ranks; ++src) {
    if (c.peers[src]) continue;
    for (int q = 0; q < num_chunks(c); ++q, ++i)
      if (i % int(gridDim.x) == int(blockIdx.x)) relay(src, q);
  }
}

// Warp-wide: waits for a new final signal in (src, chunk)'s slot and consumes it; returns its units (WRITE
// commands), or -1 when src is masked or the wait ended short (lost_peer).
constexpr uint32_t kRelayBackoffNs = 300;
PORTEP_DEVICE int64_t await_chunk_signal(const LLCommon& c, int src, int chunk) {
  if (masked(c, src)) return -1;
  const uint64_t i = slot_index(c, src, chunk), seen = c.signal_seen[i];
  WaitClock clock;
  const WaitLimits limits = limits_for(c, src);
  uint64_t v = 0;
  for (uint32_t iter = 1;; ++iter) {
    v = ld_acquire_sys_u64(c.host_signals + i);
    // Once the final signal is in, the slot holds still until a later call on this half: every lane ends
    // with the same value.
    if (warp_all(new_final_signal(v, seen))) break;
    sleep_ns(kRelayBackoffNs);
    if ((iter & 255) == 0) {
      const uint32_t end = uint32_t(warp_broadcast_i32(int(clock.check(limits)), 0));  // every lane alike
      if (end != kWaitDone) {
        if (lane_id() == 0) lost_peer(c, src, end, uint32_t(chunk * kChunkExperts));
        return -1;
      }
    }
  }
  warp_sync();
  if (lane_id() == 0) c.signal_seen[i] = v;
  return units_since(v, seen);
}

// Lane j < n: the sum of counts[0 .. j) (counts: shared, kChunkExperts entries).
PORTEP_DEVICE uint32_t lane_exclusive_sum(const uint32_t* counts) {
  uint32_t sum = 0;
  for (int j = 0; j < lane_id() && j < kChunkExperts; ++j) sum += counts[j];
  return sum;
}

}  // namespace portep::cuda
