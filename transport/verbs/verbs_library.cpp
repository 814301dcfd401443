#include "transport/verbs/verbs_library.h"

#include <dlfcn.h>
#include <link.h>
#include <stdlib.h>

#include <map>
#include <type_traits>
#include <mutex>

#include "transport/transport.h"

namespace portep::verbs {

namespace {

std::string env_or(const char* var, const char* fallback) {
  const char* v = getenv(var);
  return v && *v ? v : fallback;
}

struct LoadedIbv {
  IbvApi api{};
  std::string error;  // empty: loaded
};

// Fills every entry of api from handle; returns the first required symbol missing, else "".
std::string bind_ibv(void* handle, IbvApi* api) {
  std::string missing;
  auto need = [&](auto*& fn, const char* symbol) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(find_symbol(handle, symbol));
    if (!fn && missing.empty()) missing = symbol;
  };
  need(api->get_device_list, "ibv_get_device_list");
  need(api->free_device_list, "ibv_free_device_list");
  need(api->get_device_name, "ibv_get_device_name");
  need(api->open_device, "ibv_open_device");
  need(api->close_device, "ibv_close_device");
  need(api->query_device, "ibv_query_device");
  need(api->query_port, "ibv_query_port");
  need(api->query_gid, "ibv_query_gid");
  need(api->alloc_pd, "ibv_alloc_pd");
  need(api->dealloc_pd, "ibv_dealloc_pd");
  need(api->reg_mr, "ibv_reg_mr");
  need(api->dereg_mr, "ibv_dereg_mr");
  need(api->create_cq, "ibv_create_cq");
  need(api->destroy_cq, "ibv_destroy_cq");
  need(api->create_qp, "ibv_create_qp");
  need(api->modify_qp, "ibv_modify_qp");
  need(api->destroy_qp, "ibv_destroy_qp");
  need(api->create_ah, "ibv_create_ah");
  need(api->destroy_ah, "ibv_destroy_ah");
  need(api->qp_to_qp_ex, "ibv_qp_to_qp_ex");
  need(api->wc_status_str, "ibv_wc_status_str");
  api->reg_dmabuf_mr = reinterpret_cast<decltype(api->reg_dmabuf_mr)>(find_symbol(handle, "ibv_reg_dmabuf_mr"));
  return missing;
}

const LoadedIbv& loaded_ibv() {
  static const LoadedIbv loaded = [] {
    LoadedIbv l;
    const std::string name = ibverbs_library_name();
    void* handle = load_library_once(name, &l.error);
    if (!handle) return l;
    const std::string missing = bind_ibv(handle, &l.api);
    if (!missing.empty()) l.error = name + " has no " + missing + " (rdma-core too old?)";
    return l;
  }();
  return loaded;
}

}  // namespace

std::string ibverbs_library_name() { return env_or("PORTEP_LIBIBVERBS", "libibverbs.so.1"); }
std::string efa_library_name() { return env_or("PORTEP_LIBEFA", "libefa.so.1"); }

void* load_library_once(const std::string& name, std::string* why) {
  static std::mutex mu;
  static std::map<std::string, std::pair<void*, std::string>> loaded;  // name: (handle, error)
  std::lock_guard<std::mutex> lock(mu);
  auto it = loaded.find(name);
  if (it == loaded.end()) {
    // RTLD_GLOBAL: the providers libibverbs loads itself (librxe, libmlx5, libefa) resolve against it.
    void* handle = dlopen(name.c_str(), RTLD_NOW | RTLD_GLOBAL);
    const char* err = handle ? nullptr : dlerror();
    it = loaded.emplace(name, std::make_pair(handle, handle ? "" : "cannot load " + name + ": " + (err ? err : "?")))
             .first;
  }
  if (!it->second.first && why) *why = it->second.second;
  return it->second.first;
}

std::string library_path(void* handle) {
  link_map* map = nullptr;
  if (!handle || dlinfo(handle, RTLD_DI_LINKMAP, &map) != 0 || !map || !map->l_name) return "?";
  return map->l_name;
}

void* find_symbol(void* handle, const char* symbol) { return handle ? dlsym(handle, symbol) : nullptr; }

const IbvApi& ibv() {
  const LoadedIbv& l = loaded_ibv();
  if (!l.error.empty())
    throw TransportError("verbs: " + l.error + " (rdma-core's libibverbs; see python -m portep.doctor)");
  return l.api;
}

bool ibv_loadable(std::string* why) {
  const LoadedIbv& l = loaded_ibv();
  if (why) *why = l.error;
  return l.error.empty();
}

}  // namespace portep::verbs
