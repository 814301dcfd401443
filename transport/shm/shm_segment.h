// A POSIX shared-memory object mapped into this process. The creator unlinks its name as soon as every
// peer has mapped it (unlink_name), so nothing stays in /dev/shm even if a process is killed afterwards.
#pragma once

#include <stddef.h>

#include <string>

namespace portep {

class ShmSegment {
 public:
  ShmSegment() = default;
  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ShmSegment(ShmSegment&& o) noexcept;
  ShmSegment& operator=(ShmSegment&& o) noexcept;

  // Creates a new zero-filled object with a unique name derived from tag.
  static ShmSegment create(const std::string& tag, size_t bytes);
  // Maps an existing object created by another process.
  static ShmSegment open(const std::string& name, size_t bytes);

  void unlink_name();  // idempotent; ignores "already gone"
  void* data() const { return addr_; }
  size_t size() const { return bytes_; }
  const std::string& name() const { return name_; }

 private:
  void release();
  void* addr_ = nullptr;
  size_t bytes_ = 0;
  std::string name_;
  bool owner_ = false;
  bool linked_ = false;
};

// Best-effort removal of a name another process created (used when that process may have died).
void shm_unlink_quiet(const std::string& name);

// Removes the names of portep segments ("portep.<pid>.*" in /dev/shm, owned by this user) whose creating process
// no longer exists: a process killed before its peers could map (and so unlink) its segments leaves them. Returns
// how many went. Called once per process, when it first creates a segment.
int sweep_dead_segments();

}  // namespace portep
