// NCCL's device API as a device path (LSA: load/store access to the peers NVLink or PCIe P2P reaches): a Buffer's
// bytes in an NCCL symmetric window, kernels that store into peers through the pointers NCCL's device API gives
// (ncclGetPeerPointer), and NCCL's LSA barrier between them. The alternative to the proxy path on machines whose
// peers NCCL reaches from the GPU. With `gin`, also GIN (NCCL's GPU-initiated network puts with a signal, to peers on
// any node), where NCCL has a GIN backend: it needs an RDMA NIC, and creation is refused without one.
//
// NCCL is never linked. Its host functions are looked up in the library the process loaded
// (transport/nccl/nccl_library.h); its device functions are inline in the headers the build found. The device
// communicator's layout changes between NCCL releases, so a build runs only under the major.minor release of the
// headers it was compiled against and refuses any other, naming both (nccl_device_mismatch).
// Plain C++: no CUDA or NCCL types, so any host compiler can include it.
#pragma once

#include <stdint.h>

#include <memory>
#include <string>
#include <vector>

namespace portep::cuda {

// NCCL_VERSION_CODE of the NCCL device headers this build compiled against, or 0 (then *why says why).
int nccl_device_headers_version(std::string* why);

// Empty where a library of NCCL version `runtime` (ncclGetVersion's code) can run this build's device path, else why
// not (no headers built in, or another major.minor release than the headers').
std::string nccl_device_mismatch(int runtime);

struct NcclLsaSetup {
  int rank = 0, num_ranks = 1;
  int device = 0;                               // the GPU of this rank
  uint64_t bytes = 0;                           // the window's size (a multiple of 16)
  std::string unique_id;                        // nccl::unique_id() of one rank, the same bytes on every rank
  double timeout_s = 60;                        // for each collective step (every rank must make it)
  std::vector<std::string> library_candidates;  // as nccl::probe takes them
  bool gin = false;                             // ask for one GIN context and one GIN signal too
};

// One rank's communicator, window and device communicator (with one LSA barrier). Every member throws
// std::runtime_error (invalid_argument for arguments) naming what failed; nothing leaks when create fails half way.
class NcclLsa {
 public:
  // Collective over the setup's ranks: each step waits at most setup.timeout_s, then aborts the communicator.
  static std::unique_ptr<NcclLsa> create(const NcclLsaSetup& setup);
  virtual ~NcclLsa() = default;

  virtual void* region() const = 0;  // this rank's window (device memory from ncclMemAlloc), zeroed
  virtual uint64_t bytes() const = 0;
  virtual int num_ranks() const = 0;
  virtual int lsa_rank() const = 0;  // this rank in its LSA team (the ranks it reaches by loads and stores)
  virtual int lsa_size() const = 0;
  // table[num_ranks()] (device, 8 bytes each) gets each rank's window as this rank's kernels address it, 0 where
  // NCCL gives no LSA pointer (another node). Returns when written.
  virtual void peer_table(uint64_t* table) = 0;
  // The ranks peer_table gives a pointer for (this one included), in order.
  virtual std::vector<int> lsa_peers() = 0;
  // A kernel on `stream` stores `bytes` from src (device) into peer's window from `offset`, through its LSA pointer.
  // offset and bytes: multiples of 16.
  virtual void put(int peer, uint64_t offset, const void* src, uint64_t bytes, void* stream) = 0;
  // NCCL's LSA barrier on `stream`: every store an LSA peer made before its barrier is visible after this one.
  virtual void barrier(void* stream) = 0;

  // GIN (created with setup.gin): a kernel on `stream` puts `bytes` of this rank's window from src_offset into peer's
  // window at offset, then adds 1 to peer's GIN signal, which NCCL makes visible only after the bytes.
  virtual void gin_put(int peer, uint64_t offset, uint64_t src_offset, uint64_t bytes, void* stream) = 0;
  // A kernel on `stream` waits until this rank's GIN signal reaches `count` (puts received since creation); returns
  // once it has, or throws past setup.timeout_s.
  virtual void gin_wait(uint64_t count, void* stream) = 0;
};

}  // namespace portep::cuda
