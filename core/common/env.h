// Reading configuration from environment variables.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "core/common/shown_path.h"  // escape_control_bytes, shown_path
#include "core/common/status.h"

namespace hps {

// A value read from outside, for an error message: at most 64 of its bytes, those outside
// printable ASCII as \xNN, and its length when it was cut.
std::string shown_value(std::string_view text);
// Whether `text` holds a control character (a byte below 0x20, or 0x7f): names that
// messages and tools show (parameters, checkpoint tensors) may not.
bool has_control_bytes(std::string_view text);
// Whether `text` is well-formed UTF-8 (no overlong forms, surrogates or code points past
// U+10FFFF): names and metadata a checkpoint's JSON manifest keeps must be.
bool is_utf8(std::string_view text);
// The length of the longest prefix of `text` within `max_bytes` that ends at a UTF-8
// character's start (a cut there splits no character).
size_t utf8_prefix_bytes(std::string_view text, size_t max_bytes);
// A name that messages, logs and manifests show (a parameter's, a group's): INVALID_ARGUMENT
// starting with `what` ("parameter name") when it is empty, longer than `max_bytes`, holds
// a control character or is not UTF-8.
Status check_shown_name(std::string_view name, std::string_view what, size_t max_bytes);
// The variable's value, or nothing when it is unset (an empty value counts as set).
std::optional<std::string> env_string(const char* name);
// The variable as a base-10 integer; `fallback` when unset; an error naming the
// variable when it is set but not an integer.
StatusOr<int64_t> env_int(const char* name, int64_t fallback);
// env_int within [min, max]; an error naming the variable and the range otherwise.
StatusOr<int64_t> env_int_in(const char* name, int64_t fallback, int64_t min, int64_t max);
// A switch: 0 or 1 (anything else is an error naming the variable); `fallback` when unset.
StatusOr<bool> env_flag(const char* name, bool fallback);

}  // namespace hps
