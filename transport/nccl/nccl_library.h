// libnccl found and probed at run time, never linked: the library torch loaded, $PORTEP_LIBNCCL, or a path the
// caller names (an nvidia-nccl-cu12/cu13 wheel's). The probe reads ncclGetVersion (it needs no GPU) and looks up
// the host one-sided API that the nccl transport is to be built on (ncclPutSignal / ncclSignal / ncclWaitSignal
// with registered windows, NCCL >= 2.29.2). Only the library's exported symbols are used, so no NCCL header is
// needed to build.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

namespace portep::nccl {

// NCCL_VERSION(X, Y, Z) = X * 10000 + Y * 100 + Z (NCCL >= 2.9)
constexpr int version_code(int major, int minor, int patch) { return major * 10000 + minor * 100 + patch; }
constexpr int kHostRmaVersion = version_code(2, 29, 2);  // ncclPutSignal, ncclSignal, ncclWaitSignal appear
static_assert(kHostRmaVersion == 22902, "NCCL's version encoding");

// "2.28.9" from a version code (or "unknown" for 0 and below).
std::string version_text(int code);

// The symbols the nccl transport needs besides ncclGetVersion.
const std::vector<std::string>& host_rma_symbols();

struct Probe {
  bool loaded = false;
  std::string path;                  // the file loaded ("?" when unknown)
  int version = 0;                   // ncclGetVersion's code, 0 when not read
  std::vector<std::string> missing;  // host_rma_symbols() the library lacks
  std::string error;                 // why it did not load, or why the version could not be read

  // "2.28.9" from version (or "unknown").
  std::string version_text() const;
  // The library has the host one-sided API: version >= kHostRmaVersion and no symbol missing.
  bool host_rma() const { return loaded && version >= kHostRmaVersion && missing.empty(); }
  // One line for the doctor and for refusals.
  std::string summary() const;
};

// The library: $PORTEP_LIBNCCL if set; else a libnccl.so.2 already loaded in this process (torch's); else the first
// of candidates that loads; else libnccl.so.2 from the loader's search path. Loaded once per name per process.
Probe probe(const std::vector<std::string>& candidates);

// The library probe() finds, kept loaded for the rest of the process, for looking up its functions.
struct Library {
  void* handle = nullptr;  // null when nothing loaded (probe.error says why)
  Probe probe;
};
Library open_library(const std::vector<std::string>& candidates);

// The address of function `name` in lib; throws std::runtime_error naming the library and the function.
void* symbol(const Library& lib, const char* name);

constexpr int kUniqueIdBytes = 128;  // sizeof(ncclUniqueId), NCCL_UNIQUE_ID_BYTES in every release

// A new ncclUniqueId (kUniqueIdBytes) from the library found: what every rank of a communicator needs, made by one
// of them. Throws std::runtime_error naming the library and NCCL's error.
std::string unique_id(const std::vector<std::string>& candidates);

}  // namespace portep::nccl
