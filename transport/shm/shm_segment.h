// Memory shared between the processes of one host. A segment is an anonymous memfd: it never has a name in
// /dev/shm, so nothing outlives its processes, whenever they are killed. Peers open it through the creator's
// /proc/<pid>/fd entry while the creator keeps that descriptor open (until stop_sharing(), once every peer has
// mapped it); the mapping itself lives until the last process unmaps it.
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

  // Creates a new zero-filled segment (pages come on first touch, as for any shared memory); tag shows in its name.
  static ShmSegment create(const std::string& tag, size_t bytes);
  // Maps a segment another process of this host created, from the name() it published.
  static ShmSegment open(const std::string& name, size_t bytes);

  // Closes the descriptor peers open the segment through; the mapping stays. Idempotent.
  void stop_sharing();
  void* data() const { return addr_; }
  size_t size() const { return bytes_; }
  // "/proc/<pid>/fd/<fd>#<memfd name>": where a peer opens it, and the name it must find there. No whitespace.
  const std::string& name() const { return name_; }

 private:
  void release();
  void* addr_ = nullptr;
  size_t bytes_ = 0;
  std::string name_;
  int fd_ = -1;  // open while peers may still open the segment
};

}  // namespace portep
