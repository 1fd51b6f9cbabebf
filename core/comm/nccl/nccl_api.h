// NCCL, loaded at run time (dlopen "libnccl.so.2"): libhpshard.so carries no link-time
// dependency on NCCL, so the package installs where CUDA is absent, and the CUDA
// communicator is available wherever the library can be loaded.
#pragma once

#include <nccl.h>

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
  decltype(&::ncclAllReduce) AllReduce;
  decltype(&::ncclReduce) Reduce;
  decltype(&::ncclBroadcast) Broadcast;
  decltype(&::ncclAllGather) AllGather;
  decltype(&::ncclReduceScatter) ReduceScatter;
  decltype(&::ncclSend) Send;
  decltype(&::ncclRecv) Recv;
};

// The loaded API, or UNAVAILABLE saying why (HPS_NCCL_LIBRARY overrides the file name).
StatusOr<const NcclApi*> nccl_api();

}  // namespace hps::nccl_backend
