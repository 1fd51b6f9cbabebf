// The timeline: with HPS_TRACE=DIR, every process records what its streams ran and what
// its threads waited for, and writes it as a Chrome-trace JSON file into DIR (opens in
// Perfetto and chrome://tracing; `hpshard-trace merge` joins the ranks' files into one).
//
//   - one track per stream: every task with its start and end, named by the label it was
//     enqueued with ("task" when none); a collective's task carries its operation, bytes,
//     group and sequence number;
//   - on the calling thread's track: dependency waits (with their duration), host syncs
//     and step boundaries.
//
// The process is the rank (HPS_RANK, else torchrun's RANK, else the process id); host
// threads keep their kernel thread id as track id, so a framework's own spans written
// with the same ids (hpshard.torch does) land on the same rows.
//
// A file is written when the last CPU stream of the process is destroyed (the end of a
// run: its communicators and engines are gone) and at exit, each time with the events
// recorded since the last file; it is written event by event, never held whole. A forked
// child starts with no events, named by its own pid. Off (HPS_TRACE unset or empty) every hook
// costs one relaxed atomic load. HPS_TRACE_MAX_EVENTS (default 2,000,000) bounds the events kept in
// memory; later ones are counted as dropped in the file's metadata.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/common/status.h"

namespace hps::trace {

namespace detail {
extern std::atomic<bool> g_recording;
}  // namespace detail

// Whether events are recorded now. Every hook checks this first.
inline bool enabled() noexcept { return detail::g_recording.load(std::memory_order_relaxed); }

// ---- tracks ----------------------------------------------------------------------------
// A new stream track's id (cheap: a counter; named "cpu stream N" until named).
uint32_t new_stream_track();
// The name the viewer shows for a stream track ("communicator 'sharding' rank 1 of 4").
void name_track(uint32_t track, std::string name);
// The stream of `track` is gone: its name is forgotten once no recorded event needs it (at
// once, or after the next file names it), so a process making many streams keeps no name
// per stream it ever made.
void retire_track(uint32_t track);

// ---- the stream runner's hooks ---------------------------------------------------------
// While alive, a task of stream track `track` runs on this thread: its span is recorded
// when the scope ends. `label` must be a static string (or null: "task"). Construct only
// when enabled().
class TaskScope {
 public:
  TaskScope(uint32_t track, const char* label) noexcept;
  ~TaskScope();
  TaskScope(const TaskScope&) = delete;
  TaskScope& operator=(const TaskScope&) = delete;
  uint32_t track() const { return track_; }

 private:
  friend void collective(std::string_view, uint64_t, std::string_view, uint64_t);
  uint32_t track_;
  const char* label_;
  uint64_t begin_ns_;
  TaskScope* outer_;
  // Set by collective() from inside the task.
  std::string operation_, group_;
  uint64_t bytes_ = 0;
  uint64_t sequence_ = 0;
  bool is_collective_ = false;
};

// Called from inside a running task: the task is this collective.
void collective(std::string_view operation, uint64_t bytes, std::string_view group,
                uint64_t sequence);

// Streams alive in the process: when the last one goes, the recorded events are written.
void stream_created() noexcept;
void stream_destroyed() noexcept;

// ---- events on the calling thread (the stream's track while it runs a stream's task) -------
void host_sync(std::string_view kind);
// A dependency wait that ends now and blocked for `nanoseconds`.
void dependency_wait(uint64_t nanoseconds);
// An engine's step() was called: the boundary between training steps.
void step_boundary(int32_t stage, int64_t step);

// ---- control (tests and benchmarks; HPS_TRACE does the same at load) -------------------
inline constexpr size_t kDefaultMaxEvents = 2'000'000;
// Record from now on; files go to `dir` (created when missing). `max_events` (0: keep the
// current bound) bounds the events held until the next file.
void start(std::string dir, size_t max_events = 0);
// Stop recording; what was recorded stays until flush() or clear().
void stop();
void clear();
size_t event_count();
// Track names held (streams alive or named by events not yet written, and host threads).
size_t track_name_count();
// Writes the events recorded so far to a new file in the directory given to start() (or
// HPS_TRACE) and forgets them; returns the file's path ("" when there was nothing to
// write). Errors name the file.
StatusOr<std::string> flush();

// Monotonic clock in nanoseconds (CLOCK_MONOTONIC, the clock of Python's
// time.monotonic_ns()): the time base of every event.
uint64_t now_ns();

}  // namespace hps::trace
