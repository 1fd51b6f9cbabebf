#include "core/device/allocator.h"

#include <map>
#include <memory>
#include <mutex>

#include "core/common/config.h"
#include "core/device/cpu/allocator.h"
#if HPS_HAVE_CUDA
#include "core/device/cuda/allocator.h"
#endif

namespace hps {

StatusOr<Allocator*> allocator_for(Device device) {
  HPS_RETURN_IF_ERROR(check_device(device));
  if (device.type == DeviceType::kCpu) {
    static cpu::CpuAllocator cpu_allocator;
    return static_cast<Allocator*>(&cpu_allocator);
  }
#if HPS_HAVE_CUDA
  static std::mutex mutex;
  static std::map<int32_t, std::unique_ptr<cuda::CudaAllocator>> cuda_allocators;
  std::lock_guard lock(mutex);
  auto& slot = cuda_allocators[device.index];
  if (!slot) slot = std::make_unique<cuda::CudaAllocator>(device.index);
  return static_cast<Allocator*>(slot.get());
#else
  return internal_error("allocator_for: no CUDA in this build");
#endif
}

}  // namespace hps
