// Which host and process this is, and whether another process of this host still runs:
// what stores and shared-memory segments left by a crashed run are told apart by.
#pragma once

#include <cstdint>
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

// Whether process `pid` has ended: gone, or a zombie its parent has not reaped yet.
bool process_ended(int32_t pid);

// Whether the process `pid` that started at `start_time` (0: any) still runs here.
bool process_running(int32_t pid, uint64_t start_time);

}  // namespace hps::host
