// Pinned host memory mapped into the GPU's address space (cudaHostAllocMapped): words the kernels write and the host
// reads (the kernels' error records, the normal mode's count record) or the host writes and the kernels read (the
// peer watch's status words). Owned here and freed once, by close() or the destructor: Python holds the object and
// hands it to the bindings, never its addresses. `emulated` memory (for machines without a GPU: the binding tests)
// is plain zeroed host memory whose device address is its host address; no kernel may ever run on it.
#pragma once

#include <stdint.h>

#include <string>

namespace portep::bind {

class MappedHost {
 public:
  MappedHost(uint64_t bytes, bool emulated);
  ~MappedHost();
  MappedHost(const MappedHost&) = delete;
  MappedHost& operator=(const MappedHost&) = delete;

  void close();  // frees the memory (throws a CUDA error); later uses raise
  void zero();
  uint64_t bytes() const { return bytes_; }
  bool closed() const { return host_ == nullptr; }
  // The addresses, for a binding that needs at least `need` bytes (`what` names the argument in errors).
  void* host(uint64_t need, const char* what) const;
  void* device(uint64_t need, const char* what) const;

 private:
  void* host_ = nullptr;
  void* device_ = nullptr;
  uint64_t bytes_;
  bool emulated_;
};

}  // namespace portep::bind
