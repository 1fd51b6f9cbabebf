// Devices: where buffers live and streams run.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "core/common/status.h"

namespace hps {

// Numeric values equal the C API's hps_device_type_t.
enum class DeviceType : int32_t { kCpu = 0, kCuda = 1 };

struct Device {
  DeviceType type = DeviceType::kCpu;
  int32_t index = 0;

  static Device cpu() { return {DeviceType::kCpu, 0}; }
  static Device cuda(int32_t index) { return {DeviceType::kCuda, index}; }
  std::string to_string() const;  // "cpu", "cuda:1"
  friend bool operator==(const Device&, const Device&) = default;
};

struct DeviceProperties {
  Device device;
  std::string name;
  uint64_t total_memory_bytes = 0;
  int32_t compute_capability_major = 0;
  int32_t compute_capability_minor = 0;
  int32_t multiprocessor_count = 0;  // CUDA: SMs; CPU: hardware threads
};

StatusOr<DeviceType> device_type_from_int(int32_t raw);
// "cpu", "cpu:0", "cuda", "cuda:N".
StatusOr<Device> parse_device(std::string_view text);

// Devices of `type` usable by this process; CUDA counts 0 when hpshard was built
// without CUDA or when no driver or device is present.
int32_t device_count(DeviceType type);
// OK when the device exists, else OUT_OF_RANGE naming it and the count.
Status check_device(Device device);
StatusOr<DeviceProperties> device_properties(Device device);
// A thread hpshard starts that will call `device`'s runtime (event queries and waits) makes
// it the thread's current device first: CUDA would otherwise open a context on device 0
// for that thread (hundreds of MiB on a GPU the rank does not use). CPU: nothing to do.
Status use_device_on_this_thread(Device device);

}  // namespace hps
