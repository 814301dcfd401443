// libibverbs and libefa, loaded with dlopen the first time a verbs transport is asked for, so that a build made where
// rdma-core exists imports and runs its other transports where it does not. Only the headers are needed to build.
// The verbs transports call the libraries' exported functions through these tables; the inline ones of verbs.h
// (ibv_post_send, ibv_poll_cq, ibv_wr_*) go through the device's own op table and need no symbol.
#pragma once

#include <infiniband/verbs.h>

#include <string>

namespace portep::verbs {

// The exported functions of libibverbs the transports use, with the signatures of their exported symbols.
struct IbvApi {
  ibv_device** (*get_device_list)(int* num_devices);
  void (*free_device_list)(ibv_device** list);
  const char* (*get_device_name)(ibv_device* device);
  ibv_context* (*open_device)(ibv_device* device);
  int (*close_device)(ibv_context* context);
  int (*query_device)(ibv_context* context, ibv_device_attr* attr);
  // The exported symbol fills the pre-1.1 prefix of ibv_port_attr (state, MTU, LID, GID table, link layer, ...).
  int (*query_port)(ibv_context* context, uint8_t port, ibv_port_attr* attr);
  int (*query_gid)(ibv_context* context, uint8_t port, int index, ibv_gid* gid);
  ibv_pd* (*alloc_pd)(ibv_context* context);
  int (*dealloc_pd)(ibv_pd* pd);
  ibv_mr* (*reg_mr)(ibv_pd* pd, void* addr, size_t length, int access);
  // rdma-core 34+; null where the library predates it.
  ibv_mr* (*reg_dmabuf_mr)(ibv_pd* pd, uint64_t offset, size_t length, uint64_t iova, int fd, int access);
  int (*dereg_mr)(ibv_mr* mr);
  ibv_cq* (*create_cq)(ibv_context* context, int cqe, void* cq_context, ibv_comp_channel* channel, int vector);
  int (*destroy_cq)(ibv_cq* cq);
  ibv_qp* (*create_qp)(ibv_pd* pd, ibv_qp_init_attr* attr);
  int (*modify_qp)(ibv_qp* qp, ibv_qp_attr* attr, int mask);
  int (*destroy_qp)(ibv_qp* qp);
  ibv_ah* (*create_ah)(ibv_pd* pd, ibv_ah_attr* attr);
  int (*destroy_ah)(ibv_ah* ah);
  ibv_qp_ex* (*qp_to_qp_ex)(ibv_qp* qp);
  const char* (*wc_status_str)(ibv_wc_status status);
};

// The loaded libibverbs; throws TransportError naming the library (and dlerror()) where it cannot be loaded.
const IbvApi& ibv();
// Whether libibverbs loads here; *why says why not (the library's name and dlerror()).
bool ibv_loadable(std::string* why);

// The library names tried ($PORTEP_LIBIBVERBS / $PORTEP_LIBEFA, else rdma-core's sonames).
std::string ibverbs_library_name();
std::string efa_library_name();

// A handle of a library loaded once per process, or null with *why.
void* load_library_once(const std::string& name, std::string* why);
// Where a loaded library's file is ("?" when unknown).
std::string library_path(void* handle);
// A symbol of handle, or null where the library lacks it.
void* find_symbol(void* handle, const char* symbol);

}  // namespace portep::verbs
