#include "core/device/device.h"

#include <algorithm>
#include <cstring>

#include "capi/src/error.h"
#include "capi/src/extensible.h"

using hps::capi::guard;

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
  return guard(__func__, [&] {
    return hps::capi::init_struct(props, struct_size, hps::capi::zeroed<hps_device_properties_t>());
  });
}

HPS_API hps_status_t hps_device_get_properties(hps_device_type_t type, int32_t index,
                                               hps_device_properties_t* props) {
  HPS_CHECK_ARG(props);
  return guard(__func__, [&]() -> hps::Status {
    HPS_RETURN_IF_ERROR(hps::capi::caller_struct_size(props, "props").status());
    HPS_ASSIGN_OR_RETURN(hps::DeviceType t, hps::device_type_from_int(hps::capi::raw_enum(type)));
    HPS_ASSIGN_OR_RETURN(hps::DeviceProperties p, hps::device_properties({t, index}));
    auto out = hps::capi::zeroed<hps_device_properties_t>();
    out.type = static_cast<hps_device_type_t>(t);
    out.index = index;
    const size_t n = std::min(p.name.size(), sizeof out.name - 1);
    std::memcpy(out.name, p.name.data(), n);
    out.total_memory_bytes = p.total_memory_bytes;
    out.compute_capability_major = p.compute_capability_major;
    out.compute_capability_minor = p.compute_capability_minor;
    out.multiprocessor_count = p.multiprocessor_count;
    return hps::capi::write_struct(props, out, "props");
  });
}

}  // extern "C"
