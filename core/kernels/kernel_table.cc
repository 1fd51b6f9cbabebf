#include "core/kernels/kernel_table.h"

#include "core/kernels/kernel_table_backends.h"

namespace hps {

StatusOr<const Kernels*> kernels_for(DeviceType type) {
  if (type == DeviceType::kCpu) return &cpu::kernel_table();
#if HPS_HAVE_CUDA
  if (type == DeviceType::kCuda) return &cuda::kernel_table();
#endif
  return unavailable("kernels: this build has no kernels for " + Device{type, 0}.to_string());
}

}  // namespace hps
