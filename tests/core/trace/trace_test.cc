#include "core/trace/trace.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "core/device/cpu/stream.h"
#include "core/device/host_sync.h"
#include "core/sharding/stage2_engine.h"
#include "core/sharding/stage3_engine.h"
#include "tests/core/comm/comm_test_util.h"
#include "tests/support/sanitized.h"

namespace hps {
namespace {

using nlohmann::json;

class TraceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("hpshard-trace-test-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    trace::stop();
    trace::clear();
  }
  void TearDown() override {
    trace::stop();
    trace::clear();
    std::filesystem::remove_all(dir_);
  }
  static json read(const std::string& path) {
    std::ifstream in(path);
    return json::parse(in);
  }
  std::vector<std::filesystem::path> files() const {
    std::vector<std::filesystem::path> out;
    if (!std::filesystem::exists(dir_)) return out;
    for (const auto& entry : std::filesystem::directory_iterator(dir_)) out.push_back(entry.path());
    return out;
  }
  // The name the trace gives track `tid`.
  static std::string track_name(const json& trace, int64_t tid) {
    for (const auto& e : trace["traceEvents"]) {
      if (e["ph"] == "M" && e["name"] == "thread_name" && e["tid"] == tid) {
        return e["args"]["name"];
      }
    }
    return {};
  }
  std::filesystem::path dir_;
};

TEST_F(TraceTest, OffRecordsNothing) {
  cpu::CpuStream stream;
  int ran = 0;
  stream.enqueue([&] { ++ran; }, "kernel");
  ASSERT_TRUE(stream.synchronize().ok());
  count_dependency_wait(1000);
  trace::step_boundary(2, 0);
  EXPECT_EQ(ran, 1);
  EXPECT_EQ(trace::event_count(), 0u);
  auto path = trace::flush();
  ASSERT_TRUE(path.ok());
  EXPECT_EQ(*path, "");  // nothing to write
}

// A process that makes and destroys many streams (engines created in a loop) keeps no name
// per stream it ever made: off, a stream's name goes with it; on, after the file naming it.
TEST_F(TraceTest, ADestroyedStreamsNameIsForgotten) {
  const size_t before = trace::track_name_count();
  for (int i = 0; i < 50; ++i) {
    cpu::CpuStream stream;
    stream.set_trace_name("engine stream " + std::to_string(i));
    stream.enqueue([] {}, "kernel");
    ASSERT_TRUE(stream.synchronize().ok());
  }
  EXPECT_EQ(trace::track_name_count(), before) << "off";

  trace::start(dir_.string());
  int64_t tid = -1;
  {
    cpu::CpuStream keeper;  // the last stream's end would write the file itself
    keeper.set_trace_name("keeper");
    {
      cpu::CpuStream stream;
      stream.set_trace_name("gone before the file");
      stream.enqueue([] {}, "kernel");
      ASSERT_TRUE(stream.synchronize().ok());
    }
    EXPECT_GT(trace::track_name_count(), before) << "named by an event not yet written";
    trace::stop();
    auto path = trace::flush();
    ASSERT_TRUE(path.ok()) << path.status().to_string();
    const json t = read(*path);
    for (const auto& e : t["traceEvents"]) {
      if (e["ph"] == "X" && e["name"] == "kernel") tid = e["tid"];
    }
    ASSERT_GE(tid, 0);
    EXPECT_EQ(track_name(t, tid), "gone before the file");
    // The keeper and the calling thread (its host sync) keep their names.
    EXPECT_EQ(trace::track_name_count(), before + 2);
  }
  EXPECT_EQ(trace::track_name_count(), before + 1) << "the keeper's name went with it";
}

TEST_F(TraceTest, StreamTasksWaitsSyncsAndStepsLandOnTheirTracks) {
  trace::start(dir_.string());
  cpu::CpuStream stream;
  stream.set_trace_name("my stream");
  stream.enqueue([] { std::this_thread::sleep_for(std::chrono::milliseconds(5)); }, "kernel");
  stream.enqueue([] {});  // unlabelled
  char a[16] = {1}, b[16] = {};
  ASSERT_TRUE(stream.memcpy_async(b, a, sizeof a).ok());
  ASSERT_TRUE(stream.synchronize().ok());  // a host sync on this thread
  count_dependency_wait(2'000'000);
  trace::step_boundary(3, 7);
  trace::stop();
  auto path = trace::flush();
  ASSERT_TRUE(path.ok()) << path.status().to_string();
  ASSERT_FALSE(path->empty());
  EXPECT_EQ(trace::event_count(), 0u);  // flushed events are forgotten
  const json t = read(*path);
  ASSERT_TRUE(t.contains("traceEvents"));
  const int64_t thread_tid = static_cast<int64_t>(::gettid());
  int kernels = 0, tasks = 0, copies = 0, syncs = 0, waits = 0, steps = 0;
  for (const auto& e : t["traceEvents"]) {
    if (e["ph"] == "M") continue;
    EXPECT_TRUE(e.contains("ts") && e.contains("pid") && e.contains("tid")) << e.dump();
    if (e["name"] == "kernel") {
      ++kernels;
      EXPECT_EQ(e["ph"], "X");
      EXPECT_GE(e["dur"].get<double>(), 4000.0);  // microseconds
      EXPECT_EQ(track_name(t, e["tid"]), "my stream");
      EXPECT_NE(e["tid"], thread_tid);
    } else if (e["name"] == "task") {
      ++tasks;
    } else if (e["name"] == "copy") {
      ++copies;
    } else if (e["name"] == "host sync: stream synchronize") {
      ++syncs;
      EXPECT_EQ(e["ph"], "i");
      EXPECT_EQ(e["tid"], thread_tid);
    } else if (e["name"] == "dependency wait") {
      ++waits;
      EXPECT_EQ(e["tid"], thread_tid);
      EXPECT_DOUBLE_EQ(e["dur"].get<double>(), 2000.0);
      EXPECT_EQ(e["args"]["blocked_ns"], 2'000'000);
    } else if (e["name"] == "step 7") {
      ++steps;
      EXPECT_EQ(e["cat"], "step");
      EXPECT_EQ(e["args"]["stage"], 3);
    }
  }
  EXPECT_EQ(kernels, 1);
  EXPECT_EQ(tasks, 1);
  EXPECT_EQ(copies, 1);
  EXPECT_EQ(syncs, 1);
  EXPECT_EQ(waits, 1);
  EXPECT_EQ(steps, 1);
  EXPECT_EQ(t["otherData"]["dropped_events"], 0);
}

TEST_F(TraceTest, CollectivesCarryOperationBytesGroupAndSequence) {
  trace::start(dir_.string());
  CommOptions options;
  options.name = "sharding";
  testing_util::run_ranks(
      2,
      [](int32_t rank, Communicator& comm) {
        std::vector<float> send(1000, static_cast<float>(rank)), recv(2000);
        auto w = comm.all_gather(send.data(), recv.data(), send.size(), DType::kFloat32);
        ASSERT_TRUE(w.ok());
        ASSERT_TRUE((*w)->wait().ok());
        auto r =
            comm.all_reduce(send.data(), send.data(), send.size(), DType::kFloat32, ReduceOp::kSum);
        ASSERT_TRUE(r.ok());
        ASSERT_TRUE((*r)->wait().ok());
        // Point to point: named by direction, peer and message number (they were anonymous
        // "task"s).
        auto p = rank == 0 ? comm.send(send.data(), 10, DType::kFloat32, 1)
                           : comm.recv(recv.data(), 10, DType::kFloat32, 0);
        ASSERT_TRUE(p.ok());
        ASSERT_TRUE((*p)->wait().ok());
      },
      options);
  trace::stop();
  // The ranks' communicators were the last streams: destroying them wrote the file.
  auto written = files();
  ASSERT_EQ(written.size(), 1u);
  const json t = read(written[0].string());
  int gathers = 0, reductions = 0, sends = 0, receives = 0;
  for (const auto& e : t["traceEvents"]) {
    if (e["ph"] != "X" || e["cat"] != "collective") continue;
    if (e["name"] == "send #1 to rank 1" || e["name"] == "recv #1 from rank 0") {
      ++(e["name"] == "send #1 to rank 1" ? sends : receives);
      EXPECT_EQ(e["args"]["bytes"], 10 * 4);
      EXPECT_EQ(e["args"]["sequence"], 1);
    }
    EXPECT_EQ(e["args"]["group"], "sharding");
    EXPECT_TRUE(track_name(t, e["tid"]).find("communicator 'sharding' rank") == 0)
        << track_name(t, e["tid"]);
    if (e["name"] == "all_gather") {
      ++gathers;
      EXPECT_EQ(e["args"]["bytes"], 2 * 1000 * 4);  // per rank × ranks
      EXPECT_EQ(e["args"]["sequence"], 1);
    } else if (e["name"] == "all_reduce") {
      ++reductions;
      EXPECT_EQ(e["args"]["bytes"], 1000 * 4);
      EXPECT_EQ(e["args"]["sequence"], 2);
    }
  }
  EXPECT_EQ(gathers, 2);  // one per rank
  EXPECT_EQ(reductions, 2);
  EXPECT_EQ(sends, 1);
  EXPECT_EQ(receives, 1);
}

TEST_F(TraceTest, EngineStepsMarkTheirBoundaries) {
  trace::start(dir_.string());
  testing_util::run_ranks(2, [](int32_t, Communicator& comm) {
    auto shared = std::shared_ptr<Communicator>(&comm, [](Communicator*) {});
    EngineOptions options;
    options.optimizer = OptimizerKind::kAdamW;
    auto engine = Stage2Engine::create(shared, nullptr, options);
    ASSERT_TRUE(engine.ok());
    auto& e = **engine;
    constexpr int kUnits = 6;
    for (int u = 0; u < kUnits; ++u) {
      ParamSpec spec;
      spec.name = "w" + std::to_string(u);
      spec.shape = {256, 1024};
      spec.unit = u;
      ASSERT_TRUE(e.add_param(spec).ok());
    }
    ASSERT_TRUE(e.seal().ok());
    ASSERT_TRUE(e.broadcast_parameters().ok());
    // A step refused (no gradient checked in) is no step: no boundary.
    EXPECT_EQ(e.step().code(), StatusCode::kFailedPrecondition);
    auto stage3 = Stage3Engine::create(shared, nullptr, options);
    ASSERT_TRUE(stage3.ok());
    EXPECT_EQ((*stage3)->step().code(), StatusCode::kFailedPrecondition);
    for (int step = 0; step < 3; ++step) {
      for (int u = 0; u < kUnits; ++u) ASSERT_TRUE(e.gather(u).ok());
      for (int u = kUnits - 1; u >= 0; --u) {
        auto g = e.grad(static_cast<size_t>(u));
        ASSERT_TRUE(g.ok());
        for (size_t i = 0; i < 256 * 1024; ++i) (*g)[i] = 0.001f * static_cast<float>(i % 7);
        ASSERT_TRUE(e.grad_ready(static_cast<size_t>(u), nullptr).ok());
      }
      ASSERT_TRUE(e.step().ok());
    }
    ASSERT_TRUE(e.synchronize().ok());
  });
  trace::stop();
  auto written = files();
  ASSERT_EQ(written.size(), 1u);
  const json t = read(written[0].string());
  int steps = 0, gathers = 0, reductions = 0, optimizer_tasks = 0;
  std::set<std::string> optimizer_tracks;
  for (const auto& e : t["traceEvents"]) {
    if (e["ph"] == "i" && e["cat"] == "step") {
      ++steps;
      EXPECT_EQ(e["args"]["stage"], 2);
    }
    if (e["ph"] != "X") continue;
    if (e["cat"] == "collective" && e["name"] == "all_gather") ++gathers;
    if (e["cat"] == "collective" && e["name"] == "reduce_scatter") ++reductions;
    // The engines name their optimizer streams' tracks.
    const std::string track = track_name(t, e["tid"]);
    if (track.rfind("optimizer", 0) == 0) {
      ++optimizer_tasks;
      optimizer_tracks.insert(track);
    }
  }
  // By rank: the two ranks (threads of one process) were both "optimizer".
  EXPECT_EQ(optimizer_tracks,
            (std::set<std::string>{"optimizer, sharding rank 0", "optimizer, sharding rank 1"}));
  EXPECT_EQ(steps, 6);               // 3 per rank
  EXPECT_EQ(reductions, 2 * 3 * 6);  // per rank, step and bucket
  EXPECT_GE(gathers, 2 * 3 * 6);
  EXPECT_GT(optimizer_tasks, 0);
}

TEST_F(TraceTest, EventsBeyondTheCapAreCountedAsDropped) {
  trace::start(dir_.string(), /*max_events=*/3);
  for (int i = 0; i < 5; ++i) trace::step_boundary(2, i);
  trace::stop();
  EXPECT_EQ(trace::event_count(), 3u);
  auto path = trace::flush();
  ASSERT_TRUE(path.ok()) << path.status().to_string();
  const json t = read(*path);
  EXPECT_EQ(t["otherData"]["dropped_events"], 2);
  trace::start(dir_.string(), trace::kDefaultMaxEvents);
  trace::stop();
}

// A process of another pid namespace (a container sharing the directory) or of another host
// can have this pid: its file of the name this process would take is kept, and this process
// publishes under the next free name. (Each used to replace the other's file, and the merge
// saw one process where two ran.)
TEST_F(TraceTest, AnotherProcessesFileOfTheSameNameIsKept) {
  trace::start(dir_.string());
  trace::step_boundary(2, 0);
  auto first = trace::flush();
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  // The next file's name: ...-N.json becomes ...-(N+1).json.
  const std::string name = *first;
  const size_t dash = name.rfind('-');
  const size_t dot = name.rfind(".json");
  ASSERT_TRUE(dash != std::string::npos && dot != std::string::npos && dash < dot) << name;
  const std::string stem = name.substr(0, dash + 1) +
                           std::to_string(std::stoul(name.substr(dash + 1, dot - dash - 1)) + 1);
  std::ofstream(stem + ".json") << "theirs";
  std::ofstream(stem + ".1.json") << "theirs too";
  trace::step_boundary(2, 1);
  trace::stop();
  auto second = trace::flush();
  ASSERT_TRUE(second.ok()) << second.status().to_string();
  EXPECT_EQ(*second, stem + ".2.json");
  const json t = read(*second);
  EXPECT_TRUE(t.contains("traceEvents"));
  std::string theirs;
  std::getline(std::ifstream(stem + ".json"), theirs);
  EXPECT_EQ(theirs, "theirs");
  std::getline(std::ifstream(stem + ".1.json"), theirs);
  EXPECT_EQ(theirs, "theirs too");
  for (const auto& f : files()) {  // no temporary left
    EXPECT_EQ(f.extension(), ".json") << f;
  }
}

// A forked child does not write its parent's events (they were the parent's to write, and
// a second file of them under the parent's rank made the merge refuse the run); what it
// records itself it writes under its own pid.
TEST_F(TraceTest, AForkedChildWritesOnlyWhatItRecords) {
  // The suite runs this test with HPS_RANK=3 (tests/CMakeLists.txt): the child's row is its
  // pid's all the same (the rank's row is the parent's).
  trace::start(dir_.string());
  for (int i = 0; i < 5; ++i) trace::step_boundary(2, i);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    int code = trace::event_count() == 0 ? 0 : 10;
    trace::step_boundary(3, 7);
    auto path = trace::flush();
    if (!path.ok() || path->empty()) code += 20;
    // The exit hook writes what is recorded, which is nothing now. (_exit: the parent's
    // threads, which the destructors of earlier tests' objects would wait for, are not here.)
    if (trace::event_count() != 0) code += 40;
    std::_Exit(code);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "10: the child held its parent's events; 20: no file; 40: events left after it";
  trace::stop();
  EXPECT_EQ(trace::event_count(), 5u) << "the parent's events stay the parent's";
  auto written = files();
  ASSERT_EQ(written.size(), 1u);
  const json t = read(written[0].string());
  int steps = 0;
  std::string process;
  for (const auto& e : t["traceEvents"]) {
    EXPECT_EQ(e["pid"], child) << e;
    if (e["ph"] == "i") {
      ++steps;
      EXPECT_EQ(e["args"]["step"], 7);
    }
    if (e["ph"] == "M" && e["name"] == "process_name") process = e["args"]["name"];
  }
  EXPECT_EQ(steps, 1);
  EXPECT_NE(process.find(std::to_string(child)), std::string::npos) << process;
  EXPECT_NE(written[0].filename().string().find("pid" + std::to_string(child)), std::string::npos)
      << written[0];
}

// A relative directory is the one it named when recording started, whatever the working
// directory is when the file is written.
TEST_F(TraceTest, ARelativeDirectoryIsTakenWhenRecordingStarts) {
  const auto before = std::filesystem::current_path();
  std::filesystem::create_directories(dir_ / "a");
  std::filesystem::create_directories(dir_ / "b");
  std::filesystem::current_path(dir_ / "a");
  trace::start("rel");
  std::filesystem::current_path(dir_ / "b");
  trace::step_boundary(2, 0);
  trace::stop();
  auto path = trace::flush();
  std::filesystem::current_path(before);
  ASSERT_TRUE(path.ok()) << path.status().to_string();
  EXPECT_EQ(std::filesystem::path(*path).parent_path(), dir_ / "a" / "rel") << *path;
  EXPECT_FALSE(std::filesystem::exists(dir_ / "b" / "rel"));
}

// The file is written event by event: writing 400,000 events takes far less memory than the
// document of them would (about 1.1 KB per event when it was built whole). In a child, whose
// peak resident size is its own.
TEST_F(TraceTest, WritingManyEventsTakesLittleMoreMemoryThanTheEvents) {
#ifdef HPS_TEST_SANITIZED
  GTEST_SKIP() << "a sanitizer's allocator keeps freed memory in quarantine";
#endif
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    trace::start(dir_.string());
    constexpr int kEvents = 400'000;
    for (int i = 0; i < kEvents; ++i) trace::step_boundary(2, i);
    trace::stop();
    rusage before{};
    ::getrusage(RUSAGE_SELF, &before);
    auto path = trace::flush();
    rusage after{};
    ::getrusage(RUSAGE_SELF, &after);
    if (!path.ok()) std::_Exit(2);
    const long grown_kib = after.ru_maxrss - before.ru_maxrss;
    std::fprintf(stderr, "peak grew %ld KiB writing %d events\n", grown_kib, kEvents);
    std::ifstream in(*path);
    const json t = json::parse(in, nullptr, false);
    if (t.is_discarded() || t["traceEvents"].size() < kEvents) std::_Exit(3);
    std::_Exit(grown_kib < 64 * 1024 ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: the peak grew 64 MiB or more; 2: no file; 3: the "
                                       "file is not the events";
}

TEST_F(TraceTest, AnUnwritableDirectoryIsAClearErrorAndKeepsRunning) {
  const std::string file = (dir_.string() + "-file");
  std::ofstream(file) << "x";  // a file where the directory should be
  trace::start(file);
  trace::step_boundary(2, 0);
  trace::stop();
  auto path = trace::flush();
  EXPECT_FALSE(path.ok());
  EXPECT_NE(path.status().message().find(file), std::string::npos) << path.status().to_string();
  std::filesystem::remove(file);
}

}  // namespace
}  // namespace hps
