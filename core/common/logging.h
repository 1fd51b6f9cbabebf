// Leveled logging to stderr. The level comes from HPS_LOG_LEVEL (trace, debug, info,
// warn, error, off, or 0..5); the default is warn.
#pragma once

#include <sstream>
#include <string_view>

namespace hps {

enum class LogLevel : int { kTrace = 0, kDebug = 1, kInfo = 2, kWarn = 3, kError = 4, kOff = 5 };

LogLevel log_level();
void set_log_level(LogLevel level);
// Parses a level name or number; returns false and leaves *out alone when unknown.
bool parse_log_level(std::string_view text, LogLevel* out);

// One log line; written (atomically, as one write) when it is destroyed.
class LogLine {
 public:
  LogLine(LogLevel level, const char* file, int line);
  ~LogLine();
  LogLine(const LogLine&) = delete;
  LogLine& operator=(const LogLine&) = delete;
  std::ostream& stream() { return out_; }

 private:
  std::ostringstream out_;
};

}  // namespace hps

#define HPS_LOG(level)                               \
  if (::hps::LogLevel::level < ::hps::log_level()) { \
  } else                                             \
    ::hps::LogLine(::hps::LogLevel::level, __FILE__, __LINE__).stream()
