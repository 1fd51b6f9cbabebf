#include "core/common/env.h"

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <nlohmann/json.hpp>

namespace hps {

std::string shown_value(std::string_view text) {
  constexpr size_t kShown = 64;
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < text.size() && i < kShown; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  if (text.size() > kShown) out += "... (" + std::to_string(text.size()) + " bytes)";
  return out;
}

bool has_control_bytes(std::string_view text) {
  for (const char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if (c < 0x20 || c == 0x7f) return true;
  }
  return false;
}

size_t utf8_prefix_bytes(std::string_view text, size_t max_bytes) {
  size_t keep = std::min(text.size(), max_bytes);
  // A UTF-8 continuation byte (10xxxxxx) is no character's start.
  while (keep > 0 && keep < text.size() &&
         (static_cast<unsigned char>(text[keep]) & 0xC0) == 0x80) {
    --keep;
  }
  return keep;
}

bool is_utf8(std::string_view text) {
  // nlohmann-json's strict dump is the writer of every manifest: what it accepts is what a
  // manifest can hold (its decoder refuses overlong forms, surrogates and code points past
  // U+10FFFF).
  try {
    (void)nlohmann::json(std::string(text)).dump();
    return true;
  } catch (const nlohmann::json::type_error&) {
    return false;
  }
}

Status check_shown_name(std::string_view name, std::string_view what, size_t max_bytes) {
  const std::string who(what);
  if (name.empty()) return invalid_argument(who + " is empty");
  const std::string shown = who + " '" + shown_value(name) + "'";
  if (name.size() > max_bytes) {
    return invalid_argument(shown + " has " + std::to_string(name.size()) + " bytes, more than " +
                            std::to_string(max_bytes));
  }
  if (has_control_bytes(name)) return invalid_argument(shown + " has a control character");
  if (!is_utf8(name)) return invalid_argument(shown + " is not valid UTF-8");
  return Status::Ok();
}

std::optional<std::string> env_string(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

StatusOr<int64_t> env_int(const char* name, int64_t fallback) {
  auto text = env_string(name);
  if (!text) return fallback;
  int64_t value = 0;
  const char* first = text->data();
  const char* last = first + text->size();
  auto [end, error] = std::from_chars(first, last, value);
  if (error != std::errc() || end != last || text->empty()) {
    return invalid_argument(std::string("environment variable ") + name + "='" +
                            shown_value(*text) + "' is not an integer");
  }
  return value;
}

StatusOr<int64_t> env_int_in(const char* name, int64_t fallback, int64_t min, int64_t max) {
  HPS_ASSIGN_OR_RETURN(int64_t value, env_int(name, fallback));
  if (value < min || value > max) {
    return invalid_argument(std::string("environment variable ") + name + "=" +
                            std::to_string(value) + " is outside [" + std::to_string(min) + ", " +
                            std::to_string(max) + "]");
  }
  return value;
}

StatusOr<bool> env_flag(const char* name, bool fallback) {
  auto text = env_string(name);
  if (!text) return fallback;
  if (*text == "0") return false;
  if (*text == "1") return true;
  return invalid_argument(std::string("environment variable ") + name + "='" + shown_value(*text) +
                          "' is not 0 or 1");
}

}  // namespace hps
