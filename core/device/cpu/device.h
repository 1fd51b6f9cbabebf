#pragma once

#include "core/device/device.h"

namespace hps::cpu {

DeviceProperties device_properties();

}  // namespace hps::cpu
