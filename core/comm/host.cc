#include "core/comm/host.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string_view>

namespace hps::host {
namespace {

// The fields of /proc/PID/stat after the command name (which may hold spaces and ')').
std::string stat_fields(int32_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  std::getline(in, stat);
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos || paren + 2 >= stat.size()) return {};
  return stat.substr(paren + 2);
}

}  // namespace

uint64_t pid_namespace() {
  struct stat st {};
  return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

std::string identity() {
  char name[256] = {};
  ::gethostname(name, sizeof(name) - 1);
  std::string boot;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::getline(in, boot);
  return std::string(name) + "/" + boot + "/" + std::to_string(pid_namespace());
}

uint64_t process_start_time(int32_t pid) {
  // Field 22 of stat is the start time; the fields here begin at field 3 (the state).
  std::istringstream fields(stat_fields(pid));
  std::string field;
  for (int i = 3; i <= 22; ++i) {
    if (!(fields >> field)) return 0;
  }
  return std::strtoull(field.c_str(), nullptr, 10);
}

bool process_ended(int32_t pid) {
  if (pid <= 0) return true;
  if (::kill(pid, 0) != 0 && errno == ESRCH) return true;
  const std::string fields = stat_fields(pid);
  if (fields.empty()) return false;  // unreadable: assume it runs
  if (fields[0] == 'X') return true;
  if (fields[0] != 'Z') return false;
  // A zombie main thread whose process lives on in its other threads (it called
  // pthread_exit) shows Z too: the process has ended only when no other thread is left.
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("Threads:", 0) == 0) return std::atol(line.c_str() + 8) <= 1;
  }
  return true;
}

bool process_running(int32_t pid, uint64_t start_time) {
  if (process_ended(pid)) return false;
  if (start_time == 0) return true;
  const uint64_t now = process_start_time(pid);
  return now == 0 || now == start_time;
}

Process Process::self() {
  Process p;
  p.host = identity();
  p.pid = static_cast<int32_t>(::getpid());
  p.start = process_start_time(p.pid);
  return p;
}

std::string Process::encode() const {
  return "host " + host + "\npid " + std::to_string(pid) + "\nstart " + std::to_string(start) +
         "\n";
}

std::optional<Process> Process::parse(const std::string& text) {
  Process p;
  bool has_host = false, has_pid = false, has_start = false;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    const size_t space = line.find(' ');
    if (space == std::string::npos) continue;
    const std::string_view name(line.data(), space);
    const std::string_view value(line.data() + space + 1, line.size() - space - 1);
    auto number = [&](auto* out) {
      auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), *out);
      return error == std::errc() && end == value.data() + value.size();
    };
    if (name == "host") {
      p.host = std::string(value);
      has_host = true;
    } else if (name == "pid") {
      if (!number(&p.pid)) return std::nullopt;
      has_pid = true;
    } else if (name == "start") {
      if (!number(&p.start)) return std::nullopt;
      has_start = true;
    }
  }
  if (!has_host || !has_pid || !has_start) return std::nullopt;
  return p;
}

std::string Process::describe() const {
  std::string d = "process " + std::to_string(pid);
  return on_this_host() ? d + " on this host" : d + " on host " + host.substr(0, host.find('/'));
}

}  // namespace hps::host
