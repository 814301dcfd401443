// The NCCL device path (nccl_lsa.h) where the build found NCCL's device headers (CUDA only: RCCL's device API is
// another). Host functions come from the library the process loaded, looked up by name with the types of the headers
// (NcclApi), since portep never links NCCL.
#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>

#include "gpu_kernels/nccl/nccl_lsa.h"
#include "transport/nccl/nccl_library.h"

static_assert(NCCL_UNIQUE_ID_BYTES == portep::nccl::kUniqueIdBytes, "ncclUniqueId's size");

namespace portep::cuda {

namespace {

constexpr int kPutThreads = 512;
constexpr ncclGinSignal_t kGinSignal = 0;  // the one signal asked for (ids start at 0)
constexpr int kPutBlocks = 64;

__global__ void peer_table_kernel(ncclWindow_t win, int num_ranks, uint64_t* table) {
  for (int r = threadIdx.x; r < num_ranks; r += blockDim.x)
    table[r] = reinterpret_cast<uint64_t>(ncclGetPeerPointer(win, 0, r));
}

// 16-byte stores into the peer's window: plain stores over NVLink or P2P, made visible by the barrier that follows.
__global__ void put_kernel(ncclWindow_t win, int peer, uint64_t offset, const uint4* src, uint64_t count) {
  uint4* dst = static_cast<uint4*>(ncclGetPeerPointer(win, offset, peer));
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < count; i += uint64_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

// One thread posts the put and its signal; the flush makes the source reusable when the kernel ends.
__global__ void gin_put_kernel(ncclDevComm comm, ncclWindow_t win, int peer, uint64_t offset, uint64_t src_offset,
                               uint64_t bytes) {
  ncclGin gin(comm, 0);
  gin.put(ncclTeamWorld(comm), peer, win, offset, win, src_offset, bytes, ncclGin_SignalInc{kGinSignal});
  gin.flush(ncclCoopThread());
}

__device__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Polls the signal (NCCL 2.28's waitSignal has no timeout); *done: 1 once it reached count, 2 past timeout_ns.
__global__ void gin_wait_kernel(ncclDevComm comm, uint64_t count, uint64_t timeout_ns, int* done) {
  ncclGin gin(comm, 0);
  const uint64_t start = global_ns();
  while (gin.readSignal(kGinSignal) < count) {
    if (global_ns() - start > timeout_ns) {
      *done = 2;
      return;
    }
    __nanosleep(1000);
  }
  *done = 1;
}

__global__ void barrier_kernel(ncclDevComm comm) {
  ncclLsaBarrierSession<ncclCoopCta> bar(ncclCoopCta(), comm, ncclTeamTagLsa(), 0);
  bar.sync(ncclCoopCta(), ::cuda::memory_order_acq_rel);  // release this rank's stores, acquire its peers'
}

template <class F>
F* fn(const nccl::Library& lib, const char* name) {
  return reinterpret_cast<F*>(nccl::symbol(lib, name));
}

// The host functions used, typed as the headers declare them.
struct NcclApi {
  explicit NcclApi(const nccl::Library& lib)
      : init_rank_config(fn<decltype(ncclCommInitRankConfig)>(lib, "ncclCommInitRankConfig")),
        async_error(fn<decltype(ncclCommGetAsyncError)>(lib, "ncclCommGetAsyncError")),
        abort(fn<decltype(ncclCommAbort)>(lib, "ncclCommAbort")),
        destroy(fn<decltype(ncclCommDestroy)>(lib, "ncclCommDestroy")),
        mem_alloc(fn<decltype(ncclMemAlloc)>(lib, "ncclMemAlloc")),
        mem_free(fn<decltype(ncclMemFree)>(lib, "ncclMemFree")),
        window_register(fn<decltype(ncclCommWindowRegister)>(lib, "ncclCommWindowRegister")),
        window_deregister(fn<decltype(ncclCommWindowDeregister)>(lib, "ncclCommWindowDeregister")),
        dev_comm_create(fn<decltype(ncclDevCommCreate)>(lib, "ncclDevCommCreate")),
        dev_comm_destroy(fn<decltype(ncclDevCommDestroy)>(lib, "ncclDevCommDestroy")),
        error_string(fn<decltype(ncclGetErrorString)>(lib, "ncclGetErrorString")),
        last_error(fn<decltype(ncclGetLastError)>(lib, "ncclGetLastError")) {}
  decltype(ncclCommInitRankConfig)* init_rank_config;
  decltype(ncclCommGetAsyncError)* async_error;
  decltype(ncclCommAbort)* abort;
  decltype(ncclCommDestroy)* destroy;
  decltype(ncclMemAlloc)* mem_alloc;
  decltype(ncclMemFree)* mem_free;
  decltype(ncclCommWindowRegister)* window_register;
  decltype(ncclCommWindowDeregister)* window_deregister;
  decltype(ncclDevCommCreate)* dev_comm_create;
  decltype(ncclDevCommDestroy)* dev_comm_destroy;
  decltype(ncclGetErrorString)* error_string;
  decltype(ncclGetLastError)* last_error;
};

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("NCCL device path: ") + what + ": " + cudaGetErrorString(err));
}

// The current GPU for a scope (NCCL's calls act on it). Throws where the GPU cannot be made current, unless made
// for a destructor (quiet), which then goes on on whatever GPU is current.
class DeviceScope {
 public:
  explicit DeviceScope(int device, bool quiet = false) {
    const cudaError_t got = cudaGetDevice(&previous_);
    const cudaError_t set = got == cudaSuccess ? cudaSetDevice(device) : got;
    restore_ = got == cudaSuccess;
    if (!quiet) check_cuda(set, "making the GPU current");
  }
  ~DeviceScope() {
    if (restore_) (void)cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool restore_ = false;
};

ncclDevCommRequirements_t requirements(bool gin) {
#ifdef NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER  // mandatory from 2.29 (a size and magic lead the struct)
  ncclDevCommRequirements_t reqs = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
#else
  ncclDevCommRequirements_t reqs = {};  // 2.28: zero is "nothing asked"
#endif
  reqs.lsaBarrierCount = 1;  // barrier_kernel's one CTA
  if (gin) {
    reqs.ginContextCount = 1;
    reqs.ginSignalCount = 1;
#if NCCL_VERSION_CODE >= 22907  // the connection type replaced ginForceEnable
    reqs.ginConnectionType = NCCL_GIN_CONNECTION_FULL;
#else
    reqs.ginForceEnable = true;
#endif
  }
  return reqs;
}

class NcclLsaImpl final : public NcclLsa {
 public:
  NcclLsaImpl(const NcclLsaSetup& s, const nccl::Library& lib) : api_(lib), setup_(s) {}

  // The collective steps, after construction so that the destructor undoes whatever was made when one fails.
  void init() {
    const NcclLsaSetup& s = setup_;
    DeviceScope on(s.device);
    ncclUniqueId id;
    std::copy(s.unique_id.begin(), s.unique_id.end(), id.internal);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // every collective step below is awaited under the timeout (wait), never blocked in
    ncclComm_t comm = nullptr;
    const ncclResult_t rc = api_.init_rank_config(&comm, s.num_ranks, id, s.rank, &config);
    comm_ = comm;
    check(rc, "ncclCommInitRankConfig");
    wait("ncclCommInitRankConfig");
    check(api_.mem_alloc(&region_, s.bytes), "ncclMemAlloc");
    check_cuda(cudaMemset(region_, 0, s.bytes), "zeroing the window");
    check_cuda(cudaDeviceSynchronize(), "zeroing the window");  // before any peer can store into it
    check(api_.window_register(comm_, region_, s.bytes, &window_, NCCL_WIN_COLL_SYMMETRIC), "ncclCommWindowRegister");
    wait("ncclCommWindowRegister");
    const ncclDevCommRequirements_t reqs = requirements(s.gin);
    const char* step = s.gin ? "ncclDevCommCreate with GIN (GIN needs an RDMA NIC and NCCL's GIN support for it)"
                             : "ncclDevCommCreate";
    check(api_.dev_comm_create(comm_, &reqs, &dev_comm_), step);
    wait(step);
    if (s.gin && dev_comm_.ginContextCount < 1)
      throw std::runtime_error(std::string("NCCL device path, rank ") + std::to_string(s.rank) + ": " + step +
                               ": NCCL gave no GIN context");
    healthy_ = true;
  }

  // A communicator whose setup failed or timed out is aborted (that frees what NCCL made with it; a collective
  // teardown could wait for peers that are gone); a healthy one is taken down step by step.
  ~NcclLsaImpl() override {
    DeviceScope on(setup_.device, true);
    if (comm_ && healthy_) {
      (void)api_.dev_comm_destroy(comm_, &dev_comm_);
      (void)api_.window_deregister(comm_, window_);
    } else if (comm_ && !aborted_) {
      (void)api_.abort(comm_);
    }
    if (region_) (void)api_.mem_free(region_);
    if (comm_ && healthy_) (void)api_.destroy(comm_);
  }

  void* region() const override { return region_; }
  uint64_t bytes() const override { return setup_.bytes; }
  int num_ranks() const override { return dev_comm_.nRanks; }
  int lsa_rank() const override { return dev_comm_.lsaRank; }
  int lsa_size() const override { return dev_comm_.lsaSize; }

  void peer_table(uint64_t* table) override {
    DeviceScope on(setup_.device);
    peer_table_kernel<<<1, 128>>>(window_, dev_comm_.nRanks, table);
    check_cuda(cudaGetLastError(), "launching the peer-table kernel");
    check_cuda(cudaDeviceSynchronize(), "the peer-table kernel");
  }

  std::vector<int> lsa_peers() override {
    DeviceScope on(setup_.device);
    const size_t bytes = sizeof(uint64_t) * size_t(dev_comm_.nRanks);
    void* table = nullptr;
    check_cuda(cudaMalloc(&table, bytes), "cudaMalloc for the peer table");
    std::unique_ptr<void, cudaError_t (*)(void*)> owned(table, &cudaFree);
    peer_table(static_cast<uint64_t*>(table));
    std::vector<uint64_t> host(size_t(dev_comm_.nRanks));
    check_cuda(cudaMemcpy(host.data(), table, bytes, cudaMemcpyDeviceToHost), "reading the peer table");
    std::vector<int> peers;
    for (size_t r = 0; r < host.size(); ++r)
      if (host[r]) peers.push_back(int(r));
    return peers;
  }

  void put(int peer, uint64_t offset, const void* src, uint64_t bytes, void* stream) override {
    check_range("put", peer, offset, bytes);
    if (bytes == 0) return;
    DeviceScope on(setup_.device);
    const uint64_t count = bytes / 16;
    const int blocks = int(std::min<uint64_t>(kPutBlocks, (count + kPutThreads - 1) / kPutThreads));
    put_kernel<<<blocks, kPutThreads, 0, static_cast<cudaStream_t>(stream)>>>(window_, peer, offset,
                                                                              static_cast<const uint4*>(src), count);
    check_cuda(cudaGetLastError(), "launching the put kernel");
  }

  void gin_put(int peer, uint64_t offset, uint64_t src_offset, uint64_t bytes, void* stream) override {
    require_gin("gin_put");
    check_range("gin_put", peer, offset, bytes);
    check_range("gin_put's source", setup_.rank, src_offset, bytes);
    DeviceScope on(setup_.device);
    gin_put_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(dev_comm_, window_, peer, offset, src_offset, bytes);
    check_cuda(cudaGetLastError(), "launching the GIN put");
  }

  void gin_wait(uint64_t count, void* stream) override {
    require_gin("gin_wait");
    DeviceScope on(setup_.device);
    int* done = nullptr;
    check_cuda(cudaMalloc(&done, sizeof(int)), "cudaMalloc for the GIN wait");
    std::unique_ptr<int, cudaError_t (*)(void*)> owned(done, &cudaFree);
    check_cuda(cudaMemsetAsync(done, 0, sizeof(int), static_cast<cudaStream_t>(stream)), "the GIN wait's flag");
    gin_wait_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(dev_comm_, count, uint64_t(setup_.timeout_s * 1e9),
                                                                    done);
    check_cuda(cudaGetLastError(), "launching the GIN wait");
    int state = 0;
    check_cuda(cudaMemcpyAsync(&state, done, sizeof(int), cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(stream)),
               "reading the GIN wait's flag");
    check_cuda(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "the GIN wait");
    if (state != 1)
      throw std::runtime_error("NCCL device path, rank " + std::to_string(setup_.rank) +
                               ": gin_wait: " + std::to_string(count) + " signals did not arrive within " +
                               std::to_string(setup_.timeout_s) + " s");
  }

  void barrier(void* stream) override {
    DeviceScope on(setup_.device);
    barrier_kernel<<<1, 128, 0, static_cast<cudaStream_t>(stream)>>>(dev_comm_);
    check_cuda(cudaGetLastError(), "launching the LSA barrier");
  }

 private:
  void check_range(const char* what, int peer, uint64_t offset, uint64_t bytes) const {
    const std::string op(what);
    if (peer < 0 || peer >= dev_comm_.nRanks)
      throw std::invalid_argument(op + ": peer " + std::to_string(peer) + " is not a rank of " +
                                  std::to_string(dev_comm_.nRanks));
    if (offset % 16 || bytes % 16 || offset > setup_.bytes || bytes > setup_.bytes - offset)
      throw std::invalid_argument(op + ": offset " + std::to_string(offset) + " and bytes " + std::to_string(bytes) +
                                  " must be multiples of 16 within the window's " + std::to_string(setup_.bytes));
  }
  void require_gin(const char* what) const {
    if (!setup_.gin)
      throw std::runtime_error(std::string(what) + ": this NcclLsa was created without GIN (gin=True asks for it)");
  }
  void check(ncclResult_t rc, const char* what) {
    if (rc == ncclSuccess || rc == ncclInProgress) return;
    const char* detail = comm_ ? api_.last_error(comm_) : nullptr;
    throw std::runtime_error(std::string("NCCL device path, rank ") + std::to_string(setup_.rank) + ": " + what + ": " +
                             api_.error_string(rc) + (detail && *detail ? std::string(" (") + detail + ")" : ""));
  }
  // A nonblocking communicator's step: polled until done, failed, or past the timeout (then aborted).
  void wait(const char* what) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(setup_.timeout_s);
    for (;;) {
      ncclResult_t state = ncclSuccess;
      check(api_.async_error(comm_, &state), "ncclCommGetAsyncError");
      if (state != ncclInProgress) return check(state, what);
      if (std::chrono::steady_clock::now() > deadline) {
        (void)api_.abort(comm_);
        aborted_ = true;
        throw std::runtime_error("NCCL device path, rank " + std::to_string(setup_.rank) + ": " + what +
                                 " did not finish within " + std::to_string(setup_.timeout_s) +
                                 " s (every rank of the communicator must make the call)");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  NcclApi api_;
  NcclLsaSetup setup_;
  ncclComm_t comm_ = nullptr;
  void* region_ = nullptr;
  ncclWindow_t window_ = nullptr;
  ncclDevComm dev_comm_{};
  bool healthy_ = false, aborted_ = false;
};

}  // namespace

int nccl_device_headers_version(std::string*) { return NCCL_VERSION_CODE; }

std::string nccl_device_mismatch(int runtime) {
  if (runtime / 100 == NCCL_VERSION_CODE / 100) return "";
  return "this build's NCCL device path was compiled against NCCL " + nccl::version_text(NCCL_VERSION_CODE) +
         "'s device headers, and the library loaded is NCCL " + nccl::version_text(runtime) +
         ": the device communicator differs between releases (rebuild portep against this NCCL's headers, "
         "-Ccmake.define.PORTEP_NCCL_INCLUDE=<its include folder>)";
}

std::unique_ptr<NcclLsa> NcclLsa::create(const NcclLsaSetup& s) {
  if (s.num_ranks < 1 || s.rank < 0 || s.rank >= s.num_ranks)
    throw std::invalid_argument("rank " + std::to_string(s.rank) + " of num_ranks " + std::to_string(s.num_ranks));
  if (s.bytes == 0 || s.bytes % 16)
    throw std::invalid_argument("bytes " + std::to_string(s.bytes) + ": a positive multiple of 16 is needed");
  if (s.unique_id.size() != size_t(nccl::kUniqueIdBytes))
    throw std::invalid_argument("unique_id: " + std::to_string(s.unique_id.size()) + " bytes, " +
                                std::to_string(nccl::kUniqueIdBytes) + " needed (nccl_unique_id)");
  int gpus = 0;
  if (cudaError_t err = cudaGetDeviceCount(&gpus); err != cudaSuccess)
    throw std::runtime_error(std::string("NCCL device path: no GPU: ") + cudaGetErrorString(err));
  if (s.device < 0 || s.device >= gpus)
    throw std::invalid_argument("device " + std::to_string(s.device) + ": this process sees " + std::to_string(gpus) +
                                " GPUs");
  const nccl::Library lib = nccl::open_library(s.library_candidates);
  if (!lib.handle) throw std::runtime_error("NCCL device path: " + lib.probe.summary());
  if (std::string why = nccl_device_mismatch(lib.probe.version); !why.empty())
    throw std::runtime_error("NCCL device path: " + why + " (" + lib.probe.path + ")");
  auto lsa = std::make_unique<NcclLsaImpl>(s, lib);
  lsa->init();
  return lsa;
}

}  // namespace portep::cuda
