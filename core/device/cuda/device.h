#pragma once

#include "core/device/device.h"

namespace hps::cuda {

// 0 when no driver or device is usable ("driver insufficient" means no device here).
int32_t device_count();
StatusOr<DeviceProperties> device_properties(int32_t index);
// cudaSetDevice(index) on the calling thread.
Status use_device(int32_t index);

}  // namespace hps::cuda
