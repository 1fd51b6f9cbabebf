// NCCL, loaded at run time (dlopen): libhpshard.so carries no link-time dependency on NCCL,
// so the package installs where CUDA is absent, and the CUDA communicator is available
// wherever a library can be found.
//
// Where it is looked for, in order (the first that loads wins):
//  1. HPS_NCCL_LIBRARY, when set: that file only (an explicit choice is never replaced by
//     another library; a file that does not load is the error);
//  2. libnccl.so.2 on the loader's path (LD_LIBRARY_PATH, ld.so.cache, RUNPATH);
//  3. the library CMake found at configure time (HPS_NCCL_LIBRARY there);
//  4. NCCL's Python wheel (nvidia-nccl-cu*): nvidia/nccl/lib/libnccl.so.2 under the
//     site-packages of $VIRTUAL_ENV, $CONDA_PREFIX, ~/.local and the system's python3.*
//     folders, and $CONDA_PREFIX/lib.
#pragma once

#include <nccl.h>

#include <string>
#include <vector>

#include "core/common/status.h"

namespace hps::nccl_backend {

struct NcclApi {
  decltype(&::ncclGetUniqueId) GetUniqueId;
  decltype(&::ncclCommInitRankConfig) CommInitRankConfig;
  decltype(&::ncclCommGetAsyncError) CommGetAsyncError;
  decltype(&::ncclCommAbort) CommAbort;
  decltype(&::ncclCommFinalize) CommFinalize;
  decltype(&::ncclCommDestroy) CommDestroy;
  decltype(&::ncclCommSplit) CommSplit;
  decltype(&::ncclGetErrorString) GetErrorString;
  decltype(&::ncclGetVersion) GetVersion;
  decltype(&::ncclAllReduce) AllReduce;
  decltype(&::ncclReduce) Reduce;
  decltype(&::ncclBroadcast) Broadcast;
  decltype(&::ncclAllGather) AllGather;
  decltype(&::ncclReduceScatter) ReduceScatter;
  decltype(&::ncclSend) Send;
  decltype(&::ncclRecv) Recv;
  std::string file;  // the library it came from
};

// The files tried, in order, given the environment now (HPS_NCCL_LIBRARY set: only it).
// INVALID_ARGUMENT when HPS_NCCL_LIBRARY is set but empty or not a plausible path.
StatusOr<std::vector<std::string>> nccl_library_candidates();
// Loads the first candidate that opens and has every symbol; UNAVAILABLE naming every file
// tried and why each failed.
StatusOr<NcclApi> load_nccl(const std::vector<std::string>& candidates);

// The process's NCCL, loaded once (the candidates of the first call); UNAVAILABLE saying why.
StatusOr<const NcclApi*> nccl_api();

// "2.28.3", from the loaded library.
std::string nccl_version_string(const NcclApi& api);

}  // namespace hps::nccl_backend
