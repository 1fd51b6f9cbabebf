#include "core/comm/nccl/nccl_api.h"

#include <dlfcn.h>
#include <glob.h>

#include <optional>
#include <string>

#include "core/common/env.h"

namespace hps::nccl_backend {
namespace {

constexpr size_t kMaxPath = 4096;

template <typename F>
bool resolve(void* library, const char* symbol, F* out) {
  *out = reinterpret_cast<F>(dlsym(library, symbol));
  return *out != nullptr;
}

// Every file matching `pattern`, sorted (glob's order), none when nothing matches.
void add_matches(const std::string& pattern, std::vector<std::string>& out) {
  glob_t matches{};
  if (glob(pattern.c_str(), 0, nullptr, &matches) == 0) {
    for (size_t i = 0; i < matches.gl_pathc; ++i) out.emplace_back(matches.gl_pathv[i]);
  }
  globfree(&matches);
}

// An environment variable used as a folder: set, absolute, of a sane length.
std::optional<std::string> folder_from(const char* variable) {
  auto value = env_string(variable);
  if (!value || value->empty() || value->front() != '/' || value->size() > kMaxPath) {
    return std::nullopt;
  }
  return value;
}

StatusOr<NcclApi> load_one(const std::string& file) {
  void* library = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* why = dlerror();
    return unavailable(why ? why : "unknown dlopen error");
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
                  resolve(library, "ncclGetVersion", &api.GetVersion) &&
                  resolve(library, "ncclAllReduce", &api.AllReduce) &&
                  resolve(library, "ncclReduce", &api.Reduce) &&
                  resolve(library, "ncclBroadcast", &api.Broadcast) &&
                  resolve(library, "ncclAllGather", &api.AllGather) &&
                  resolve(library, "ncclReduceScatter", &api.ReduceScatter) &&
                  resolve(library, "ncclSend", &api.Send) &&
                  resolve(library, "ncclRecv", &api.Recv);
  if (!ok) {
    dlclose(library);
    return unavailable("lacks a symbol hpshard needs (NCCL 2.18 or newer is required)");
  }
  api.file = file;
  return api;  // the library stays loaded for the life of the process
}

}  // namespace

StatusOr<std::vector<std::string>> nccl_library_candidates() {
  if (auto chosen = env_string("HPS_NCCL_LIBRARY")) {
    if (chosen->empty() || chosen->size() > kMaxPath) {
      return invalid_argument("HPS_NCCL_LIBRARY must name a library file (it is " +
                              std::string(chosen->empty() ? "empty" : "too long") + ")");
    }
    return std::vector<std::string>{*chosen};
  }
  std::vector<std::string> files = {"libnccl.so.2"};
#ifdef HPS_NCCL_CONFIGURED_LIBRARY
  files.emplace_back(HPS_NCCL_CONFIGURED_LIBRARY);
#endif
  const std::string wheel = "/nvidia/nccl/lib/libnccl.so.2";
  if (auto venv = folder_from("VIRTUAL_ENV")) {
    add_matches(*venv + "/lib/python3*/site-packages" + wheel, files);
  }
  if (auto conda = folder_from("CONDA_PREFIX")) {
    add_matches(*conda + "/lib/python3*/site-packages" + wheel, files);
    add_matches(*conda + "/lib/libnccl.so.2", files);
  }
  if (auto home = folder_from("HOME")) {
    add_matches(*home + "/.local/lib/python3*/site-packages" + wheel, files);
  }
  for (const char* prefix :
       {"/usr/local/lib/python3*/dist-packages", "/usr/local/lib/python3*/site-packages",
        "/usr/lib/python3/dist-packages", "/usr/lib/python3*/site-packages",
        "/opt/conda/lib/python3*/site-packages"}) {
    add_matches(std::string(prefix) + wheel, files);
  }
  return files;
}

StatusOr<NcclApi> load_nccl(const std::vector<std::string>& candidates) {
  std::string tried;
  for (const std::string& file : candidates) {
    auto api = load_one(file);
    if (api.ok()) return api;
    tried += "\n  " + file + ": " + api.status().message();
  }
  return unavailable("cannot load NCCL; tried (set HPS_NCCL_LIBRARY to the libnccl.so.2 to use):" +
                     tried);
}

StatusOr<const NcclApi*> nccl_api() {
  static const StatusOr<NcclApi> loaded = []() -> StatusOr<NcclApi> {
    HPS_ASSIGN_OR_RETURN(auto candidates, nccl_library_candidates());
    return load_nccl(candidates);
  }();
  if (!loaded.ok()) return loaded.status();
  return &loaded.value();
}

std::string nccl_version_string(const NcclApi& api) {
  int code = 0;
  if (api.GetVersion(&code) != ncclSuccess) return "unknown";
  // NCCL_VERSION(X, Y, Z): X·10000 + Y·100 + Z since 2.9 (X·1000 + Y·100 + Z before).
  const int major = code >= 10000 ? code / 10000 : code / 1000;
  const int minor = code >= 10000 ? code / 100 % 100 : code / 100 % 10;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(code % 100);
}

}  // namespace hps::nccl_backend
