// The GPU regions this process has exported, by their IPC handle: a peer rank that lives in the same process
// (ranks as threads: the one-process internode benchmark, tests) opens them by address, since CUDA's and HIP's
// IPC calls refuse a handle the calling process exported. Shared by the GPU runtimes' DeviceMemory
// implementations; a handle is found only while its region is registered, so a foreign handle never matches. As with
// IPC, the owner's free ends the region for its peers too: ranks of one process tear down together (the benchmark
// destroys every rank's Buffer in one step), and shrink mode keeps a destroyed Buffer's memory until the process exits.
#pragma once

#include <string>
#include <unordered_map>

namespace portep {

struct OwnRegion {
  void* address = nullptr;
  int device = -1;
};

// Records p (on device) under its exported handle; a later export of the same region replaces the entry.
void own_region_add(const std::string& handle, void* p, int device);
// Forgets every handle of p (before the region is freed).
void own_region_remove(void* p);
// The region exported under handle by this process, or {nullptr, -1}.
OwnRegion own_region_find(const std::string& handle);

// The regions of this process that one DeviceMemory opened by address, and how often: its close_peer_region gives
// those back here instead of closing an IPC mapping. Used by the thread that owns the DeviceMemory only.
class OwnRegionsOpened {
 public:
  void add(void* p) { ++count_[p]; }
  // True (and one opening given back) where p was opened by address; false for an IPC mapping.
  bool release(void* p) {
    auto it = count_.find(p);
    if (it == count_.end()) return false;
    if (--it->second == 0) count_.erase(it);
    return true;
  }

 private:
  std::unordered_map<void*, int> count_;
};

}  // namespace portep
