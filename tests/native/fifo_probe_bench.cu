// The GPU -> host command channel measured on its own: probe kernels push commands into mapped FIFOs while
// host consumer threads (the proxies' drain loop without a transport) pop and check them.
#include "gpu_kernels/cuda/gpu_runtime.h"
#include <time.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "tests/native/fifo_probe.h"
#include "gpu_kernels/fifo_device.cuh"
#include "gpu_kernels/portability.cuh"

namespace portep::cuda {
namespace {

// out_ns[2i] = globaltimer just before command i is published, out_ns[2i + 1] = when the GPU saw its tail;
// out_ns[2 * iterations + j] = the time of one acquire load of the (host) tail, j < kHostReads, first;
// out_ns[2 * iterations + kHostReads + i] = the host clock (a host thread keeps storing it into host_clock) as
// the GPU read it just before publishing command i: its value is older than the publish, so the pop's host time
// minus it bounds publish -> pop from above on one clock.
constexpr int kHostReads = 1000;
__global__ void fifo_rtt_kernel(FifoView f, int iterations, uint64_t* out_ns, uint64_t timeout_ns,
                                const uint64_t* host_clock) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  for (int j = 0; j < kHostReads; ++j) {
    const uint64_t t0 = globaltimer_ns();
    const uint64_t tail = ld_acquire_sys_u64(f.tail);
    uint64_t t1 = t0;
    if (tail != ~0ull) t1 = globaltimer_ns();  // a branch on the value: the clock is read after the load returns
    out_ns[2 * uint64_t(iterations) + j] = t1 - t0;
  }
  uint64_t cached_tail = 0;
  for (int i = 0; i < iterations; ++i) {
    CmdFields c{kOpNop, 0, 0, 0, 0, 16ull * uint64_t(i % 1024), 0};
    TransferCmd cmd;
    cmd_encode(c, &cmd);
    uint64_t slot = 0;
    if (!fifo_device_reserve(f, &cached_tail, timeout_ns, &slot)) return;
    // The acquire keeps the publish after this read has returned, so the host clock it got predates the publish.
    const uint64_t host_before = ld_acquire_sys_u64(host_clock);
    const uint64_t t0 = globaltimer_ns();
    fifo_device_publish(f, slot, cmd);
    out_ns[2 * uint64_t(iterations) + kHostReads + i] = host_before;
    while (ld_acquire_sys_u64(f.tail) < uint64_t(i) + 1) {
      if (globaltimer_ns() - t0 > timeout_ns) return;
    }
    out_ns[2 * i] = t0;
    out_ns[2 * i + 1] = globaltimer_ns();
  }
}

#if !defined(PORTEP_DEVICE_PASS)  // host code below; FifoConsumer exists in the host compilation pass only
struct Fifos {
  std::vector<FifoView> host, device;
  FifoView* device_array = nullptr;
  ~Fifos() {
    for (size_t i = 0; i < host.size(); ++i) free_mapped_fifo(&host[i], &device[i]);
    if (device_array) (void)cudaFree(device_array);  // a destructor cannot report it
  }
  int alloc(int n, uint32_t capacity) {
    host.resize(n);
    device.resize(n);
    for (int i = 0; i < n; ++i)
      if (int err = alloc_mapped_fifo(capacity, &host[i], &device[i])) return err;
    if (cudaError_t err = cudaMalloc(&device_array, sizeof(FifoView) * n)) return int(err);
    return int(cudaMemcpy(device_array, device.data(), sizeof(FifoView) * n, cudaMemcpyHostToDevice));
  }
};

// Each consumer thread t drains FIFOs f = t, t + threads, ...; counts commands and checks each warp's order.
void consume(Fifos& fifos, int t, int threads, uint64_t expected_total, std::atomic<uint64_t>* popped,
             std::atomic<uint64_t>* bad, std::atomic<bool>* stop) {
  std::vector<FifoConsumer> mine;
  std::vector<int> ids;
  for (size_t f = size_t(t); f < fifos.host.size(); f += size_t(threads)) {
    mine.emplace_back(fifos.host[f]);
    ids.push_back(int(f));
  }
  std::vector<uint64_t> next_seq(65536, 0);
  while (!stop->load(std::memory_order_relaxed) && popped->load(std::memory_order_relaxed) < expected_total) {
    bool any = false;
    for (auto& c : mine) {
      TransferCmd cmd;
      int n = 0;
      while (n < 64 && c.pop(&cmd)) {
        const CmdFields f = cmd_decode(cmd);
        const uint64_t want = next_seq[f.stream % 65536]++;
        if (f.op != kOpWrite || f.remote_off != 16ull * (want % 1024)) bad->fetch_add(1);
        ++n;
      }
      if (n == 0) c.flush();
      if (n) any = true;
      popped->fetch_add(uint64_t(n), std::memory_order_relaxed);
    }
    if (!any) std::this_thread::yield();
  }
  for (auto& c : mine) c.flush();
}

#endif
}  // namespace

#if !defined(PORTEP_DEVICE_PASS)
int run_fifo_probe(const FifoProbeConfig& cfg, FifoProbeResult* out) {
  Fifos fifos;
  if (int err = fifos.alloc(cfg.num_fifos, cfg.capacity)) return err;
  const uint64_t total = uint64_t(cfg.warps) * uint64_t(cfg.commands_per_warp);
  std::atomic<uint64_t> popped{0}, bad{0};
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < cfg.consumer_threads; ++t)
    threads.emplace_back(consume, std::ref(fifos), t, cfg.consumer_threads, total, &popped, &bad, &stop);
  FifoProbeArgs a{fifos.device_array,
                  cfg.num_fifos,
                  cfg.commands_per_warp,
                  cfg.warps,
                  1 << 12,
                  uint64_t(cfg.timeout_s * 1e9),
                  nullptr};
  const auto start = std::chrono::steady_clock::now();
  int err = launch_fifo_probe(a);
  if (!err) err = int(cudaDeviceSynchronize());
  const auto limit = std::chrono::duration<double>(cfg.timeout_s);
  while (!err && popped.load() < total && std::chrono::steady_clock::now() - start < limit) std::this_thread::yield();
  out->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  stop.store(true);
  for (auto& t : threads) t.join();
  out->popped = popped.load();
  out->out_of_order = bad.load();
  out->producer_timeout = false;
  for (auto& h : fifos.host) out->producer_timeout |= (__atomic_load_n(h.error_flag, __ATOMIC_ACQUIRE) != 0);
  return err;
}

uint64_t realtime_ns() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

int run_fifo_rtt(int iterations, double timeout_s, FifoRttTimes* out) {
  Fifos fifos;
  if (int err = fifos.alloc(1, 1024)) return err;
  uint64_t* dev = nullptr;
  const size_t words = size_t(3 * iterations + kHostReads);
  if (cudaError_t err = cudaMalloc(&dev, sizeof(uint64_t) * words)) return int(err);
  uint64_t *clock_host = nullptr, *clock_dev = nullptr;
  cudaError_t setup = cudaMemset(dev, 0, sizeof(uint64_t) * words);
  if (!setup) setup = cudaHostAlloc(reinterpret_cast<void**>(&clock_host), 64, cudaHostAllocMapped);
  if (!setup) setup = cudaHostGetDevicePointer(reinterpret_cast<void**>(&clock_dev), clock_host, 0);
  if (setup) {
    (void)cudaFree(dev);  // setup is the error reported
    if (clock_host) (void)cudaFreeHost(clock_host);
    return int(setup);
  }
  out->pop_ns.assign(size_t(iterations), 0);
  out->release_ns.assign(size_t(iterations), 0);
  std::atomic<bool> stop{false};
  __atomic_store_n(clock_host, realtime_ns(), __ATOMIC_RELEASE);
  std::thread clock([&] {
    while (!stop.load(std::memory_order_relaxed)) __atomic_store_n(clock_host, realtime_ns(), __ATOMIC_RELEASE);
  });
  std::thread consumer([&] {
    FifoConsumer c(fifos.host[0]);
    for (size_t popped = 0; popped < size_t(iterations) && !stop.load(std::memory_order_relaxed);) {
      TransferCmd cmd;
      if (!c.pop(&cmd)) continue;
      out->pop_ns[popped] = realtime_ns();
      c.flush();  // publish the tail at once: the kernel waits for it
      out->release_ns[popped++] = realtime_ns();
    }
  });
  fifo_rtt_kernel<<<1, 32>>>(fifos.device[0], iterations, dev, uint64_t(timeout_s * 1e9), clock_dev);
  int err = int(cudaGetLastError());
  if (!err) err = int(cudaDeviceSynchronize());
  stop.store(true);
  consumer.join();
  clock.join();
  const int freed_clock = int(cudaFreeHost(clock_host));
  std::vector<uint64_t> gpu(words, 0);
  if (!err) err = int(cudaMemcpy(gpu.data(), dev, sizeof(uint64_t) * words, cudaMemcpyDeviceToHost));
  const int freed_dev = int(cudaFree(dev));
  if (!err) err = freed_clock ? freed_clock : freed_dev;
  out->publish_ns.resize(size_t(iterations));
  out->seen_ns.resize(size_t(iterations));
  for (size_t i = 0; i < size_t(iterations); ++i) {
    out->publish_ns[i] = gpu[2 * i];
    out->seen_ns[i] = gpu[2 * i + 1];
  }
  out->host_read_ns.assign(gpu.begin() + 2 * iterations, gpu.begin() + 2 * iterations + kHostReads);
  out->host_clock_before_ns.assign(gpu.begin() + 2 * iterations + kHostReads, gpu.end());
  if (!err && iterations > 0 && out->seen_ns.back() == 0) err = int(cudaErrorTimeout);  // the kernel gave up
  return err;
}

#endif

}  // namespace portep::cuda
