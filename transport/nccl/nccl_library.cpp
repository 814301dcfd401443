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

std::string version_text(int code) {
  if (code <= 0) return "unknown";
  return std::to_string(code / 10000) + "." + std::to_string(code / 100 % 100) + "." + std::to_string(code % 100);
}

std::string Probe::version_text() const { return nccl::version_text(version); }

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

Library open_library(const std::vector<std::string>& candidates) {
  if (const char* env = std::getenv("PORTEP_LIBNCCL"); env && *env) {
    Opened o = open_once(env, 0);
    if (!o.handle) return Library{nullptr, Probe{false, env, 0, {}, o.error + " ($PORTEP_LIBNCCL)"}};
    return Library{o.handle, probe_handle(o.handle)};
  }
  // torch's own, when it loaded one: RTLD_NOLOAD finds it by soname without loading anything new (asked afresh each
  // time: torch may load it later; the reference each success takes is kept, so the library stays while used here)
  if (void* loaded = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD))
    return Library{loaded, probe_handle(loaded)};
  std::string errors;
  for (const std::string& path : candidates) {
    Opened o = open_once(path, 0);
    if (o.handle) return Library{o.handle, probe_handle(o.handle)};
    errors += (errors.empty() ? "" : "; ") + o.error;
  }
  Opened o = open_once("libnccl.so.2", 0);
  if (o.handle) return Library{o.handle, probe_handle(o.handle)};
  return Library{nullptr, Probe{false, "", 0, {}, errors.empty() ? o.error : errors + "; " + o.error}};
}

Probe probe(const std::vector<std::string>& candidates) { return open_library(candidates).probe; }

void* symbol(const Library& lib, const char* name) {
  if (!lib.handle) throw std::runtime_error(std::string("no NCCL library to find ") + name + " in: " + lib.probe.error);
  void* f = dlsym(lib.handle, name);
  if (!f) throw std::runtime_error("NCCL " + lib.probe.version_text() + " at " + lib.probe.path + " has no " + name);
  return f;
}

std::string unique_id(const std::vector<std::string>& candidates) {
  using GetUniqueIdFn = int (*)(void*);  // ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId)
  using ErrorStringFn = const char* (*)(int);
  const Library lib = open_library(candidates);
  auto get = reinterpret_cast<GetUniqueIdFn>(symbol(lib, "ncclGetUniqueId"));
  std::string id(kUniqueIdBytes, '\0');
  if (int rc = get(id.data()); rc != 0) {
    auto text = reinterpret_cast<ErrorStringFn>(dlsym(lib.handle, "ncclGetErrorString"));
    throw std::runtime_error("ncclGetUniqueId (NCCL " + lib.probe.version_text() + " at " + lib.probe.path +
                             "): " + (text ? text(rc) : "error " + std::to_string(rc)));
  }
  return id;
}

}  // namespace portep::nccl
