#include "gpu_kernels/cuda/gpu_runtime.h"
#include <stdint.h>

#include "tests/native/fifo_probe.h"
#include "gpu_kernels/fifo_device.cuh"
#include "gpu_kernels/portability.cuh"
#include "proxy/transfer_cmd.h"

namespace portep::cuda {
namespace {

constexpr int kProbeBlockThreads = 256;

__global__ void fifo_probe_kernel(const FifoView* fifos, int num_fifos, int commands_per_warp, int warps,
                                  int dst_rank_modulo, uint64_t timeout_ns, uint32_t op) {
  if (threadIdx.x % kWarpSize != 0) return;
  const int warp = int((blockIdx.x * uint64_t(blockDim.x) + threadIdx.x) / kWarpSize);
  if (warp >= warps) return;
  const FifoView f = fifos[warp % num_fifos];
  uint64_t cached_tail = 0;
  for (int i = 0; i < commands_per_warp; ++i) {
    CmdFields c;
    c.op = op;
    c.flags = 0;
    c.dst_rank = uint32_t(warp % dst_rank_modulo);
    c.size = 16;
    c.stream = uint32_t(warp);
    c.remote_off = 16ull * uint64_t(i % 1024);
    c.local_off = c.remote_off;
    TransferCmd cmd;
    if (cmd_encode(c, &cmd) != kEncodeOk) return;
    if (!fifo_device_push(f, cmd, &cached_tail, timeout_ns)) return;
  }
}

}  // namespace

int launch_fifo_probe(const FifoProbeArgs& a) {
  if (a.fifos == nullptr || a.num_fifos < 1 || a.commands_per_warp < 0 || a.warps < 0 ||
      uint32_t(a.warps) > kMaxStreams || a.dst_rank_modulo < 1 || uint32_t(a.dst_rank_modulo) > kMaxRanks) {
    return cudaErrorInvalidValue;
  }
  if (a.warps == 0 || a.commands_per_warp == 0) return cudaSuccess;
  const long long threads = (long long)a.warps * kWarpSize;
  const unsigned blocks = unsigned((threads + kProbeBlockThreads - 1) / kProbeBlockThreads);
  fifo_probe_kernel<<<blocks, kProbeBlockThreads, 0, static_cast<cudaStream_t>(a.stream)>>>(
      a.fifos, a.num_fifos, a.commands_per_warp, a.warps, a.dst_rank_modulo, a.timeout_ns,
      a.nop ? uint32_t(kOpNop) : uint32_t(kOpWrite));
  return cudaGetLastError();
}

}  // namespace portep::cuda
