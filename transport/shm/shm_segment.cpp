#include "transport/shm/shm_segment.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <random>

#include "transport/transport.h"

namespace portep {

namespace {
constexpr char kNameSeparator = '#';
constexpr char kMemfdLinkPrefix[] = "/memfd:";

std::string sys_error(const std::string& what, const std::string& name) {
  return what + " '" + name + "' failed: " + strerror(errno);
}

// Unique across processes and time: the pid, a counter, and a random salt against pid reuse.
std::string unique_memfd_name(const std::string& tag) {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t salt = std::random_device{}();
  return "portep." + std::to_string(getpid()) + "." + std::to_string(counter.fetch_add(1)) + "." +
         std::to_string(salt % 1000000) + "." + tag;
}

void* map_fd(int fd, size_t bytes, const std::string& name) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) throw TransportError(sys_error("mmap of shared memory", name));
  return p;
}

// What /proc/self/fd/<fd> points at ("" when unreadable).
std::string fd_link(int fd) {
  char path[64], target[512];
  snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
  const ssize_t n = readlink(path, target, sizeof(target) - 1);
  return n > 0 ? std::string(target, size_t(n)) : std::string();
}

struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) close(fd);
  }
};
}  // namespace

ShmSegment::~ShmSegment() { release(); }

ShmSegment::ShmSegment(ShmSegment&& o) noexcept { *this = std::move(o); }

ShmSegment& ShmSegment::operator=(ShmSegment&& o) noexcept {
  if (this != &o) {
    release();
    addr_ = o.addr_;
    bytes_ = o.bytes_;
    name_ = std::move(o.name_);
    fd_ = o.fd_;
    o.addr_ = nullptr;
    o.bytes_ = 0;
    o.fd_ = -1;
  }
  return *this;
}

ShmSegment ShmSegment::create(const std::string& tag, size_t bytes) {
  const std::string memfd_name = unique_memfd_name(tag);
  ShmSegment s;
  s.bytes_ = bytes;
  s.fd_ = memfd_create(memfd_name.c_str(), MFD_CLOEXEC);
  if (s.fd_ < 0) throw TransportError(sys_error("memfd_create", memfd_name));
  s.name_ = "/proc/" + std::to_string(getpid()) + "/fd/" + std::to_string(s.fd_) + kNameSeparator + memfd_name;
  if (ftruncate(s.fd_, off_t(bytes)) != 0)
    throw TransportError(sys_error("ftruncate to " + std::to_string(bytes) + " bytes of", memfd_name));
  s.addr_ = map_fd(s.fd_, bytes, memfd_name);
  return s;  // s's destructor closes the descriptor if anything above threw
}

ShmSegment ShmSegment::open(const std::string& name, size_t bytes) {
  const size_t cut = name.find(kNameSeparator);
  if (cut == std::string::npos) throw TransportError("peer shared memory name '" + name + "' is malformed");
  const std::string path = name.substr(0, cut), memfd_name = name.substr(cut + 1);
  FdCloser fd{::open(path.c_str(), O_RDWR | O_CLOEXEC)};
  if (fd.fd < 0)
    throw TransportError(sys_error("opening peer shared memory", path) +
                         " (the peer has exited, or runs in another PID namespace: same-host peers must see each "
                         "other's /proc)");
  // A pid reused after the creator died could hold another file under the same descriptor number.
  const std::string link = fd_link(fd.fd);
  const std::string expected = kMemfdLinkPrefix + memfd_name;
  if (link != expected && link != expected + " (deleted)")
    throw TransportError("peer shared memory '" + path + "' is '" + link + "', not " + memfd_name +
                         " (the peer has exited)");
  struct stat st;
  if (fstat(fd.fd, &st) != 0 || size_t(st.st_size) < bytes)
    throw TransportError("peer shared memory '" + memfd_name + "' is smaller than the " + std::to_string(bytes) +
                         " bytes it announced");
  ShmSegment s;
  s.name_ = name;
  s.bytes_ = bytes;
  s.addr_ = map_fd(fd.fd, bytes, memfd_name);
  return s;
}

void ShmSegment::stop_sharing() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

void ShmSegment::release() {
  if (addr_) munmap(addr_, bytes_);
  stop_sharing();
  addr_ = nullptr;
}

}  // namespace portep
