// CUDA runtime errors → Status (only compiled when CUDA is found).
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "core/common/status.h"

namespace hps::cuda {

inline Status cuda_status(cudaError_t error, const char* operation) {
  if (error == cudaSuccess) return Status::Ok();
  if (error == cudaErrorMemoryAllocation) {
    return out_of_memory(std::string(operation) + ": " + cudaGetErrorString(error));
  }
  return backend_error(std::string(operation) + ": CUDA error " + std::to_string(error) + " (" +
                       cudaGetErrorName(error) + "): " + cudaGetErrorString(error));
}

// Makes `index` the calling thread's current device for the next runtime calls.
inline Status set_device(int32_t index) {
  return cuda_status(cudaSetDevice(index), "cudaSetDevice");
}

}  // namespace hps::cuda
