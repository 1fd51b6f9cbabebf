#include "core/common/env.h"

#include <charconv>
#include <cstdlib>

namespace hps {

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
    return invalid_argument(std::string("environment variable ") + name + "='" + *text +
                            "' is not an integer");
  }
  return value;
}

}  // namespace hps
