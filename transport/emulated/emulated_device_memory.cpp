// DeviceMemory without a GPU, for tests on any machine: regions are shared host memory (POSIX shm, opened by
// peers by name) and each channel's "copy engine" is a worker thread that performs the copies in issue order,
// some after a seeded random delay. The shm transport's GPU path (notify only once a copy has completed, in
// issue order) then runs, and is checked, exactly as with CUDA IPC and copy engines.
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "transport/shm/shm_segment.h"
#include "transport/device_memory.h"
#include "transport/transport.h"

namespace portep {

namespace {

struct Copy {
  void* dst;
  const void* src;
  size_t bytes;
};

class CopyWorker {
 public:
  explicit CopyWorker(uint64_t seed) : rng_(seed), thread_([this] { run(); }) {}
  ~CopyWorker() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  void push(const Copy& c) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      queue_.push_back(c);
      ++issued_;
    }
    cv_.notify_one();
  }
  uint64_t issued() {
    std::lock_guard<std::mutex> lk(mu_);
    return issued_;
  }
  uint64_t completed() const { return completed_.load(std::memory_order_acquire); }

 private:
  void run() {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      cv_.wait(lk, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      const Copy c = queue_.front();
      queue_.pop_front();
      const bool delay = rng_() % 4 == 0;
      const uint32_t delay_us = uint32_t(rng_() % 40);
      lk.unlock();
      if (delay) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
      memcpy(c.dst, c.src, c.bytes);
      completed_.fetch_add(1, std::memory_order_release);  // the bytes are in place before the count says so
      lk.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Copy> queue_;
  uint64_t issued_ = 0;
  std::atomic<uint64_t> completed_{0};
  bool stop_ = false;
  std::mt19937_64 rng_;
  std::thread thread_;
};

class EmulatedDeviceMemory final : public DeviceMemory {
 public:
  EmulatedDeviceMemory(int channels, uint64_t seed, bool nic_can_register) : nic_can_register_(nic_can_register) {
    for (int c = 0; c < channels; ++c) workers_.push_back(std::make_unique<CopyWorker>(seed * 7919u + uint64_t(c)));
  }
  ~EmulatedDeviceMemory() override { synchronize(); }

  int device() const override { return -1; }

  void* alloc_region(size_t bytes) override {
    if (!nic_can_register_) return reserve_unbacked(bytes);
    own_ = ShmSegment::create("emudev", bytes);
    return own_.data();
  }
  void free_region(void* p) override {
    if (auto it = unbacked_.find(p); it != unbacked_.end()) {
      munmap(p, it->second);
      unbacked_.erase(it);
      return;
    }
    own_ = ShmSegment();
  }
  std::string export_region(void*) override { return own_.name() + "\n" + std::to_string(own_.size()); }

  void* open_peer_region(const std::string& handle) override {
    const size_t cut = handle.find('\n');
    if (cut == std::string::npos) throw TransportError("emulated device memory: malformed region handle");
    ShmSegment s = ShmSegment::open(handle.substr(0, cut), std::stoull(handle.substr(cut + 1)));
    void* p = s.data();
    peers_[p] = std::move(s);
    return p;
  }
  void close_peer_region(void* p) override { peers_.erase(p); }
  void release_names() override { own_.stop_sharing(); }

  void* map_host(void* host, size_t) override { return host; }
  void unmap_host(void*) override {}

  void copy_async(int channel, void* dst, const void* src, size_t bytes) override {
    at(channel).push(Copy{dst, src, bytes});
  }
  uint64_t record(int channel) override { return at(channel).issued(); }
  bool done(int channel, uint64_t ticket) override { return at(channel).completed() >= ticket; }

  void synchronize() override {
    for (auto& w : workers_)
      while (w->completed() < w->issued()) std::this_thread::sleep_for(std::chrono::microseconds(20));
  }

 private:
  CopyWorker& at(int channel) {
    if (channel < 0 || size_t(channel) >= workers_.size())
      throw TransportError("emulated device memory: channel " + std::to_string(channel) + " out of range");
    return *workers_[size_t(channel)];
  }

  // What a GPU pointer is to a NIC without dma-buf or peer memory: addresses with nothing the kernel can pin
  // (CUDA reserves its device addresses in the process the same way), so ibv_reg_mr fails with EFAULT.
  void* reserve_unbacked(size_t bytes) {
    void* p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
      throw TransportError("emulated device memory: mmap of " + std::to_string(bytes) + " bytes: " + strerror(errno));
    unbacked_[p] = bytes;
    return p;
  }

  bool nic_can_register_;
  ShmSegment own_;
  std::map<void*, size_t> unbacked_;
  std::map<void*, ShmSegment> peers_;
  std::vector<std::unique_ptr<CopyWorker>> workers_;
};

}  // namespace

std::unique_ptr<DeviceMemory> make_emulated_device_memory(int channels, uint64_t seed, bool nic_can_register) {
  return std::make_unique<EmulatedDeviceMemory>(channels, seed, nic_can_register);
}

}  // namespace portep
