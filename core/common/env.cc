#include "core/common/env.h"

#include <charconv>
#include <cstdlib>

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

bool is_utf8(std::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    // The sequence's length and the range its second byte must lie in (RFC 3629, table 3-7
    // of the Unicode standard): that range excludes overlong forms and surrogates.
    size_t length = 0;
    unsigned char low = 0x80, high = 0xbf;
    if (c >= 0xc2 && c <= 0xdf) {
      length = 2;
    } else if (c >= 0xe0 && c <= 0xef) {
      length = 3;
      if (c == 0xe0) low = 0xa0;
      if (c == 0xed) high = 0x9f;
    } else if (c >= 0xf0 && c <= 0xf4) {
      length = 4;
      if (c == 0xf0) low = 0x90;
      if (c == 0xf4) high = 0x8f;
    } else {
      return false;
    }
    if (text.size() - i < length) return false;
    const auto second = static_cast<unsigned char>(text[i + 1]);
    if (second < low || second > high) return false;
    for (size_t k = 2; k < length; ++k) {
      const auto next = static_cast<unsigned char>(text[i + k]);
      if (next < 0x80 || next > 0xbf) return false;
    }
    i += length;
  }
  return true;
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
  return invalid_argument(std::string("environment variable ") + name + "='" + *text +
                          "' is not 0 or 1");
}

}  // namespace hps
