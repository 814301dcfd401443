// How fast a few SMs copy rows, the HT dispatch sender's job: each block takes a contiguous range of rows, each warp
// one row per batch, and stores every row to one or two destinations (the sender's own output and a peer's ring).
// Variants: warp copies through registers (rounds of 8 words per lane, as warp_copy16_to), with or without a block
// barrier per batch, with or without the no-L1-allocate load and store hints; and bulk copies (TMA, sm_90) through
// a per-warp shared-memory buffer, single- or double-buffered. Prints, per variant and block count, the median
// time of 20 launches and the bytes moved (read + written) per second per block.
// Build and run on a GPU machine: nvcc -O3 -arch=sm_90 -std=c++17 -o /tmp/sm_copy_rates bench/probes/sm_copy_rates.cu
// && /tmp/sm_copy_rates [row_bytes]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(call)                                                                                   \
  do {                                                                                                \
    cudaError_t e = (call);                                                                           \
    if (e != cudaSuccess) {                                                                           \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e));       \
      std::exit(1);                                                                                   \
    }                                                                                                 \
  } while (0)

constexpr int kThreads = 1024, kWarps = kThreads / 32;
constexpr int kSmemBytes = 200 * 1024;  // per block: kWarps buffers (6400 B each)
constexpr int kWarpBuf = kSmemBytes / kWarps / 16 * 16;

enum Variant { kLsuBatch, kLsuFree, kLsuHints, kTmaSingle, kTmaDouble, kNumVariants };
const char* kNames[] = {"warp copy, barrier per batch", "warp copy, no barriers", "warp copy, no-L1 hints + barriers",
                        "TMA, one buffer per warp", "TMA, two half buffers per warp"};

__device__ __forceinline__ uint4 ld_hint(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ void st_hint(uint4* p, uint4 v) {
  asm volatile("st.global.L1::no_allocate.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w) : "memory");
}

template <int U, bool kHints>
__device__ __forceinline__ int rounds(uint4* const* dst, int nd, const uint4* src, int n16, int j) {
  for (; j + (U - 1) * 32 < n16; j += U * 32) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = kHints ? ld_hint(src + j + u * 32) : src[j + u * 32];
    for (int d = 0; d < nd; ++d)
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (kHints)
          st_hint(dst[d] + j + u * 32, v[u]);
        else
          dst[d][j + u * 32] = v[u];
      }
  }
  return j;
}
template <bool kHints>
__device__ void warp_copy(uint4* const* dst, int nd, const uint4* src, int n16) {
  int j = rounds<8, kHints>(dst, nd, src, n16, threadIdx.x % 32);
  j = rounds<4, kHints>(dst, nd, src, n16, j);
  j = rounds<2, kHints>(dst, nd, src, n16, j);
  rounds<1, kHints>(dst, nd, src, n16, j);
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void tma_load(void* smem, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(smem)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
}
__device__ __forceinline__ void tma_store(void* dst, const void* smem, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_addr(smem)),
               "r"(bytes) : "memory");
}
__device__ __forceinline__ void tma_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void tma_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory"); }
__device__ __forceinline__ void tma_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// Lane 0 moves the row in pieces through the warp's buffer: load a piece, wait, store it to each destination.
// kDouble: two half buffers, the next piece's load overlaps this piece's stores.
template <bool kDouble>
__device__ void tma_copy(uint8_t* buf, uint64_t* bars, uint32_t* phase, uint8_t* const* dst, int nd,
                         const uint8_t* src, uint32_t bytes) {
  if (threadIdx.x % 32 != 0) return;
  const uint32_t piece = kDouble ? kWarpBuf / 2 / 16 * 16 : kWarpBuf;
  const int pieces = int((bytes + piece - 1) / piece);
  auto size = [&](int k) { return min(piece, bytes - uint32_t(k) * piece); };
  auto slot = [&](int k) { return kDouble ? k & 1 : 0; };
  tma_load(buf, src, size(0), &bars[0]);
  for (int k = 0; k < pieces; ++k) {
    const int s = slot(k);
    mbar_wait(&bars[s], phase[s]);
    phase[s] ^= 1;
    for (int d = 0; d < nd; ++d) tma_store(dst[d] + k * piece, buf + s * piece, size(k));
    tma_commit();
    if (k + 1 == pieces) break;
    if (kDouble)
      tma_wait_read<1>();  // every store group but piece k's is done reading: piece k - 1's buffer is free
    else
      tma_wait_read<0>();
    tma_load(buf + slot(k + 1) * piece, src + (k + 1) * piece, size(k + 1), &bars[slot(k + 1)]);
  }
  tma_wait_read<0>();
}

template <Variant V>
__global__ void __launch_bounds__(kThreads, 1) copy_rows(const uint8_t* src, uint8_t* out, uint8_t* ring,
                                                         int rows, uint32_t row_bytes, int nd) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ uint64_t bars[kWarps][2];
  __shared__ uint32_t phases[kWarps][2];
  const int warp = threadIdx.x / 32, per = (rows + gridDim.x - 1) / gridDim.x;
  const int r0 = blockIdx.x * per, r1 = min(rows, r0 + per);
  if ((V == kTmaSingle || V == kTmaDouble) && threadIdx.x % 32 == 0) {
    mbar_init(&bars[warp][0]);
    mbar_init(&bars[warp][1]);
    phases[warp][0] = phases[warp][1] = 0;
  }
  __syncthreads();
  for (int b = r0; b < r1; b += kWarps) {
    const int r = b + warp;
    if (r < r1) {
      uint8_t* dst[2] = {out + size_t(r) * row_bytes, ring + size_t(r) * row_bytes};
      const uint8_t* s = src + size_t(r) * row_bytes;
      if (V == kTmaSingle || V == kTmaDouble) {
        tma_copy<V == kTmaDouble>(smem + warp * kWarpBuf, bars[warp], phases[warp], dst, nd, s, row_bytes);
      } else {
        uint4* d16[2] = {reinterpret_cast<uint4*>(dst[0]), reinterpret_cast<uint4*>(dst[1])};
        warp_copy<V == kLsuHints>(d16, nd, reinterpret_cast<const uint4*>(s), int(row_bytes / 16));
      }
    }
    if (V != kLsuFree) {
      if ((V == kTmaSingle || V == kTmaDouble) && threadIdx.x % 32 == 0) tma_wait_all();  // before a tail publish
      __syncthreads();
    }
  }
}

template <Variant V>
float time_variant(const uint8_t* src, uint8_t* out, uint8_t* ring, int rows, uint32_t row_bytes, int nd,
                   int blocks) {
  const int smem = (V == kTmaSingle || V == kTmaDouble) ? kSmemBytes : 0;
  CHECK(cudaFuncSetAttribute(copy_rows<V>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int i = 0; i < 23; ++i) {
    CHECK(cudaEventRecord(a));
    copy_rows<V><<<blocks, kThreads, smem>>>(src, out, ring, rows, row_bytes, nd);
    CHECK(cudaGetLastError());
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float t;
    CHECK(cudaEventElapsedTime(&t, a, b));
    if (i >= 3) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

bool same(const uint8_t* x, const uint8_t* y, size_t n) {
  std::vector<uint8_t> hx(n), hy(n);
  CHECK(cudaMemcpy(hx.data(), x, n, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(hy.data(), y, n, cudaMemcpyDeviceToHost));
  return hx == hy;
}

template <Variant V>
void run(const uint8_t* src, uint8_t* out, uint8_t* ring, int rows, uint32_t row_bytes) {
  for (int nd = 1; nd <= 2; ++nd) {
    for (int blocks : {12, 24, 66}) {
      CHECK(cudaMemset(out, 0x5a, size_t(rows) * row_bytes));
      CHECK(cudaMemset(ring, 0x5a, size_t(rows) * row_bytes));
      const float ms = time_variant<V>(src, out, ring, rows, row_bytes, nd, blocks);
      const bool ok = same(src, out, size_t(rows) * row_bytes) && (nd < 2 || same(src, ring, size_t(rows) * row_bytes));
      const double bytes = double(rows) * row_bytes * (1 + nd);
      std::printf("%-36s dests %d blocks %2d: %8.1f us  %7.1f GB/s  %6.1f GB/s per block%s\n", kNames[V], nd, blocks,
                  ms * 1e3, bytes / ms / 1e6, bytes / ms / 1e6 / blocks, ok ? "" : "  OUTPUT DIFFERS");
    }
  }
}

int main(int argc, char** argv) {
  const uint32_t row_bytes = argc > 1 ? uint32_t(std::atoi(argv[1])) : 14336;
  const int rows = 4096;
  if (row_bytes % 16 || row_bytes == 0) {
    std::fprintf(stderr, "row_bytes=%u: must be a positive multiple of 16\n", row_bytes);
    return 1;
  }
  uint8_t *src, *out, *ring;
  const size_t n = size_t(rows) * row_bytes;
  CHECK(cudaMalloc(&src, n));
  CHECK(cudaMalloc(&out, n));
  CHECK(cudaMalloc(&ring, n));
  std::vector<uint8_t> h(n);
  uint32_t x = 12345;
  for (auto& v : h) v = uint8_t((x = x * 1664525u + 1013904223u) >> 24);
  CHECK(cudaMemcpy(src, h.data(), n, cudaMemcpyHostToDevice));
  std::printf("%d rows of %u bytes; bytes moved = rows x row bytes x (1 read + dests writes)\n", rows, row_bytes);
  run<kLsuBatch>(src, out, ring, rows, row_bytes);
  run<kLsuFree>(src, out, ring, rows, row_bytes);
  run<kLsuHints>(src, out, ring, rows, row_bytes);
  run<kTmaSingle>(src, out, ring, rows, row_bytes);
  run<kTmaDouble>(src, out, ring, rows, row_bytes);
  return 0;
}
