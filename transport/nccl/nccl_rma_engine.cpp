// RmaEngine on NCCL's host one-sided API (see nccl_rma_engine.h). The NCCL types are declared here by their ABI
// (the functions are looked up with dlsym), checked against NCCL's definitions in the static_asserts below.
#include "transport/nccl/nccl_rma_engine.h"

#include <cuda_runtime.h>
#include <string.h>

#include <chrono>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>

#include "transport/cuda_ipc/cuda_util.h"
#include "transport/endpoint_text.h"
#include "transport/nccl/nccl_library.h"
#include "transport/transport.h"

namespace portep {

namespace {

using Comm = void*;    // ncclComm_t
using Window = void*;  // ncclWindow_t
struct UniqueId {
  char internal[nccl::kUniqueIdBytes];
};
struct WaitSignalDesc {  // ncclWaitSignalDesc_t
  int opCnt, peer, sigIdx, ctx;
};
static_assert(sizeof(UniqueId) == 128 && sizeof(WaitSignalDesc) == 16, "NCCL's ncclUniqueId, ncclWaitSignalDesc_t");
constexpr int kUint8 = 1;                // ncclUint8
constexpr int kWinCollSymmetric = 0x01;  // NCCL_WIN_COLL_SYMMETRIC

struct NcclApi {
  int (*get_unique_id)(UniqueId*);
  int (*comm_init_rank)(Comm*, int, UniqueId, int);
  int (*comm_abort)(Comm);
  int (*mem_alloc)(void**, size_t);
  int (*mem_free)(void*);
  int (*window_register)(Comm, void*, size_t, Window*, int);
  int (*put_signal)(const void*, size_t, int, int, Window, size_t, int, int, unsigned, Comm, cudaStream_t);
  int (*wait_signal)(int, WaitSignalDesc*, Comm, cudaStream_t);
  const char* (*error_string)(int);
  std::string library;  // "NCCL 2.29.2 at <path>"
};

template <typename F>
void find(const nccl::Library& lib, F*& f, const char* name) {
  f = reinterpret_cast<F*>(nccl::symbol(lib, name));
}

NcclApi load_api(const nccl::Library& lib) {
  NcclApi a{};
  find(lib, a.get_unique_id, "ncclGetUniqueId");
  find(lib, a.comm_init_rank, "ncclCommInitRank");
  find(lib, a.comm_abort, "ncclCommAbort");
  find(lib, a.mem_alloc, "ncclMemAlloc");
  find(lib, a.mem_free, "ncclMemFree");
  find(lib, a.window_register, "ncclCommWindowRegister");
  find(lib, a.put_signal, "ncclPutSignal");
  find(lib, a.wait_signal, "ncclWaitSignal");
  find(lib, a.error_string, "ncclGetErrorString");
  a.library = "NCCL " + lib.probe.version_text() + " at " + lib.probe.path;
  return a;
}

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw TransportError(std::string("nccl: ") + what + ": " + cudaGetErrorString(e));
}

struct DeviceGuard : CudaDeviceGuard {  // the rank's GPU for one call from any thread
  explicit DeviceGuard(int device) : CudaDeviceGuard(device, "nccl") {}
};

class NcclRmaEngine final : public RmaEngine {
 public:
  NcclRmaEngine(int rank, int num_ranks, int device, NcclApi api)
      : rank_(rank),
        num_ranks_(num_ranks),
        device_(device),
        api_(std::move(api)),
        lanes_(size_t(num_ranks)),
        sources_(size_t(num_ranks)) {
    write_value_ = reinterpret_cast<WriteValue64>(cuda_driver_entry("cuStreamWriteValue64", 12000));
    if (!write_value_) throw TransportError("nccl: the CUDA driver has no cuStreamWriteValue64");
  }

  // Every wait is for puts already made (rma_engine.h), so the streams drain; within a bound, as a peer may be gone.
  // Then the communicator goes (abort: nothing of it is owed to anyone now), then the memory the streams used.
  ~NcclRmaEngine() override {
    CudaDeviceGuard guard(device_, "nccl", true);  // a destructor must not throw
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    auto drain = [&](cudaStream_t stream) {
      while (stream && cudaStreamQuery(stream) == cudaErrorNotReady && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::microseconds(100));
    };
    for (Lane& l : lanes_) drain(l.stream);
    for (Source& s : sources_) drain(s.stream);
    if (comm_) {
      std::lock_guard<std::mutex> lock(comm_mutex());
      api_.comm_abort(comm_);
    }
    for (Lane& l : lanes_) {
      for (auto& m : l.marks) cudaEventDestroy(m.second);
      for (cudaEvent_t e : l.spare) cudaEventDestroy(e);
      if (l.stream) cudaStreamDestroy(l.stream);
    }
    for (Source& s : sources_) {
      if (s.event) cudaEventDestroy(s.event);
      if (s.stream) cudaStreamDestroy(s.stream);
      if (s.pinned) cudaFreeHost(s.pinned);
    }
    for (void* w : windows_)
      if (w) api_.mem_free(w);
  }

  void* alloc_window(RmaWindow w, size_t bytes) override {
    DeviceGuard guard(device_);
    sizes_[w] = bytes ? bytes : 64;
    check(api_.mem_alloc(&windows_[w], sizes_[w]), "ncclMemAlloc");
    check_cuda(cudaMemset(windows_[w], 0, sizes_[w]), "cudaMemset of a window");
    return windows_[w];
  }

  std::string endpoint_blob() override {  // rank 0 makes the communicator's id
    std::string out = std::to_string(sizes_[kRmaData]) + "\n" + std::to_string(sizes_[kRmaControl]) + "\n";
    if (rank_ != 0) return out + "-\n";
    UniqueId id;
    check(api_.get_unique_id(&id), "ncclGetUniqueId");
    return out + hex_encode(&id, sizeof(id)) + "\n";
  }

  void connect(const std::vector<std::string>& blobs) override {
    DeviceGuard guard(device_);
    for (int p = 0; p < num_ranks_; ++p) {
      const auto f = split_lines(blobs[p]);
      if (f.size() != 3) throw TransportError("nccl: malformed endpoint description from rank " + std::to_string(p));
      for (int w = 0; w < kNumRmaWindows; ++w)
        if (std::stoull(f[w]) != sizes_[w])
          throw TransportError("nccl: rank " + std::to_string(p) + " registers " + f[w] + " bytes in window " +
                               std::to_string(w) + " and this rank " + std::to_string(sizes_[w]) +
                               ": NCCL's symmetric windows need the same size on every rank");
    }
    const std::string id_bytes = hex_decode(split_lines(blobs[0])[2], "nccl");
    if (id_bytes.size() != sizeof(UniqueId)) throw TransportError("nccl: rank 0's communicator id is malformed");
    UniqueId id;
    memcpy(&id, id_bytes.data(), sizeof(id));
    std::lock_guard<std::mutex> lock(comm_mutex());
    check(api_.comm_init_rank(&comm_, num_ranks_, id, rank_), "ncclCommInitRank");
    for (int w = 0; w < kNumRmaWindows; ++w) {
      check(api_.window_register(comm_, windows_[w], sizes_[w], &registered_[w], kWinCollSymmetric),
            "ncclCommWindowRegister");
      // NCCL answers success without a window where the communicator has no symmetric memory (no cuMem, no P2P)
      if (!registered_[w])
        throw TransportError("nccl: ncclCommWindowRegister gave no window (" + api_.library +
                             "): this communicator has no symmetric memory (NCCL_CUMEM_ENABLE, P2P between the "
                             "GPUs), which the one-sided API needs");
    }
    for (int p = 0; p < num_ranks_; ++p) {
      check_cuda(cudaStreamCreateWithFlags(&lanes_[p].stream, cudaStreamNonBlocking), "cudaStreamCreate");
      check_cuda(cudaStreamCreateWithFlags(&sources_[p].stream, cudaStreamNonBlocking), "cudaStreamCreate");
      check_cuda(cudaEventCreateWithFlags(&sources_[p].event, cudaEventDisableTiming), "cudaEventCreate");
    }
  }

  // cuStreamWriteValue64: stream-ordered, never blocks on the stream (a copy from pageable memory could).
  void write_words(int peer, RmaWindow w, uint64_t off, const uint64_t* words, int count) override {
    DeviceGuard guard(device_);
    for (int i = 0; i < count; ++i) {
      const uint64_t address = reinterpret_cast<uint64_t>(windows_[w]) + off + 8 * uint64_t(i);
      if (int rc = write_value_(lane(peer).stream, address, words[i], 0); rc != 0)
        throw TransportError("nccl: cuStreamWriteValue64 failed with CUresult " + std::to_string(rc));
    }
  }

  void put_signal(int peer, RmaWindow w, uint64_t local_off, uint64_t remote_off, size_t bytes) override {
    DeviceGuard guard(device_);
    std::lock_guard<std::mutex> lock(comm_mutex());
    check(api_.put_signal(static_cast<char*>(windows_[w]) + local_off, bytes, kUint8, peer, registered_[w], remote_off,
                          0, 0, 0, comm_, lane(peer).stream),
          "ncclPutSignal");
  }

  uint64_t mark(int peer) override {
    DeviceGuard guard(device_);
    Lane& l = lane(peer);
    cudaEvent_t e;
    if (!l.spare.empty()) {  // a completed mark's event: no event made and destroyed per post
      e = l.spare.back();
      l.spare.pop_back();
    } else {
      check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
    }
    check_cuda(cudaEventRecord(e, l.stream), "cudaEventRecord");
    l.marks.emplace_back(++l.marked, e);
    return l.marked;
  }

  bool complete(int peer, uint64_t ticket) override {
    DeviceGuard guard(device_);
    Lane& l = lane(peer);
    while (l.completed < ticket && !l.marks.empty()) {
      const cudaError_t e = cudaEventQuery(l.marks.front().second);
      if (e == cudaErrorNotReady) break;
      check_cuda(e, "a put's completion");
      l.spare.push_back(l.marks.front().second);
      l.completed = l.marks.front().first;
      l.marks.pop_front();
    }
    return l.completed >= ticket;
  }

  void arm(int src, uint64_t total, uint64_t off, size_t bytes, void* host_dst) override {
    DeviceGuard guard(device_);
    Source& s = source(src);
    if (!s.pinned) {
      check_cuda(cudaMallocHost(&s.pinned, bytes), "cudaMallocHost");
      s.pinned_bytes = bytes;
    }
    if (bytes > s.pinned_bytes) throw TransportError("nccl: an armed copy grew past its pinned buffer");
    if (total > s.waited) {
      WaitSignalDesc d{int(total - s.waited), src, 0, 0};
      std::lock_guard<std::mutex> lock(comm_mutex());
      check(api_.wait_signal(1, &d, comm_, s.stream), "ncclWaitSignal");
      s.waited = total;
    }
    check_cuda(cudaMemcpyAsync(s.pinned, static_cast<char*>(windows_[kRmaControl]) + off, bytes, cudaMemcpyDeviceToHost,
                               s.stream),
               "cudaMemcpyAsync (inbox)");
    check_cuda(cudaEventRecord(s.event, s.stream), "cudaEventRecord");
    s.dst = host_dst;
    s.bytes = bytes;
  }

  bool ready(int src) override {
    Source& s = source(src);
    if (!s.dst) return false;
    DeviceGuard guard(device_);
    const cudaError_t e = cudaEventQuery(s.event);
    if (e == cudaErrorNotReady) return false;
    check_cuda(e, "a receive's copy");
    memcpy(s.dst, s.pinned, s.bytes);
    s.dst = nullptr;
    return true;
  }

  std::string describe_peer(int peer) const override {
    return "rank " + std::to_string(peer) + " (over " + api_.library + ")";
  }
  void* data_device_address() const override { return windows_[kRmaData]; }

 private:
  struct Lane {
    cudaStream_t stream = nullptr;
    std::deque<std::pair<uint64_t, cudaEvent_t>> marks;  // recorded, not yet seen complete
    std::vector<cudaEvent_t> spare;                      // seen complete, reused by the next mark
    uint64_t marked = 0, completed = 0;
  };
  struct Source {
    cudaStream_t stream = nullptr;
    cudaEvent_t event = nullptr;
    void* pinned = nullptr;
    size_t pinned_bytes = 0, bytes = 0;
    void* dst = nullptr;  // set while armed
    uint64_t waited = 0;  // signals the stream has been told to wait for, in all
  };

  void check(int rc, const char* what) const {
    if (rc != 0)
      throw TransportError(std::string("nccl: ") + what + " (" + api_.library + "): " + api_.error_string(rc));
  }
  Lane& lane(int peer) {
    if (peer < 0 || peer >= num_ranks_ || !lanes_[peer].stream)
      throw TransportError("nccl: lane to rank " + std::to_string(peer) + " of " + std::to_string(num_ranks_) +
                           " (before connect, or no such rank)");
    return lanes_[peer];
  }
  Source& source(int src) {
    if (src < 0 || src >= num_ranks_ || !sources_[src].stream)
      throw TransportError("nccl: source rank " + std::to_string(src) + " of " + std::to_string(num_ranks_) +
                           " (before connect, or no such rank)");
    return sources_[src];
  }

  using WriteValue64 = int (*)(cudaStream_t, uint64_t, uint64_t, unsigned);  // cuStreamWriteValue64

  // NCCL: operations on communicators of one device must not be issued by two threads at once; one lock for every
  // engine of the process (an application's own NCCL calls on other threads are its to keep apart).
  static std::mutex& comm_mutex() {
    static std::mutex mu;
    return mu;
  }

  int rank_, num_ranks_, device_;
  NcclApi api_;
  WriteValue64 write_value_ = nullptr;
  Comm comm_ = nullptr;
  void* windows_[kNumRmaWindows] = {};
  size_t sizes_[kNumRmaWindows] = {};
  Window registered_[kNumRmaWindows] = {};
  std::vector<Lane> lanes_;
  std::vector<Source> sources_;
};

}  // namespace

bool nccl_rma_built() { return true; }

std::unique_ptr<RmaEngine> make_nccl_rma_engine(int rank, int num_ranks, int device,
                                                const std::vector<std::string>& library_candidates, std::string* why) {
  if (device < 0) {
    *why = "NCCL's one-sided API moves GPU memory, and this Buffer or Channel is on the host (device=" +
           std::to_string(device) + "); nccl-emulated runs the transport's protocol over host memory";
    return nullptr;
  }
  const nccl::Library lib = nccl::open_library(library_candidates);
  if (!lib.probe.host_rma()) {
    *why = lib.probe.summary();
    return nullptr;
  }
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess || device >= count) {
    *why = "no GPU " + std::to_string(device) + " here (" +
           (e != cudaSuccess ? std::string(cudaGetErrorString(e)) : std::to_string(count) + " GPUs") + ")";
    return nullptr;
  }
  try {
    return std::make_unique<NcclRmaEngine>(rank, num_ranks, device, load_api(lib));
  } catch (const std::exception& e) {
    *why = e.what();
    return nullptr;
  }
}

}  // namespace portep
