// Status and StatusOr<T>: how every fallible core function reports failure.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace hps {

// Numeric values equal the C API's hps_status_t (checked by a static_assert in capi/).
enum class StatusCode : int32_t {
  kOk = 0,
  kInvalidArgument = 1,
  kOutOfRange = 2,
  kNotFound = 3,
  kAlreadyExists = 4,
  kFailedPrecondition = 5,
  kUnimplemented = 6,
  kUnavailable = 7,
  kTimeout = 8,
  kAborted = 9,
  kOutOfMemory = 10,
  kInternal = 11,
  kBackendError = 12,
};

std::string_view status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "invalid argument: <message>"
  std::string to_string() const;

  // Returns a copy whose message is "<context>: <message>".
  Status with_context(std::string_view context) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status invalid_argument(std::string m) {
  return {StatusCode::kInvalidArgument, std::move(m)};
}
inline Status out_of_range(std::string m) { return {StatusCode::kOutOfRange, std::move(m)}; }
inline Status not_found(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status already_exists(std::string m) { return {StatusCode::kAlreadyExists, std::move(m)}; }
inline Status failed_precondition(std::string m) {
  return {StatusCode::kFailedPrecondition, std::move(m)};
}
inline Status unimplemented(std::string m) { return {StatusCode::kUnimplemented, std::move(m)}; }
inline Status unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
inline Status timeout_error(std::string m) { return {StatusCode::kTimeout, std::move(m)}; }
inline Status aborted(std::string m) { return {StatusCode::kAborted, std::move(m)}; }
inline Status out_of_memory(std::string m) { return {StatusCode::kOutOfMemory, std::move(m)}; }
inline Status internal_error(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
inline Status backend_error(std::string m) { return {StatusCode::kBackendError, std::move(m)}; }

// A value or the Status saying why there is none. Constructing from an OK Status is a
// bug and turns into an internal error.
template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(T value) : data_(std::move(value)) {}        // NOLINT: implicit by design
  StatusOr(Status status) : data_(std::move(status)) {  // NOLINT: implicit by design
    if (std::get<Status>(data_).ok()) {
      data_ = internal_error("StatusOr constructed from an OK status without a value");
    }
  }

  bool ok() const { return std::holds_alternative<T>(data_); }
  Status status() const { return ok() ? Status::Ok() : std::get<Status>(data_); }

  T& value() & { return std::get<T>(data_); }
  const T& value() const& { return std::get<T>(data_); }
  T&& value() && { return std::get<T>(std::move(data_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<Status, T> data_;
};

}  // namespace hps

#define HPS_STATUS_CONCAT_INNER(a, b) a##b
#define HPS_STATUS_CONCAT(a, b) HPS_STATUS_CONCAT_INNER(a, b)

// Returns the Status of `expr` from the enclosing function when it is not OK.
#define HPS_RETURN_IF_ERROR(expr)                      \
  do {                                                 \
    ::hps::Status hps_status_tmp_ = (expr);            \
    if (!hps_status_tmp_.ok()) return hps_status_tmp_; \
  } while (0)

// `lhs = value of expr`, or returns its Status from the enclosing function.
#define HPS_ASSIGN_OR_RETURN(lhs, expr) \
  HPS_ASSIGN_OR_RETURN_IMPL(HPS_STATUS_CONCAT(hps_statusor_, __LINE__), lhs, expr)
#define HPS_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return tmp.status();             \
  lhs = std::move(tmp).value()
