#include "core/device/device.h"

#include <algorithm>
#include <cstring>

#include "capi/src/error.h"

using hps::capi::guard;

namespace {

// The first published hps_device_properties_t ended after multiprocessor_count.
constexpr size_t kPropertiesMinSize =
    offsetof(hps_device_properties_t, multiprocessor_count) + sizeof(int32_t);

}  // namespace

extern "C" {

HPS_API hps_status_t hps_device_count(hps_device_type_t type, int32_t* out_count) {
  HPS_CHECK_ARG(out_count);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(hps::DeviceType t, hps::device_type_from_int(hps::capi::raw_enum(type)));
    *out_count = hps::device_count(t);
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_device_properties_init(hps_device_properties_t* props,
                                                size_t struct_size) {
  HPS_CHECK_ARG(props);
  return guard(__func__, [&]() -> hps::Status {
    if (struct_size < kPropertiesMinSize) {
      return hps::invalid_argument("struct_size " + std::to_string(struct_size) +
                                   " is smaller than the first hps_device_properties_t (" +
                                   std::to_string(kPropertiesMinSize) + ")");
    }
    // Zero only what both sides know; a newer caller's extra tail is its own.
    std::memset(props, 0, std::min(struct_size, sizeof(hps_device_properties_t)));
    props->struct_size = struct_size;
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_device_get_properties(hps_device_type_t type, int32_t index,
                                               hps_device_properties_t* props) {
  HPS_CHECK_ARG(props);
  return guard(__func__, [&]() -> hps::Status {
    if (props->struct_size < kPropertiesMinSize) {
      return hps::invalid_argument(
          "props->struct_size is not set: call hps_device_properties_init first");
    }
    HPS_ASSIGN_OR_RETURN(hps::DeviceType t, hps::device_type_from_int(hps::capi::raw_enum(type)));
    HPS_ASSIGN_OR_RETURN(hps::DeviceProperties p, hps::device_properties({t, index}));
    hps_device_properties_t out{};
    out.struct_size = props->struct_size;
    out.type = static_cast<hps_device_type_t>(t);
    out.index = index;
    const size_t n = std::min(p.name.size(), sizeof out.name - 1);
    std::memcpy(out.name, p.name.data(), n);
    out.name[n] = '\0';
    out.total_memory_bytes = p.total_memory_bytes;
    out.compute_capability_major = p.compute_capability_major;
    out.compute_capability_minor = p.compute_capability_minor;
    out.multiprocessor_count = p.multiprocessor_count;
    // An older caller's struct is shorter: write only the fields it has.
    std::memcpy(props, &out, std::min(props->struct_size, sizeof out));
    return hps::Status::Ok();
  });
}

}  // extern "C"
