#include "core/comm/nccl/nccl_api.h"

#include <dlfcn.h>

#include <string>

#include "core/common/env.h"

namespace hps::nccl_backend {
namespace {

template <typename F>
bool resolve(void* library, const char* symbol, F* out) {
  *out = reinterpret_cast<F>(dlsym(library, symbol));
  return *out != nullptr;
}

StatusOr<NcclApi> load() {
  const std::string file = env_string("HPS_NCCL_LIBRARY").value_or("libnccl.so.2");
  void* library = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* why = dlerror();
    return unavailable("cannot load NCCL (" + file + "): " + (why ? why : "unknown error"));
  }
  NcclApi api{};
  const bool ok = resolve(library, "ncclGetUniqueId", &api.GetUniqueId) &&
                  resolve(library, "ncclCommInitRankConfig", &api.CommInitRankConfig) &&
                  resolve(library, "ncclCommGetAsyncError", &api.CommGetAsyncError) &&
                  resolve(library, "ncclCommAbort", &api.CommAbort) &&
                  resolve(library, "ncclCommFinalize", &api.CommFinalize) &&
                  resolve(library, "ncclCommDestroy", &api.CommDestroy) &&
                  resolve(library, "ncclCommSplit", &api.CommSplit) &&
                  resolve(library, "ncclGetErrorString", &api.GetErrorString) &&
                  resolve(library, "ncclAllReduce", &api.AllReduce) &&
                  resolve(library, "ncclReduce", &api.Reduce) &&
                  resolve(library, "ncclBroadcast", &api.Broadcast) &&
                  resolve(library, "ncclAllGather", &api.AllGather) &&
                  resolve(library, "ncclReduceScatter", &api.ReduceScatter) &&
                  resolve(library, "ncclSend", &api.Send) &&
                  resolve(library, "ncclRecv", &api.Recv);
  if (!ok)
    return unavailable(file + " lacks a symbol hpshard needs (NCCL 2.18 or newer is required)");
  return api;  // the library stays loaded for the life of the process
}

}  // namespace

StatusOr<const NcclApi*> nccl_api() {
  static const StatusOr<NcclApi> loaded = load();
  if (!loaded.ok()) return loaded.status();
  return &loaded.value();
}

}  // namespace hps::nccl_backend
