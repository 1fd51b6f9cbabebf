#include "core/device/cuda/device.h"

#include <cuda_runtime_api.h>

#include "core/common/logging.h"
#include "core/device/cuda/error.h"

namespace hps::cuda {

int32_t device_count() {
  static const int32_t count = [] {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
      HPS_LOG(kInfo) << "no usable CUDA device: " << cudaGetErrorString(e);
      (void)cudaGetLastError();  // clear the sticky error
      return 0;
    }
    return static_cast<int32_t>(n);
  }();
  return count;
}

StatusOr<DeviceProperties> device_properties(int32_t index) {
  cudaDeviceProp prop{};
  HPS_RETURN_IF_ERROR(
      cuda_status(cudaGetDeviceProperties(&prop, index), "cudaGetDeviceProperties"));
  DeviceProperties p;
  p.device = Device::cuda(index);
  p.name = prop.name;
  p.total_memory_bytes = prop.totalGlobalMem;
  p.compute_capability_major = prop.major;
  p.compute_capability_minor = prop.minor;
  p.multiprocessor_count = prop.multiProcessorCount;
  return p;
}

Status use_device(int32_t index) { return set_device(index); }

}  // namespace hps::cuda
