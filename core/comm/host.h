// Which host and process this is, and whether another process of this host still runs:
// what stores and shared-memory segments left by a crashed run are told apart by.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace hps::host {

// "hostname/boot id/pid namespace": equal only for processes whose pids can be checked
// against each other (the same machine, the same boot, the same pid namespace).
std::string identity();

// The pid namespace of this process (its /proc/self/ns/pid inode), 0 when unknown.
uint64_t pid_namespace();

// When process `pid` started, in clock ticks after boot (/proc/PID/stat); 0 when unknown.
// With the pid it names one process: a pid reused later has another start time.
uint64_t process_start_time(int32_t pid);

// Whether process `pid` has ended: gone, or a zombie its parent has not reaped yet (not one
// whose main thread alone has ended, pthread_exit, while other threads run).
bool process_ended(int32_t pid);

// Whether the process `pid` that started at `start_time` (0: any) still runs here.
bool process_running(int32_t pid, uint64_t start_time);

// A process as another process can check it: its host's identity(), its pid and when it
// started. Travels through stores as "host H", "pid P" and "start S" lines.
struct Process {
  std::string host;
  int32_t pid = 0;
  uint64_t start = 0;

  // This process.
  static Process self();
  std::string encode() const;
  // The three fields from `text`'s "name value" lines (other lines are ignored: a caller's
  // own fields, a later version's); nullopt when one is missing or malformed.
  static std::optional<Process> parse(const std::string& text);

  bool on_this_host() const { return host == identity(); }
  // Provably ended: a process of this host that is gone (a pid reused since has another
  // start time). A process elsewhere cannot be checked from here.
  bool ended() const { return on_this_host() && !process_running(pid, start); }
  // "process P on this host", or "process P on host NAME".
  std::string describe() const;
};

}  // namespace hps::host
