#include "transport/nccl/nccl_library.h"

#include <dlfcn.h>
#include <link.h>

#include <cstdlib>
#include <map>
#include <mutex>

namespace portep::nccl {

namespace {

using GetVersionFn = int (*)(int*);  // ncclResult_t ncclGetVersion(int* version); ncclSuccess is 0

struct Opened {
  void* handle = nullptr;
  std::string error;
};

// dlopen(name) once per process and name; RTLD_LOCAL: nothing of portep resolves against it.
Opened open_once(const std::string& name, int extra_flags) {
  static std::mutex mu;
  static std::map<std::pair<std::string, int>, Opened> opened;
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_pair(name, extra_flags);
  auto it = opened.find(key);
  if (it == opened.end()) {
    Opened o;
    o.handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL | extra_flags);
    if (!o.handle) {
      const char* err = dlerror();
      o.error = "cannot load " + name + ": " + (err ? err : "?");
    }
    it = opened.emplace(key, o).first;
  }
  return it->second;
}

std::string path_of(void* handle) {
  link_map* map = nullptr;
  if (!handle || dlinfo(handle, RTLD_DI_LINKMAP, &map) != 0 || !map || !map->l_name) return "?";
  return map->l_name;
}

Probe probe_handle(void* handle) {
  Probe p;
  p.loaded = true;
  p.path = path_of(handle);
  auto get_version = reinterpret_cast<GetVersionFn>(dlsym(handle, "ncclGetVersion"));
  if (!get_version) {
    p.error = p.path + " has no ncclGetVersion";
  } else if (int rc = get_version(&p.version); rc != 0) {
    p.error = "ncclGetVersion returned " + std::to_string(rc);
    p.version = 0;
  }
  for (const std::string& symbol : host_rma_symbols())
    if (!dlsym(handle, symbol.c_str())) p.missing.push_back(symbol);
  return p;
}

}  // namespace

const std::vector<std::string>& host_rma_symbols() {
  static const std::vector<std::string> symbols = {
      "ncclGetUniqueId",        "ncclCommInitRank",         "ncclCommDestroy", "ncclMemAlloc", "ncclMemFree",
      "ncclCommWindowRegister", "ncclCommWindowDeregister", "ncclPutSignal",   "ncclSignal",   "ncclWaitSignal"};
  return symbols;
}

std::string Probe::version_text() const {
  if (version <= 0) return "unknown";
  return std::to_string(version / 10000) + "." + std::to_string(version / 100 % 100) + "." +
         std::to_string(version % 100);
}

std::string Probe::summary() const {
  if (!loaded) return "no NCCL library: " + error;
  std::string s = "NCCL " + version_text() + " at " + path;
  if (!error.empty()) return s + " (" + error + ")";
  if (host_rma()) return s + ": host one-sided API present";
  std::string why = version < kHostRmaVersion ? "older than 2.29.2" : "lacking";
  if (!missing.empty()) {
    why += version < kHostRmaVersion ? "; lacks" : "";
    for (size_t i = 0; i < missing.size(); ++i) why += (i ? ", " : " ") + missing[i];
  }
  return s + ": no host one-sided API (" + why + "; the nccl transport needs NCCL >= 2.29.2)";
}

Probe probe(const std::vector<std::string>& candidates) {
  if (const char* env = std::getenv("PORTEP_LIBNCCL"); env && *env) {
    Opened o = open_once(env, 0);
    if (!o.handle) return Probe{false, env, 0, {}, o.error + " ($PORTEP_LIBNCCL)"};
    return probe_handle(o.handle);
  }
  // torch's own, when it loaded one: RTLD_NOLOAD finds it by soname without loading anything new
  if (void* loaded = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD)) {
    Probe p = probe_handle(loaded);
    dlclose(loaded);  // (drops only the reference RTLD_NOLOAD took)
    return p;
  }
  std::string errors;
  for (const std::string& path : candidates) {
    Opened o = open_once(path, 0);
    if (o.handle) return probe_handle(o.handle);
    errors += (errors.empty() ? "" : "; ") + o.error;
  }
  Opened o = open_once("libnccl.so.2", 0);
  if (o.handle) return probe_handle(o.handle);
  return Probe{false, "", 0, {}, errors.empty() ? o.error : errors + "; " + o.error};
}

}  // namespace portep::nccl
