#include "capi/src/error.h"

#include <string>

namespace hps::capi {
namespace {

thread_local std::string t_last_error;

#define HPS_SAME_VALUE(c, cpp) \
  static_assert(static_cast<int>(c) == static_cast<int>(StatusCode::cpp), #c)
HPS_SAME_VALUE(HPS_STATUS_OK, kOk);
HPS_SAME_VALUE(HPS_STATUS_INVALID_ARGUMENT, kInvalidArgument);
HPS_SAME_VALUE(HPS_STATUS_OUT_OF_RANGE, kOutOfRange);
HPS_SAME_VALUE(HPS_STATUS_NOT_FOUND, kNotFound);
HPS_SAME_VALUE(HPS_STATUS_ALREADY_EXISTS, kAlreadyExists);
HPS_SAME_VALUE(HPS_STATUS_FAILED_PRECONDITION, kFailedPrecondition);
HPS_SAME_VALUE(HPS_STATUS_UNIMPLEMENTED, kUnimplemented);
HPS_SAME_VALUE(HPS_STATUS_UNAVAILABLE, kUnavailable);
HPS_SAME_VALUE(HPS_STATUS_TIMEOUT, kTimeout);
HPS_SAME_VALUE(HPS_STATUS_ABORTED, kAborted);
HPS_SAME_VALUE(HPS_STATUS_OUT_OF_MEMORY, kOutOfMemory);
HPS_SAME_VALUE(HPS_STATUS_INTERNAL, kInternal);
HPS_SAME_VALUE(HPS_STATUS_BACKEND_ERROR, kBackendError);
#undef HPS_SAME_VALUE

}  // namespace

hps_status_t to_c(StatusCode code) { return static_cast<hps_status_t>(code); }

hps_status_t fail(const Status& status) {
  t_last_error = status.message();
  return to_c(status.code());
}

hps_status_t fail_null(const char* function, const char* argument) {
  return fail(invalid_argument(std::string(function) + ": " + argument + " is NULL"));
}

Status forked_error(const char* argument) {
  return failed_precondition(
      std::string(argument) +
      " was made before this process was forked: a handle belongs to the process that made "
      "it (a child has none of its threads); make new ones in the child");
}

hps_status_t fail_forked(const char* function, const char* argument) {
  return fail(forked_error(argument).with_context(function));
}

}  // namespace hps::capi

using hps::capi::raw_enum;
using hps::capi::t_last_error;

extern "C" {

HPS_API const char* hps_status_string(hps_status_t status) {
  switch (raw_enum(status)) {
    case HPS_STATUS_OK:
    case HPS_STATUS_INVALID_ARGUMENT:
    case HPS_STATUS_OUT_OF_RANGE:
    case HPS_STATUS_NOT_FOUND:
    case HPS_STATUS_ALREADY_EXISTS:
    case HPS_STATUS_FAILED_PRECONDITION:
    case HPS_STATUS_UNIMPLEMENTED:
    case HPS_STATUS_UNAVAILABLE:
    case HPS_STATUS_TIMEOUT:
    case HPS_STATUS_ABORTED:
    case HPS_STATUS_OUT_OF_MEMORY:
    case HPS_STATUS_INTERNAL:
    case HPS_STATUS_BACKEND_ERROR:
      // string_view literals from status_code_name are NUL-terminated static text.
      return hps::status_code_name(static_cast<hps::StatusCode>(raw_enum(status))).data();
    default: break;
  }
  return "unknown status";
}

HPS_API const char* hps_last_error_message(void) { return t_last_error.c_str(); }

}  // extern "C"
