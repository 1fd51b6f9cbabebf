// Text from outside (a path, a value) made safe to print in a message. Header-only: the
// tools that link no hpshard library (hpshard-trace) use it too.
#pragma once

#include <string>
#include <string_view>

namespace hps {

// `text` with its control bytes (below 0x20, 0x7f) as \xNN and, with `backslashes`, each
// backslash doubled: a value from outside shown this way cannot move a terminal's cursor or
// change its colours. Other bytes (UTF-8) pass.
inline std::string escape_control_bytes(std::string_view text, bool backslashes) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(text.size());
  for (const char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '\\' && backslashes) {
      out += "\\\\";
    } else if (c < 0x20 || c == 0x7f) {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += ch;
    }
  }
  return out;
}

// A path for an error message: whole, escape_control_bytes(path, true).
inline std::string shown_path(std::string_view path) { return escape_control_bytes(path, true); }

}  // namespace hps
