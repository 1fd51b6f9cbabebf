// Shared by every C API source file: Status → hps_status_t, the thread-local message,
// and the guard that keeps exceptions from crossing the C boundary.
#pragma once

#include <cstdint>
#include <cstring>
#include <exception>
#include <new>
#include <type_traits>

#include "core/common/fork_generation.h"
#include "core/common/status.h"
#include "hpshard/hpshard.h"

namespace hps::capi {

// Records `status`'s message as the thread's last error and returns its C code.
hps_status_t fail(const Status& status);
// Shorthand for the argument checks at the top of every function.
hps_status_t fail_null(const char* function, const char* argument);
// FAILED_PRECONDITION for a handle made before a fork(), passed in the child.
Status forked_error(const char* argument);
hps_status_t fail_forked(const char* function, const char* argument);

// A handle belongs to the process that made it (each records fork_generation() in `born`):
// in a forked child its threads are absent, so a handle made before the fork is refused
// there, and its destroy leaves it alone.
template <typename Handle>
bool made_before_fork(const Handle* handle) {
  return handle->born != fork_generation();
}

// A destroy's first check: in a forked child a handle made before the fork is left as it is
// (freeing it would wait for threads the child does not have, or take locks they held);
// the destroy then returns OK having freed nothing.
template <typename Handle>
bool left_to_parent(const Handle* handle) {
  return handle != nullptr && made_before_fork(handle);
}

// HPS_CHECK_ARG's check: not NULL, and a handle (a pointer to a struct with `born`) made in
// this process. The pointee must be complete, so that no handle skips the second check.
template <typename T>
hps_status_t check_arg(const char* function, const char* argument, const T& arg) {
  if (arg == nullptr) return fail_null(function, argument);
  if constexpr (std::is_pointer_v<T>) {
    using Pointee = std::remove_cv_t<std::remove_pointer_t<T>>;
    if constexpr (std::is_class_v<Pointee>) {
      static_assert(sizeof(Pointee) > 0, "a handle argument of an incomplete type");
      if constexpr (requires { arg->born; }) {
        if (made_before_fork(arg)) return fail_forked(function, argument);
      }
    }
  }
  return HPS_STATUS_OK;
}
// The same for an argument that may be NULL.
template <typename T>
hps_status_t check_optional_arg(const char* function, const char* argument, const T& arg) {
  return arg == nullptr ? HPS_STATUS_OK : check_arg(function, argument, arg);
}
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

#define HPS_CHECK_ARG(arg)                                                                  \
  do {                                                                                      \
    if (const hps_status_t hps_arg_status_ = ::hps::capi::check_arg(__func__, #arg, (arg)); \
        hps_arg_status_ != HPS_STATUS_OK)                                                   \
      return hps_arg_status_;                                                               \
  } while (0)
// For a handle argument that may be NULL (an optional stream or communicator).
#define HPS_CHECK_OPTIONAL_ARG(arg)                                 \
  do {                                                              \
    if (const hps_status_t hps_arg_status_ =                        \
            ::hps::capi::check_optional_arg(__func__, #arg, (arg)); \
        hps_arg_status_ != HPS_STATUS_OK)                           \
      return hps_arg_status_;                                       \
  } while (0)
