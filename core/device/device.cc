#include "core/device/device.h"

#include <charconv>
#include <string>

#include "core/common/config.h"
#include "core/device/cpu/device.h"
#if HPS_HAVE_CUDA
#include "core/device/cuda/device.h"
#endif

namespace hps {

std::string Device::to_string() const {
  if (type == DeviceType::kCpu) return index == 0 ? "cpu" : "cpu:" + std::to_string(index);
  return "cuda:" + std::to_string(index);
}

StatusOr<DeviceType> device_type_from_int(int32_t raw) {
  if (raw == static_cast<int32_t>(DeviceType::kCpu)) return DeviceType::kCpu;
  if (raw == static_cast<int32_t>(DeviceType::kCuda)) return DeviceType::kCuda;
  return invalid_argument("unknown device type value " + std::to_string(raw) +
                          " (known: 0=cpu, 1=cuda)");
}

StatusOr<Device> parse_device(std::string_view text) {
  std::string_view kind = text;
  int32_t index = 0;
  if (auto colon = text.find(':'); colon != std::string_view::npos) {
    kind = text.substr(0, colon);
    std::string_view digits = text.substr(colon + 1);
    auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
    if (error != std::errc() || end != digits.data() + digits.size() || digits.empty() ||
        index < 0) {
      return invalid_argument("bad device index in '" + std::string(text) + "'");
    }
  }
  if (kind == "cpu") {
    if (index != 0)
      return invalid_argument("the cpu device has index 0 only: '" + std::string(text) + "'");
    return Device::cpu();
  }
  if (kind == "cuda") return Device::cuda(index);
  return invalid_argument("unknown device '" + std::string(text) + "' (cpu, cuda:N)");
}

int32_t device_count(DeviceType type) {
  switch (type) {
    case DeviceType::kCpu: return 1;
    case DeviceType::kCuda:
#if HPS_HAVE_CUDA
      return cuda::device_count();
#else
      return 0;
#endif
  }
  return 0;
}

Status check_device(Device device) {
  const int32_t count = device_count(device.type);
  if (device.index < 0 || device.index >= count) {
    std::string m = "device " + device.to_string() + " does not exist: " + std::to_string(count) +
                    (device.type == DeviceType::kCpu ? " cpu device" : " CUDA device(s)");
    if (device.type == DeviceType::kCuda && !HPS_HAVE_CUDA)
      m += " (hpshard was built without CUDA)";
    return out_of_range(std::move(m));
  }
  return Status::Ok();
}

StatusOr<DeviceProperties> device_properties(Device device) {
  HPS_RETURN_IF_ERROR(check_device(device));
#if HPS_HAVE_CUDA
  if (device.type == DeviceType::kCuda) return cuda::device_properties(device.index);
#endif
  return cpu::device_properties();
}

Status use_device_on_this_thread(Device device) {
#if HPS_HAVE_CUDA
  if (device.type == DeviceType::kCuda) return cuda::use_device(device.index);
#endif
  (void)device;
  return Status::Ok();
}

}  // namespace hps
