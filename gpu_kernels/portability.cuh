// Everything vendor-specific that portep device code needs. Kernels include only this header for
// memory ordering, atomics, sleeping and timing, so the same sources compile with nvcc and hipcc.
#pragma once

#include <stdint.h>

#include "gpu_kernels/fp8_e4m3.h"
#include "proxy/transfer_cmd.h"

#if defined(__HIPCC__)

#include <hip/hip_runtime.h>

#define PORTEP_DEVICE __device__ __forceinline__

namespace portep {

// CDNA wavefront; wave32 (RDNA) parts are not a target.
constexpr int kWarpSize = 64;

// Same protocol as fifo_host_push: hi relaxed, then lo release. The consumer acquires lo, so it sees hi
// and every write this thread made before the call.
PORTEP_DEVICE void st_release_sys_cmd(TransferCmd* dst, const TransferCmd& v) {
  __hip_atomic_store(&dst->hi, v.hi, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
  __hip_atomic_store(&dst->lo, v.lo, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
}

PORTEP_DEVICE uint64_t ld_acquire_sys_u64(const uint64_t* p) {
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
}

// The FIFO publish: two 8-byte stores here, so lo keeps its release (the consumer must see hi with it).
PORTEP_DEVICE void st_publish_sys_cmd(TransferCmd* dst, const TransferCmd& v) { st_release_sys_cmd(dst, v); }

PORTEP_DEVICE uint64_t atomic_add_relaxed_gpu_u64(uint64_t* p, uint64_t v) {
  return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}

PORTEP_DEVICE void atomic_or_relaxed_sys_u32(uint32_t* p, uint32_t v) {
  __hip_atomic_fetch_or(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}

// s_sleep takes an immediate; s_sleep 1 waits about 64 clocks, roughly 32 ns at 2 GHz.
PORTEP_DEVICE void sleep_ns(uint32_t ns) {
  for (uint32_t t = 0; t < ns; t += 32) __builtin_amdgcn_s_sleep(1);
}

// s_memrealtime reads the real-time counter (what HIP's wall_clock64 reads), a constant 100 MHz on CDNA2/CDNA3
// (hipDeviceAttributeWallClockRate reports 100000 kHz there); a part with another rate needs this scale changed.
PORTEP_DEVICE uint64_t globaltimer_ns() { return __builtin_amdgcn_s_memrealtime() * 10; }

PORTEP_DEVICE void st_release_sys_u32(uint32_t* p, uint32_t v) {
  __hip_atomic_store(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
}
PORTEP_DEVICE void st_relaxed_sys_u64(uint64_t* p, uint64_t v) {
  __hip_atomic_store(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
PORTEP_DEVICE uint32_t ld_acquire_sys_u32(const uint32_t* p) {
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
}
PORTEP_DEVICE void fence_sys() { __threadfence_system(); }
PORTEP_DEVICE void fence_gpu() { __threadfence(); }
PORTEP_DEVICE uint32_t atomic_add_relaxed_gpu_u32(uint32_t* p, uint32_t v) {
  return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
// Stores v if *p == expected; returns the old value.
PORTEP_DEVICE uint32_t atomic_cas_relaxed_gpu_u32(uint32_t* p, uint32_t expected, uint32_t v) {
  __hip_atomic_compare_exchange_strong(p, &expected, v, __ATOMIC_RELAXED, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
  return expected;
}
PORTEP_DEVICE void atomic_max_relaxed_gpu_u64(uint64_t* p, uint64_t v) {
  __hip_atomic_fetch_max(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
PORTEP_DEVICE float warp_max_f32(float v) {
  for (int o = kWarpSize / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor(v, o));
  return v;
}
// The max over each aligned group of kWidth lanes (a power of two dividing kWarpSize: lanes [i * kWidth,
// (i + 1) * kWidth) get their group's max); every lane of the wavefront takes part.
template <int kWidth>
PORTEP_DEVICE float warp_group_max_f32(float v) {
  static_assert(kWidth > 0 && kWidth <= kWarpSize && kWarpSize % kWidth == 0 && (kWidth & (kWidth - 1)) == 0,
                "a group is a power of two of lanes that divides the wavefront");
  for (int o = kWidth / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor(v, o));
  return v;
}
// Bit i: lane i's pred (every lane of the wavefront takes part).
PORTEP_DEVICE uint64_t warp_ballot(bool pred) { return __ballot(pred); }
PORTEP_DEVICE int warp_sum_i32(int v) {
  for (int o = kWarpSize / 2; o > 0; o /= 2) v += __shfl_xor(v, o);
  return v;
}
PORTEP_DEVICE int warp_broadcast_i32(int v, int lane) { return __shfl(v, lane); }
PORTEP_DEVICE uint32_t warp_xor_u32(uint32_t v, int lane_mask) { return __shfl_xor(v, lane_mask); }
PORTEP_DEVICE bool warp_all(bool p) { return __all(p); }
// The lanes' shared-memory stores before it are visible to the wavefront's loads after it: the lanes run in
// lockstep, so no instruction is needed, but the compiler must not move memory accesses across it.
PORTEP_DEVICE void warp_sync() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
}
// Round to nearest even, saturating to +-448 (e4m3fn has no infinity). In integer arithmetic: MI300's conversion
// instructions produce FP8 FNUZ, not e4m3fn (fp8_e4m3.h).
PORTEP_DEVICE uint8_t float_to_e4m3(float v) { return e4m3_from_float(v); }

}  // namespace portep

#else  // NVIDIA

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700
#error "portep device code needs sm_70 or newer (ld.acquire, st.release, __nanosleep)"
#endif

#include <cuda_fp8.h>

#define PORTEP_DEVICE __device__ __forceinline__

namespace portep {

constexpr int kWarpSize = 32;

// One 16-byte store, release at system scope: every write this thread made before it is visible to the
// host proxy before the command is. dst must be 16-byte aligned.
PORTEP_DEVICE void st_release_sys_cmd(TransferCmd* dst, const TransferCmd& v) {
  asm volatile("st.release.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(dst), "l"(v.lo), "l"(v.hi) : "memory");
}

// The FIFO publish: one 16-byte store (one PCIe write, seen whole by the consumer) that orders nothing before
// it: a release would first wait until every earlier write of the thread is visible system-wide, which a NOP or
// a SIGNAL after a fenced WRITE does not need. Callers whose command refers to their writes fence first.
PORTEP_DEVICE void st_publish_sys_cmd(TransferCmd* dst, const TransferCmd& v) {
  asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(dst), "l"(v.lo), "l"(v.hi) : "memory");
}

PORTEP_DEVICE uint64_t ld_acquire_sys_u64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// atomicAdd is relaxed at device scope.
PORTEP_DEVICE uint64_t atomic_add_relaxed_gpu_u64(uint64_t* p, uint64_t v) {
  static_assert(sizeof(uint64_t) == sizeof(unsigned long long), "atomicAdd works on unsigned long long");
  return atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
}

PORTEP_DEVICE void atomic_or_relaxed_sys_u32(uint32_t* p, uint32_t v) {
  atomicOr_system(reinterpret_cast<unsigned int*>(p), static_cast<unsigned int>(v));
}

PORTEP_DEVICE void sleep_ns(uint32_t ns) { __nanosleep(ns); }

// %globaltimer counts nanoseconds; it may advance in steps of up to a microsecond.
PORTEP_DEVICE uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

PORTEP_DEVICE void st_release_sys_u32(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
PORTEP_DEVICE void st_relaxed_sys_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
PORTEP_DEVICE uint32_t ld_acquire_sys_u32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
PORTEP_DEVICE void fence_sys() { __threadfence_system(); }
PORTEP_DEVICE void fence_gpu() { __threadfence(); }
PORTEP_DEVICE uint32_t atomic_add_relaxed_gpu_u32(uint32_t* p, uint32_t v) { return atomicAdd(p, v); }
// Stores v if *p == expected; returns the old value.
PORTEP_DEVICE uint32_t atomic_cas_relaxed_gpu_u32(uint32_t* p, uint32_t expected, uint32_t v) {
  return atomicCAS(p, expected, v);
}
PORTEP_DEVICE void atomic_max_relaxed_gpu_u64(uint64_t* p, uint64_t v) {
  atomicMax(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
}
PORTEP_DEVICE float warp_max_f32(float v) {
  for (int o = kWarpSize / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// The max over each aligned group of kWidth lanes (a power of two dividing kWarpSize: lanes [i * kWidth,
// (i + 1) * kWidth) get their group's max); every lane of the warp takes part.
template <int kWidth>
PORTEP_DEVICE float warp_group_max_f32(float v) {
  static_assert(kWidth > 0 && kWidth <= kWarpSize && kWarpSize % kWidth == 0 && (kWidth & (kWidth - 1)) == 0,
                "a group is a power of two of lanes that divides the warp");
  for (int o = kWidth / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Bit i: lane i's pred (every lane of the warp takes part).
PORTEP_DEVICE uint64_t warp_ballot(bool pred) { return __ballot_sync(0xffffffffu, pred); }
PORTEP_DEVICE int warp_sum_i32(int v) {
  for (int o = kWarpSize / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
PORTEP_DEVICE int warp_broadcast_i32(int v, int lane) { return __shfl_sync(0xffffffffu, v, lane); }
// Lane i gets lane (i ^ lane_mask)'s v (every lane of the warp takes part).
PORTEP_DEVICE uint32_t warp_xor_u32(uint32_t v, int lane_mask) { return __shfl_xor_sync(0xffffffffu, v, lane_mask); }
PORTEP_DEVICE bool warp_all(bool p) { return __all_sync(0xffffffffu, p); }
PORTEP_DEVICE void warp_sync() { __syncwarp(); }
// Round to nearest even, saturating to +-448 (e4m3fn has no infinity).
PORTEP_DEVICE uint8_t float_to_e4m3(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

}  // namespace portep

#endif

namespace portep {

// Two floats as two BF16 values (lo in bits 0-15), rounded to nearest even by the conversion instruction, into *v;
// false where there is none (callers then round in integer arithmetic). Its NaN is canonical: callers that keep a
// NaN's payload test for NaN first.
PORTEP_DEVICE bool bf16x2_rne(float lo, float hi, uint32_t* v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(*v) : "f"(hi), "f"(lo));
  return true;
#else
  (void)lo, (void)hi, (void)v;
  return false;
#endif
}

}  // namespace portep
