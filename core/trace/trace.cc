#include "core/trace/trace.h"

#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <vector>

#include "core/common/env.h"
#include "core/common/logging.h"
#include "core/common/output_file.h"

namespace hps::trace {

namespace detail {
std::atomic<bool> g_recording{false};
}  // namespace detail

namespace {

// Stream tracks get ids above any kernel thread id (pid_max is at most 2^22), so host
// threads can keep theirs.
constexpr int64_t kStreamTrackBase = int64_t{1} << 30;

enum class Kind : uint8_t { kTask, kCollective, kWait, kHostSync, kStep };

struct Event {
  Kind kind;
  int64_t tid;
  uint64_t begin_ns;
  uint64_t end_ns;  // == begin_ns for instants
  std::string name;
  std::string group;  // collectives
  uint64_t a = 0;     // bytes (collective), stage (step), blocked ns (wait)
  uint64_t b = 0;     // sequence (collective), step (step)
};

struct State {
  std::mutex mutex;
  std::string dir;
  std::vector<Event> events;
  std::map<int64_t, std::string> track_names;
  // Tracks of streams destroyed while events naming them wait to be written.
  std::vector<int64_t> retired_tracks;
  size_t max_events = kDefaultMaxEvents;
  uint64_t dropped = 0;
  uint64_t files_written = 0;
  int64_t pid = 0;
  int64_t rank = -1;  // from the environment when the library loaded; -1: none
  std::string job;    // HPS_JOB_ID as shown (shown_value), when the library loaded; or empty
  std::string process_name;
  bool exit_hook = false;
};

// Never destroyed: worker threads may still record while the process exits.
State& state() {
  static State* s = new State;
  return *s;
}

std::atomic<uint32_t> g_next_stream_track{0};
std::atomic<int64_t> g_live_streams{0};
thread_local TaskScope* t_current = nullptr;

int64_t thread_track() {
  thread_local const int64_t tid = static_cast<int64_t>(::syscall(SYS_gettid));
  return tid;
}

// A non-negative integer from an environment variable, or -1 (unset or malformed: the
// variable is outside input, so a bad value only falls back).
int64_t env_rank(const char* name) {
  const auto text = env_string(name);
  if (!text || text->empty()) return -1;
  int64_t v = -1;
  auto [end, ec] = std::from_chars(text->data(), text->data() + text->size(), v);
  if (ec != std::errc() || end != text->data() + text->size() || v < 0 || v >= (int64_t{1} << 30)) {
    HPS_LOG(kWarn) << "trace: " << name << "='" << shown_value(*text)
                   << "' is not a rank; the trace names the process by its id";
    return -1;
  }
  return v;
}

// The row of this process: its rank's when it has one, else its pid's. Its name carries the
// job's id, so the files of two runs in one directory tell which run each is.
void name_process(State& s) {
  const int64_t pid = static_cast<int64_t>(::getpid());
  const std::string job = s.job.empty() ? std::string() : "job " + s.job;
  if (s.rank >= 0) {
    s.pid = s.rank;
    s.process_name = "rank " + std::to_string(s.rank) + " (pid " + std::to_string(pid) +
                     (job.empty() ? "" : ", " + job) + ")";
  } else {
    s.pid = pid;
    s.process_name = "pid " + std::to_string(pid) + (job.empty() ? "" : " (" + job + ")");
  }
}

void identify_process(State& s) {
  s.rank = env_rank("HPS_RANK");
  if (s.rank < 0) s.rank = env_rank("RANK");
  const char* job = std::getenv("HPS_JOB_ID");
  s.job = job != nullptr && *job != '\0' ? shown_value(job) : std::string();
  name_process(s);
}

// The names of retired tracks once no event waits to be written with them.
void forget_retired_tracks(State& s) {
  for (int64_t tid : s.retired_tracks) s.track_names.erase(tid);
  s.retired_tracks.clear();
}

// fork(): the state is copied whole (under its mutex, so no event is half recorded). The
// parent's events are the parent's to write; a child starts with none, under its own pid
// (it writes files of its own only for what it records itself) and on a row of its own,
// named by its pid (the rank's row is the parent's).
void before_fork() { state().mutex.lock(); }
void after_fork_in_parent() { state().mutex.unlock(); }
void after_fork_in_child() {
  State& s = state();
  s.events.clear();
  s.dropped = 0;
  forget_retired_tracks(s);
  s.files_written = 0;
  s.rank = -1;  // the rank is the parent's: the child is its own process row
  name_process(s);
  s.mutex.unlock();
}

void record(Event e) {
  State& s = state();
  std::lock_guard lock(s.mutex);
  if (s.events.size() >= s.max_events) {
    ++s.dropped;
    return;
  }
  if (!s.track_names.count(e.tid)) {
    s.track_names[e.tid] = e.tid < kStreamTrackBase
                               ? "host thread " + std::to_string(e.tid)
                               : "cpu stream " + std::to_string(e.tid - kStreamTrackBase);
  }
  s.events.push_back(std::move(e));
}

void flush_at_exit() {
  if (state().events.empty()) return;
  auto path = flush();
  if (!path.ok()) {
    HPS_LOG(kWarn) << path.status().to_string();
  }
}

nlohmann::json to_json(const Event& e, int64_t pid) {
  nlohmann::json j;
  j["pid"] = pid;
  j["tid"] = e.tid;
  j["ts"] = static_cast<double>(e.begin_ns) / 1000.0;
  j["name"] = e.name;
  switch (e.kind) {
    case Kind::kTask:
      j["ph"] = "X";
      j["cat"] = "task";
      j["dur"] = static_cast<double>(e.end_ns - e.begin_ns) / 1000.0;
      break;
    case Kind::kCollective:
      j["ph"] = "X";
      j["cat"] = "collective";
      j["dur"] = static_cast<double>(e.end_ns - e.begin_ns) / 1000.0;
      j["args"] = {{"bytes", e.a}, {"group", e.group}, {"sequence", e.b}};
      break;
    case Kind::kWait:
      j["ph"] = "X";
      j["cat"] = "dependency wait";
      j["dur"] = static_cast<double>(e.end_ns - e.begin_ns) / 1000.0;
      j["args"] = {{"blocked_ns", e.a}};
      break;
    case Kind::kHostSync:
      j["ph"] = "i";
      j["s"] = "t";
      j["cat"] = "host sync";
      break;
    case Kind::kStep:
      j["ph"] = "i";
      j["s"] = "p";  // a line across the whole process
      j["cat"] = "step";
      j["args"] = {{"stage", e.a}, {"step", e.b}};
      break;
  }
  return j;
}

// The variables are read once, when the library is loaded.
[[maybe_unused]] const bool g_from_environment = [] {
  const auto dir = env_string("HPS_TRACE");
  if (!dir || dir->empty()) return false;
  size_t max_events = kDefaultMaxEvents;
  auto max = env_int("HPS_TRACE_MAX_EVENTS", static_cast<int64_t>(kDefaultMaxEvents));
  if (!max.ok() || *max < 1) {
    HPS_LOG(kWarn) << "trace: HPS_TRACE_MAX_EVENTS is not a positive integer; using "
                   << kDefaultMaxEvents;
  } else {
    max_events = static_cast<size_t>(*max);
  }
  start(*dir, max_events);
  return true;
}();

}  // namespace

uint64_t now_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000u + static_cast<uint64_t>(ts.tv_nsec);
}

uint32_t new_stream_track() { return g_next_stream_track.fetch_add(1, std::memory_order_relaxed); }

void name_track(uint32_t track, std::string name) {
  State& s = state();
  std::lock_guard lock(s.mutex);
  s.track_names[kStreamTrackBase + track] = std::move(name);
}

void retire_track(uint32_t track) {
  State& s = state();
  std::lock_guard lock(s.mutex);
  const int64_t tid = kStreamTrackBase + track;
  if (s.events.empty()) {
    s.track_names.erase(tid);
  } else {
    s.retired_tracks.push_back(tid);
  }
}

TaskScope::TaskScope(uint32_t track, const char* label) noexcept
    : track_(track), label_(label), begin_ns_(now_ns()), outer_(t_current) {
  t_current = this;
}

TaskScope::~TaskScope() {
  t_current = outer_;
  if (!enabled()) return;  // stopped while the task ran
  Event e{is_collective_ ? Kind::kCollective : Kind::kTask,
          kStreamTrackBase + track_,
          begin_ns_,
          now_ns(),
          is_collective_ ? std::move(operation_) : std::string(label_ ? label_ : "task"),
          std::move(group_),
          bytes_,
          sequence_};
  record(std::move(e));
}

void collective(std::string_view operation, uint64_t bytes, std::string_view group,
                uint64_t sequence) {
  TaskScope* scope = t_current;
  if (!scope) return;
  scope->is_collective_ = true;
  scope->operation_ = operation;
  scope->group_ = group;
  scope->bytes_ = bytes;
  scope->sequence_ = sequence;
}

void stream_created() noexcept { g_live_streams.fetch_add(1, std::memory_order_relaxed); }

void stream_destroyed() noexcept {
  if (g_live_streams.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  if (!enabled()) return;
  try {
    auto path = flush();
    if (!path.ok()) {
      HPS_LOG(kWarn) << path.status().to_string();
    }
  } catch (const std::exception& e) {
    HPS_LOG(kWarn) << "trace: writing the timeline failed: " << e.what();
  }
}

namespace {
// The track of an event of the calling thread: the stream whose task it runs, or its own.
int64_t event_track() {
  const TaskScope* scope = t_current;
  return scope ? kStreamTrackBase + scope->track() : thread_track();
}
}  // namespace

void host_sync(std::string_view kind) {
  if (!enabled()) return;
  const uint64_t t = now_ns();
  Event e{Kind::kHostSync, 0, t, t, "host sync: " + std::string(kind), {}, 0, 0};
  e.tid = event_track();
  record(std::move(e));
}

void dependency_wait(uint64_t nanoseconds) {
  if (!enabled()) return;
  const uint64_t end = now_ns();
  const uint64_t begin = end > nanoseconds ? end - nanoseconds : 0;
  Event e{Kind::kWait, 0, begin, end, "dependency wait", {}, nanoseconds, 0};
  e.tid = event_track();
  record(std::move(e));
}

void step_boundary(int32_t stage, int64_t step) {
  if (!enabled()) return;
  const uint64_t t = now_ns();
  Event e{Kind::kStep,
          0,
          t,
          t,
          "step " + std::to_string(step),
          {},
          static_cast<uint64_t>(stage),
          static_cast<uint64_t>(step)};
  e.tid = event_track();
  record(std::move(e));
}

void start(std::string dir, size_t max_events) {
  State& s = state();
  // A relative directory is taken from the working directory of now, not of when a file is
  // written.
  std::error_code ec;
  if (auto absolute = std::filesystem::absolute(dir, ec); !ec) dir = absolute.string();
  {
    std::lock_guard lock(s.mutex);
    s.dir = std::move(dir);
    if (max_events) s.max_events = max_events;
    if (s.process_name.empty()) identify_process(s);
    if (!s.exit_hook) {
      s.exit_hook = true;
      std::atexit(flush_at_exit);
      (void)::pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child);
    }
  }
  detail::g_recording.store(true, std::memory_order_relaxed);
}

void stop() { detail::g_recording.store(false, std::memory_order_relaxed); }

void clear() {
  State& s = state();
  std::lock_guard lock(s.mutex);
  s.events.clear();
  s.dropped = 0;
  forget_retired_tracks(s);
}

size_t event_count() {
  State& s = state();
  std::lock_guard lock(s.mutex);
  return s.events.size();
}

size_t track_name_count() {
  State& s = state();
  std::lock_guard lock(s.mutex);
  return s.track_names.size();
}

namespace {

// This process: a random number drawn once, and the pid (a forked child differs).
std::string process_id() {
  static const uint64_t drawn = [] {
    std::random_device device;
    return (static_cast<uint64_t>(device()) << 32) ^ device();
  }();
  char text[48];
  std::snprintf(text, sizeof text, "%016llx-%lld", static_cast<unsigned long long>(drawn),
                static_cast<long long>(::getpid()));
  return text;
}

}  // namespace

StatusOr<std::string> flush() {
  State& s = state();
  std::vector<Event> events;
  std::map<int64_t, std::string> names;
  std::string dir;
  uint64_t dropped = 0;
  uint64_t index = 0;
  int64_t pid = 0;
  std::string process_name;
  {
    std::lock_guard lock(s.mutex);
    if (s.events.empty() && s.dropped == 0) return std::string();
    if (s.dir.empty()) return failed_precondition("trace: no directory to write to (HPS_TRACE)");
    events.swap(s.events);
    names = s.track_names;
    forget_retired_tracks(s);  // named in this file
    dir = s.dir;
    dropped = s.dropped;
    s.dropped = 0;
    index = s.files_written++;
    pid = s.pid;
    process_name = s.process_name;
  }
  // The metadata: a few entries per track.
  std::vector<nlohmann::json> metadata;
  // The row's process, told apart from a process of the same name and pid in another pid
  // namespace or on another host (the merge refuses two processes on one row).
  metadata.push_back({{"ph", "M"},
                      {"name", "process_name"},
                      {"pid", pid},
                      {"tid", 0},
                      {"args", {{"name", process_name}, {"hpshard_process", process_id()}}}});
  metadata.push_back({{"ph", "M"},
                      {"name", "process_sort_index"},
                      {"pid", pid},
                      {"tid", 0},
                      {"args", {{"sort_index", pid}}}});
  for (const auto& [tid, name] : names) {
    metadata.push_back({{"ph", "M"},
                        {"name", "thread_name"},
                        {"pid", pid},
                        {"tid", tid},
                        {"args", {{"name", name}}}});
    // Host threads first, then the streams in creation order.
    metadata.push_back(
        {{"ph", "M"},
         {"name", "thread_sort_index"},
         {"pid", pid},
         {"tid", tid},
         {"args", {{"sort_index", tid >= kStreamTrackBase ? tid - kStreamTrackBase + 1000 : 0}}}});
  }
  const nlohmann::json other = {{"producer", "hpshard"},
                                {"clock", "CLOCK_MONOTONIC"},
                                {"process", process_name},
                                {"dropped_events", dropped}};
  // One document, written event by event: the file's text is never held whole (millions of
  // events make hundreds of MiB of it).
  auto produce = [&](const auto& put) {
    put("{\"traceEvents\":[");
    bool first = true;
    auto entry = [&](const nlohmann::json& j) {
      if (!first) put(",\n");
      first = false;
      put(j.dump());
    };
    for (const auto& m : metadata) entry(m);
    for (const Event& e : events) entry(to_json(e, pid));
    put("],\n\"displayTimeUnit\":\"ms\",\"otherData\":");
    put(other.dump());
    put("}\n");
  };

  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return unavailable("trace: cannot create the directory '" + shown_path(dir) +
                       "' (HPS_TRACE): " + ec.message());
  }
  const std::string stem =
      (std::filesystem::path(dir) /
       ("hpshard-trace-" +
        (process_name.rfind("rank ", 0) == 0 ? "rank" + std::to_string(pid) + "-" : std::string()) +
        "pid" + std::to_string(::getpid()) + "-" + std::to_string(index)))
          .string();
  // Written under a temporary name of this process's own, then published whole under the
  // first free name of STEM.json, STEM.1.json, ...: a process of another pid namespace
  // (containers sharing the directory) or of another host can have this pid.
  std::string temporary;
  if (std::string error = write_beside_target_from(stem + ".json", produce, &temporary);
      !error.empty()) {
    return unavailable("trace: " + error);
  }
  for (int n = 0; n < 10'000; ++n) {
    const std::string path = stem + (n == 0 ? std::string() : "." + std::to_string(n)) + ".json";
    int err = place_new(temporary, path);
    if (placing_unsupported(err)) {
      // Neither hard links nor a rename that replaces nothing: a rename where nothing is.
      err = std::filesystem::exists(std::filesystem::symlink_status(path, ec))
                ? EEXIST
                : (std::rename(temporary.c_str(), path.c_str()) == 0 ? 0 : errno);
    }
    if (err == 0) return path;
    if (err != EEXIST) {
      (void)::unlink(temporary.c_str());
      return unavailable("trace: cannot publish '" + shown_path(temporary) + "' as '" +
                         shown_path(path) + "': " + std::strerror(err));
    }
  }
  (void)::unlink(temporary.c_str());
  return unavailable("trace: every name from '" + shown_path(stem) + ".json' on is taken");
}

}  // namespace hps::trace
