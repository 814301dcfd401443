#include "transport/shm/shm_segment.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <random>

#include "transport/transport.h"

namespace portep {

namespace {
std::string sys_error(const std::string& what, const std::string& name) {
  return what + " '" + name + "' failed: " + strerror(errno);
}

std::string unique_name(const std::string& tag) {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t salt = std::random_device{}();
  return "/portep." + std::to_string(getpid()) + "." + std::to_string(counter.fetch_add(1)) + "." +
         std::to_string(salt % 100000) + "." + tag;
}

void* map_fd(int fd, size_t bytes, const std::string& name) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    std::string msg = sys_error("mmap of shared memory", name);
    close(fd);
    throw TransportError(msg);
  }
  close(fd);
  return p;
}
}  // namespace

ShmSegment::~ShmSegment() { release(); }

ShmSegment::ShmSegment(ShmSegment&& o) noexcept { *this = std::move(o); }

ShmSegment& ShmSegment::operator=(ShmSegment&& o) noexcept {
  if (this != &o) {
    release();
    addr_ = o.addr_;
    bytes_ = o.bytes_;
    name_ = std::move(o.name_);
    owner_ = o.owner_;
    linked_ = o.linked_;
    o.addr_ = nullptr;
    o.bytes_ = 0;
    o.owner_ = o.linked_ = false;
  }
  return *this;
}

ShmSegment ShmSegment::create(const std::string& tag, size_t bytes) {
  static const int swept = sweep_dead_segments();
  (void)swept;
  ShmSegment s;
  s.name_ = unique_name(tag);
  s.bytes_ = bytes;
  int fd = shm_open(s.name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw TransportError(sys_error("shm_open(create)", s.name_));
  s.owner_ = s.linked_ = true;
  if (ftruncate(fd, off_t(bytes)) != 0) {
    std::string msg = sys_error("ftruncate to " + std::to_string(bytes) + " bytes of", s.name_);
    close(fd);
    throw TransportError(msg);  // s's destructor unlinks the name
  }
  s.addr_ = map_fd(fd, bytes, s.name_);
  return s;
}

ShmSegment ShmSegment::open(const std::string& name, size_t bytes) {
  ShmSegment s;
  s.name_ = name;
  s.bytes_ = bytes;
  int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) throw TransportError(sys_error("shm_open(peer)", name));
  struct stat st;
  if (fstat(fd, &st) != 0 || size_t(st.st_size) < bytes) {
    close(fd);
    throw TransportError("peer shared memory '" + name + "' is smaller than the " + std::to_string(bytes) +
                         " bytes it announced");
  }
  s.addr_ = map_fd(fd, bytes, name);
  return s;
}

void ShmSegment::unlink_name() {
  if (owner_ && linked_) {
    shm_unlink(name_.c_str());
    linked_ = false;
  }
}

void ShmSegment::release() {
  if (addr_) munmap(addr_, bytes_);
  unlink_name();
  addr_ = nullptr;
}

void shm_unlink_quiet(const std::string& name) { shm_unlink(name.c_str()); }

int sweep_dead_segments() {
  DIR* dir = opendir("/dev/shm");
  if (!dir) return 0;
  int removed = 0;
  const std::string prefix = "portep.";
  while (dirent* e = readdir(dir)) {
    const std::string name = e->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    char* end = nullptr;
    const long pid = strtol(name.c_str() + prefix.size(), &end, 10);
    if (pid <= 0 || !end || *end != '.') continue;
    if (kill(pid_t(pid), 0) == 0 || errno != ESRCH) continue;  // alive, or not ours to judge
    struct stat st;
    if (stat(("/dev/shm/" + name).c_str(), &st) != 0 || st.st_uid != getuid()) continue;
    if (shm_unlink(("/" + name).c_str()) == 0) ++removed;
  }
  closedir(dir);
  return removed;
}

}  // namespace portep
