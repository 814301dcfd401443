// Test and benchmark kernels of the command channel (not part of the product): probe warps pushing commands into
// mapped FIFOs, a host drain that checks them, and a one-command round trip. Same conventions as api.h.
#pragma once

#include <stdint.h>

#include <vector>

#include "gpu_kernels/cuda/api.h"

namespace portep::cuda {

struct FifoProbeArgs {
  FifoView* fifos;  // device-accessible array of num_fifos views (device pointers inside)
  int num_fifos;
  int commands_per_warp;
  int warps;
  int dst_rank_modulo;
  uint64_t timeout_ns;
  void* stream;      // cudaStream_t; nullptr = default stream
  bool nop = false;  // push NOP commands (a real proxy acknowledges them without moving bytes)
};

// Lane 0 of each warp w pushes commands_per_warp WRITE (or NOP) commands into fifos[w % num_fifos]
// (dst_rank = w % dst_rank_modulo, stream = w, size 16, offsets 16 * (i % 1024)); a warp stops at its first
// failed push. Asynchronous: returns the launch error only.
int launch_fifo_probe(const FifoProbeArgs& a);

struct FifoProbeConfig {
  int num_fifos = 32;
  uint32_t capacity = 4096;
  int consumer_threads = 4;
  int warps = 1024;
  int commands_per_warp = 1000;
  double timeout_s = 30;
};
struct FifoProbeResult {
  double seconds = 0;  // launch until the last command was popped
  uint64_t popped = 0;
  uint64_t out_of_order = 0;
  bool producer_timeout = false;
};
// The probe kernel against `consumer_threads` host threads that pop and check (the proxies' drain loop).
int run_fifo_probe(const FifoProbeConfig& cfg, FifoProbeResult* out);
// One GPU thread pushes a command and waits for the host to pop it and publish the tail, `iterations`
// times. Per command: the GPU's globaltimer just before the publish and when it saw the tail, the host's
// CLOCK_REALTIME when it popped the command and when it had published the tail (the driver sets globaltimer
// from the host's real-time clock, so pop - publish is the one-way latency up to the clocks' offset).
struct FifoRttTimes {
  std::vector<uint64_t> publish_ns, pop_ns, release_ns, seen_ns;
  std::vector<uint64_t> host_read_ns;          // GPU clock alone: single acquire loads of the host-resident tail
  std::vector<uint64_t> host_clock_before_ns;  // per command: the host clock as the GPU read it before publishing
};
int run_fifo_rtt(int iterations, double timeout_s, FifoRttTimes* out);

}  // namespace portep::cuda
