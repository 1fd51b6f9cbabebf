#include "core/common/logging.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <string>

#include "core/common/env.h"

namespace hps {
namespace {

LogLevel level_from_environment() {
  LogLevel level = LogLevel::kWarn;
  if (auto text = env_string("HPS_LOG_LEVEL")) {
    if (!parse_log_level(*text, &level)) {
      std::fprintf(stderr, "[hpshard] HPS_LOG_LEVEL='%s' is not a level; using warn\n",
                   shown_value(*text).c_str());
    }
  }
  return level;
}

std::atomic<int>& level_storage() {
  static std::atomic<int> level{static_cast<int>(level_from_environment())};
  return level;
}

constexpr char kLevelLetters[] = {'T', 'D', 'I', 'W', 'E', 'O'};

}  // namespace

LogLevel log_level() {
  return static_cast<LogLevel>(level_storage().load(std::memory_order_relaxed));
}

void set_log_level(LogLevel level) {
  level_storage().store(static_cast<int>(level), std::memory_order_relaxed);
}

bool parse_log_level(std::string_view text, LogLevel* out) {
  static constexpr std::string_view kNames[] = {"trace", "debug", "info", "warn", "error", "off"};
  for (int i = 0; i < 6; ++i) {
    if (text == kNames[i] || (text.size() == 1 && text[0] == '0' + i) ||
        (i == 3 && text == "warning")) {
      *out = static_cast<LogLevel>(i);
      return true;
    }
  }
  return false;
}

LogLine::LogLine(LogLevel level, const char* file, int line) {
  const auto now = std::chrono::system_clock::now();
  const std::time_t seconds = std::chrono::system_clock::to_time_t(now);
  const auto millis =
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm tm_utc{};
  gmtime_r(&seconds, &tm_utc);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%H:%M:%S", &tm_utc);
  std::string_view path(file);
  if (auto slash = path.rfind('/'); slash != std::string_view::npos) path.remove_prefix(slash + 1);
  char millis_text[8];
  std::snprintf(millis_text, sizeof millis_text, ".%03d", static_cast<int>(millis));
  out_ << "[hpshard " << kLevelLetters[static_cast<int>(level)] << ' ' << stamp << millis_text
       << ' ' << getpid() << ' ' << path << ':' << line << "] ";
}

LogLine::~LogLine() {
  out_ << '\n';
  const std::string text = out_.str();
  // One write call so lines of concurrent threads and ranks do not interleave.
  [[maybe_unused]] ssize_t written = ::write(STDERR_FILENO, text.data(), text.size());
}

}  // namespace hps
