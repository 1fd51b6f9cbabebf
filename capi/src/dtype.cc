#include "core/common/dtype.h"

#include "capi/src/error.h"

using hps::capi::guard;

extern "C" {

HPS_API hps_status_t hps_dtype_size(hps_dtype_t dtype, size_t* out_size) {
  HPS_CHECK_ARG(out_size);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(hps::DType d, hps::dtype_from_int(hps::capi::raw_enum(dtype)));
    *out_size = hps::dtype_size(d);
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_dtype_name(hps_dtype_t dtype, const char** out_name) {
  HPS_CHECK_ARG(out_name);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(hps::DType d, hps::dtype_from_int(hps::capi::raw_enum(dtype)));
    *out_name = hps::dtype_name(d).data();  // static, NUL-terminated literal
    return hps::Status::Ok();
  });
}

}  // extern "C"
