// Shared by every C API source file: Status → hps_status_t, the thread-local message,
// and the guard that keeps exceptions from crossing the C boundary.
#pragma once

#include <cstdint>
#include <cstring>
#include <exception>
#include <new>

#include "core/common/status.h"
#include "hpshard/hpshard.h"

namespace hps::capi {

// Records `status`'s message as the thread's last error and returns its C code.
hps_status_t fail(const Status& status);
// Shorthand for the argument checks at the top of every function.
hps_status_t fail_null(const char* function, const char* argument);
hps_status_t to_c(StatusCode code);

// The integer a caller passed for a C enum parameter. C callers may pass any int
// (a newer header, a bad cast); in C++ loading an out-of-range enum value is undefined,
// so the bytes are copied out instead of read as the enum type.
template <typename Enum>
int32_t raw_enum(const Enum& value) {
  static_assert(sizeof(Enum) == sizeof(int32_t));
  int32_t raw;
  std::memcpy(&raw, &value, sizeof raw);
  return raw;
}

// Runs `body` (returning Status); turns exceptions into C statuses.
template <typename Body>
hps_status_t guard(const char* function, Body&& body) noexcept {
  try {
    Status s = body();
    if (s.ok()) return HPS_STATUS_OK;
    return fail(s.with_context(function));
  } catch (const std::bad_alloc&) {
    return fail(out_of_memory(std::string(function) + ": allocation failed"));
  } catch (const std::exception& e) {
    return fail(internal_error(std::string(function) + ": unexpected exception: " + e.what()));
  } catch (...) {
    return fail(internal_error(std::string(function) + ": unexpected unknown exception"));
  }
}

}  // namespace hps::capi

#define HPS_CHECK_ARG(arg)                                               \
  do {                                                                   \
    if ((arg) == nullptr) return ::hps::capi::fail_null(__func__, #arg); \
  } while (0)
