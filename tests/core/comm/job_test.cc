// A store belongs to one job: a second job is refused on every rank, a crashed run's keys
// are ignored with a message, ranks are claimed once. Jobs run as threads (ranks) of forked
// processes (jobs) sharing a file store directory, as two jobs on one machine would.
#include "core/comm/job.h"

#include <gtest/gtest.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "core/comm/communicator.h"
#include "core/comm/host.h"
#include "core/comm/rendezvous.h"
#include "core/comm/socket.h"
#include "core/common/config.h"

namespace hps {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using std::chrono::seconds;

class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::temp_directory_path() /
            ("hps_job_test." + std::to_string(::getpid()) + "." + std::to_string(counter++));
    std::filesystem::remove_all(path_);
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  std::string url() const { return "file://" + path_.string(); }

 private:
  std::filesystem::path path_;
};

// A port nothing listens on right now (0 when none could be had).
uint16_t free_port() {
  auto probe = net::listen_on("127.0.0.1", 0, 1);
  if (!probe.ok()) return 0;
  net::close_fd(probe->fd);
  return probe->port;
}

StoreOptions job(const std::string& id, int32_t world_size = 0) {
  StoreOptions o;
  o.job.id = id;
  o.job.source = "test";
  o.world_size = world_size;
  return o;
}

// Opens `world` ranks (threads) of one job; their stores, or the first error.
StatusOr<std::vector<std::shared_ptr<Store>>> open_ranks(const std::string& url, int32_t world,
                                                         const StoreOptions& options,
                                                         milliseconds timeout = seconds(10)) {
  std::vector<StatusOr<std::shared_ptr<Store>>> opened(static_cast<size_t>(world),
                                                       unavailable("not opened"));
  std::vector<std::thread> threads;
  for (int32_t r = 0; r < world; ++r) {
    threads.emplace_back(
        [&, r] { opened[static_cast<size_t>(r)] = open_store(url, r, timeout, options); });
  }
  for (auto& t : threads) t.join();
  std::vector<std::shared_ptr<Store>> stores;
  for (auto& s : opened) {
    if (!s.ok()) return s.status();
    stores.push_back(*s);
  }
  return stores;
}

// The sum over ranks of `base + rank + 1`, all-reduced by `world` threads over `stores`.
Status all_reduce_once(const std::vector<std::shared_ptr<Store>>& stores, int32_t world,
                       double base, double* sum_out, milliseconds timeout = seconds(10)) {
  std::vector<Status> results(static_cast<size_t>(world));
  std::vector<double> sums(static_cast<size_t>(world), 0);
  std::vector<std::thread> threads;
  CommOptions options;
  options.timeout = timeout;
  for (int32_t r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      auto comm =
          create_communicator(stores[static_cast<size_t>(r)], r, world, Device::cpu(), options);
      if (!comm.ok()) {
        results[static_cast<size_t>(r)] = comm.status();
        return;
      }
      double value = base + r + 1;
      auto work = (*comm)->all_reduce(&value, &sums[static_cast<size_t>(r)], 1, DType::kFloat64,
                                      ReduceOp::kSum);
      results[static_cast<size_t>(r)] = work.ok() ? (*work)->wait() : work.status();
    });
  }
  for (auto& t : threads) t.join();
  for (auto& s : results) HPS_RETURN_IF_ERROR(s);
  for (double s : sums) {
    if (s != sums[0]) return internal_error("the ranks disagree on the sum");
  }
  *sum_out = sums[0];
  return Status::Ok();
}

// Jobs of the tests below run in processes of their own: this binary again, running only
// JobChild.DISABLED_RunOneJob with HPS_JOB_TEST_CHILD="MODE URL INDEX" (a forked copy of a
// process that has used Gloo would inherit its device without the device's thread).
constexpr int kRefused = 3, kCorrect = 0, kWrong = 1, kCrashed = 42;

pid_t start_job(const std::string& mode, const std::string& url, int index,
                const int* release = nullptr) {
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  if (release != nullptr) {
    const int release_fd = release[0];
    ::close(release[1]);
    char byte = 0;
    if (::read(release_fd, &byte, 1) != 0) ::_exit(kWrong);  // released together at EOF
  }
  const std::string spec = mode + " " + url + " " + std::to_string(index);
  ::setenv("HPS_JOB_TEST_CHILD", spec.c_str(), 1);
  ::execl("/proc/self/exe", "job_test", "--gtest_filter=JobChild.DISABLED_RunOneJob",
          "--gtest_also_run_disabled_tests", static_cast<char*>(nullptr));
  ::_exit(127);
}

int wait_job(pid_t pid) {
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

TEST(JobChild, DISABLED_RunOneJob) {
  const char* spec = std::getenv("HPS_JOB_TEST_CHILD");
  if (spec == nullptr) GTEST_SKIP() << "runs only as a job of another test";
  std::istringstream in(spec);
  std::string mode, url;
  int index = 0;
  in >> mode >> url >> index;
  if (mode == "crash") {
    // Two ranks sum, then the process ends without closing anything, as a crash would.
    auto stores = open_ranks(url, 2, StoreOptions{});
    double sum = 0;
    const bool ok = stores.ok() && all_reduce_once(*stores, 2, 0, &sum).ok() && sum == 3;
    ::_exit(ok ? kCrashed : kWrong);
  }
  const StoreOptions options = job("trial-job-" + std::to_string(index), 2);
  if (mode == "rank0") {  // rank 0 alone, which ends at once (refused or not)
    auto store = open_store(url, 0, seconds(10), options);
    ::_exit(store.ok()                                                 ? kCorrect
            : store.status().code() == StatusCode::kFailedPrecondition ? kRefused
                                                                       : kWrong);
  }
  if (mode == "hold0") {  // rank 0 of a job without an id, holding the store for 1.5 s
    auto store = open_store(url, 0, seconds(10), job("", 2));
    std::this_thread::sleep_for(milliseconds(1500));
    ::_exit(store.ok() ? kCorrect : kWrong);
  }
  if (mode == "rank1") {  // rank 1 of a job without an id, which another rank 1 has joined
    auto store = open_store(url, 1, seconds(10), job("", 3));
    const bool joined = !store.ok() && store.status().code() == StatusCode::kFailedPrecondition &&
                        store.status().message().find("has joined the store") != std::string::npos;
    ::_exit(joined ? kRefused : kWrong);
  }
  auto stores = open_ranks(url, 2, options);
  if (!stores.ok()) {
    ::_exit(stores.status().code() == StatusCode::kFailedPrecondition ? kRefused : kWrong);
  }
  double sum = 0;
  Status s = all_reduce_once(*stores, 2, 10.0 * (index + 1), &sum);
  // Hold the store a moment, so that the jobs overlap.
  std::this_thread::sleep_for(milliseconds(300));
  ::_exit(s.ok() && sum == 2 * 10.0 * (index + 1) + 3 ? kCorrect : kWrong);
}

TEST(Job, ASecondJobIsRefusedOnEveryRankWhileTheFirstHoldsTheStore) {
  TempDir dir;
  auto a = open_ranks(dir.url(), 2, job("job-a", 2));
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  const auto start = Clock::now();
  auto b = open_ranks(dir.url(), 2, job("job-b", 2), seconds(20));
  // Refused at once on every rank, not at the timeout.
  EXPECT_LT(std::chrono::duration_cast<milliseconds>(Clock::now() - start).count(), 5000);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(b.status().message().find("job 'job-a'"), std::string::npos) << b.status().message();
  // Each rank on its own: rank 1 of job B learns its rank 0 was refused.
  auto b0 = open_store(dir.url(), 0, seconds(20), job("job-b", 2));
  ASSERT_FALSE(b0.ok());
  EXPECT_NE(b0.status().message().find("still runs"), std::string::npos) << b0.status().message();
  auto b1 = open_store(dir.url(), 1, seconds(20), job("job-b", 2));
  ASSERT_FALSE(b1.ok());
  EXPECT_EQ(b1.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(b1.status().message().find("could not take the store over"), std::string::npos)
      << b1.status().message();
  // Once job A has closed the store, job B takes it over. (Rank 0 first: in this process the
  // refused rank 0 above still runs, so a rank 1 that looked before the new rank 0 took a
  // ticket would find its refusal.)
  a = unavailable("closed");
  auto later0 = open_store(dir.url(), 0, seconds(10), job("job-b", 2));
  ASSERT_TRUE(later0.ok()) << later0.status().to_string();
  auto later1 = open_store(dir.url(), 1, seconds(10), job("job-b", 2));
  EXPECT_TRUE(later1.ok()) << later1.status().to_string();
}

// A rank whose rank 0 never comes while another job holds the store (over TCP: the other job's
// rank 0 took the port) is told so at its timeout, not only that it waited for its own.
TEST(Job, ARankWaitingInVainNamesTheJobThatHoldsTheStore) {
  TempDir dir;
  auto a = open_ranks(dir.url(), 2, job("job-a", 2));
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  auto c1 = open_store(dir.url(), 1, seconds(1), job("job-c", 2));
  ASSERT_FALSE(c1.ok());
  EXPECT_EQ(c1.status().code(), StatusCode::kTimeout) << c1.status().to_string();
  EXPECT_NE(c1.status().message().find("for rank 0 of job 'job-c'"), std::string::npos)
      << c1.status().message();
  EXPECT_NE(c1.status().message().find("meanwhile job 'job-a'"), std::string::npos)
      << c1.status().message();
  EXPECT_NE(c1.status().message().find("is another job using this job's store?"), std::string::npos)
      << c1.status().message();
}

// A second open of the job's store in one process, while the first is open (two libraries
// each asking for the world), is refused naming this process, not "a second job".
TEST(Job, ASecondOpenOfTheJobsStoreInOneProcessSaysSo) {
  TempDir dir;
  auto a = open_ranks(dir.url(), 2, job("job-a", 2));
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  auto again = open_store(dir.url(), 0, seconds(10), job("job-a", 2));
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(again.status().message().find("open in this process already"), std::string::npos)
      << again.status().message();
  // Rank 0 of a TCP store too, whose first server holds the port ("Address already in use").
  const uint16_t port = free_port();
  ASSERT_NE(port, 0);
  const std::string tcp = "tcp://127.0.0.1:" + std::to_string(port);
  auto served = open_ranks(tcp, 2, job("job-t", 2));
  ASSERT_TRUE(served.ok()) << served.status().to_string();
  auto twice = open_store(tcp, 0, seconds(10), job("job-t", 2));
  ASSERT_FALSE(twice.ok());
  EXPECT_EQ(twice.status().code(), StatusCode::kFailedPrecondition) << twice.status().to_string();
  EXPECT_NE(twice.status().message().find("open in this process already, as rank 0"),
            std::string::npos)
      << twice.status().message();
}

// Ranks that change roles between phases: the process that becomes rank 0 of the same job
// waits for the old rank 0 to close the store, as the other ranks wait. It was refused at
// once as "a second job" (naming its own job).
TEST(Job, ANewRankZeroOfTheSameJobWaitsForTheOldOneToClose) {
  TempDir dir;
  auto old_rank0 = open_store(dir.url(), 0, seconds(10), job("trial-job-5", 2));
  ASSERT_TRUE(old_rank0.ok()) << old_rank0.status().to_string();
  const pid_t child = start_job("rank0", dir.url(), 5);
  std::this_thread::sleep_for(milliseconds(700));
  old_rank0 = unavailable("closed");
  EXPECT_EQ(wait_job(child), kCorrect);
}

// Every rank closes the job's store and opens it again (a program in two phases, or two
// libraries one after the other), rank 1 before rank 0 has closed its own: rank 1 waits for
// rank 0's next take-over instead of joining the job it left (it was refused, "has joined the
// store already"). Under a TCP store, rank 0's server serves until its clients have gone:
// rank 1 keeps no connection open while it waits, so rank 0's close is not held up to its
// timeout, and rank 1 reaches the new server on the same port.
void ReopenBeforeRankZeroCloses(const std::string& url) {
  auto first = open_ranks(url, 2, job("job-r", 2));
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  double sum = 0;
  ASSERT_TRUE(all_reduce_once(*first, 2, 0, &sum).ok());
  std::shared_ptr<Store> rank0 = (*first)[0];
  first = unavailable("closed");  // rank 1's store goes; rank 0's is held here
  StatusOr<std::shared_ptr<Store>> again1 = unavailable("not opened");
  std::thread rank1([&] { again1 = open_store(url, 1, seconds(20), job("job-r", 2)); });
  std::this_thread::sleep_for(milliseconds(500));
  const auto closing = Clock::now();
  rank0.reset();
  EXPECT_LT(std::chrono::duration_cast<milliseconds>(Clock::now() - closing).count(), 3000)
      << "rank 0's store waited for rank 1 to go";
  auto again0 = open_store(url, 0, seconds(20), job("job-r", 2));
  rank1.join();
  ASSERT_TRUE(again0.ok()) << again0.status().to_string();
  ASSERT_TRUE(again1.ok()) << again1.status().to_string();
  ASSERT_TRUE(all_reduce_once({*again0, *again1}, 2, 10, &sum).ok());
  EXPECT_EQ(sum, 23);
  // Opened again while still open, rank 1 is refused at once, naming this process.
  auto twice = open_store(url, 1, seconds(20), job("job-r", 2));
  ASSERT_FALSE(twice.ok());
  EXPECT_NE(twice.status().message().find("open in this process already as rank 1"),
            std::string::npos)
      << twice.status().message();
}

// A store an older version left (records without a nonce) is still read: its closed job
// is taken over, not reported as a malformed record.
TEST(Job, RecordsWithoutANonceAreStillRead) {
  TempDir dir;
  {
    auto raw = make_file_store(dir.url().substr(7), seconds(5));
    ASSERT_TRUE(raw.ok()) << raw.status().to_string();
    const std::string record = "id old-job\nworld 2\n" + host::Process::self().encode();
    for (const auto& [key, value] : std::vector<std::pair<std::string, std::string>>{
             {"hpshard/job/ticket", "1"},
             {"hpshard/job/owner/1", record},
             {"hpshard/job/owner/1/decision", "accepted"},
             {"hpshard/job/owner/1/closed", "1"},
             {"hpshard/job/current", "1"},
             {"hpshard/job/id/old-job", "1"}}) {
      ASSERT_TRUE((*raw)->set(key, value).ok()) << key;
    }
  }
  auto stores = open_ranks(dir.url(), 2, job("old-job", 2));
  ASSERT_TRUE(stores.ok()) << stores.status().to_string();
}

// A job without an id whose rank 1 opens the store again, while another job (of another
// process, without an id either) holds it between this job's phases: rank 1 waits for its
// own rank 0, whose made-up id this process remembers. It joined the other job, and the
// ranks' sums then paired across jobs.
TEST(Job, AJobWithoutAnIdReopeningNeverJoinsAnotherJob) {
#if !HPS_HAVE_GLOO
  GTEST_SKIP() << "needs the Gloo communicator";
#endif
  TempDir dir;
  auto first = open_ranks(dir.url(), 2, job("", 2));
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  std::shared_ptr<Store> rank0 = (*first)[0];
  first = unavailable("closed");
  StatusOr<std::shared_ptr<Store>> again1 = unavailable("not opened");
  std::thread rank1([&] { again1 = open_store(dir.url(), 1, seconds(20), job("", 2)); });
  std::this_thread::sleep_for(milliseconds(300));
  rank0.reset();
  ASSERT_EQ(wait_job(start_job("hold0", dir.url(), 0)), kCorrect) << "the other job";
  auto again0 = open_store(dir.url(), 0, seconds(20), job("", 2));
  rank1.join();
  ASSERT_TRUE(again0.ok()) << again0.status().to_string();
  ASSERT_TRUE(again1.ok()) << again1.status().to_string();
  double sum = 0;
  ASSERT_TRUE(all_reduce_once({*again0, *again1}, 2, 10, &sum, seconds(5)).ok());
  EXPECT_EQ(sum, 23);
}

// A TCP store's next server counts its tickets from 1 again: the next job's keys are not
// those of a job a rank still holds a store of (its rank 0 closed and opened the store
// again). They were: both under "hpshard/run/1", and the old handle's communicator summed
// with the next job's ranks.
TEST(Job, TheNextServersJobDoesNotShareKeysWithAJobStillHeld) {
  const uint16_t port = free_port();
  ASSERT_NE(port, 0);
  const std::string url = "tcp://127.0.0.1:" + std::to_string(port);
  auto first = open_ranks(url, 2, job("job-s", 2), seconds(2));
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  std::shared_ptr<Store> stale = (*first)[1];  // rank 1 never closes it
  (*first)[0].reset();
  first = unavailable("closed");  // rank 0's server waits 2 s for rank 1, then goes
  auto next0 = open_store(url, 0, seconds(10), job("job-s", 2));
  ASSERT_TRUE(next0.ok()) << next0.status().to_string();
  ASSERT_TRUE((*next0)->set("phase1/key", "new job").ok());
  auto seen = stale->check({"phase1/key"});
  EXPECT_TRUE(!seen.ok() || !*seen) << "the old job's store reads the next job's keys";
  if (stale->set("from-old", "x").ok()) {
    EXPECT_FALSE(*(*next0)->check({"from-old"})) << "the next job reads the old job's keys";
  }
}

TEST(Job, ARankThatOpensTheFileStoreAgainWaitsForRankZerosNextOpen) {
#if !HPS_HAVE_GLOO
  GTEST_SKIP() << "needs the Gloo communicator";
#endif
  TempDir dir;
  ReopenBeforeRankZeroCloses(dir.url());
}

TEST(Job, ARankThatOpensTheTcpStoreAgainWaitsForRankZerosNextServer) {
#if !HPS_HAVE_GLOO
  GTEST_SKIP() << "needs the Gloo communicator";
#endif
  const uint16_t port = free_port();
  ASSERT_NE(port, 0);
  ReopenBeforeRankZeroCloses("tcp://127.0.0.1:" + std::to_string(port));
}

// Job B's rank 0 was refused and has exited before B's rank 1 looks: rank 1 reports the
// refusal in a moment. It used to take the refused rank 0 for a crashed run, wait its whole
// timeout for another and then blame its own job for ending.
TEST(Job, ARankWhoseRefusedRankZeroHasGoneReportsTheRefusal) {
  TempDir dir;
  auto a = open_ranks(dir.url(), 2, job("job-a", 2));
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  ASSERT_EQ(wait_job(start_job("rank0", dir.url(), 7)), kRefused);
  const auto start = Clock::now();
  auto b1 = open_store(dir.url(), 1, seconds(20), job("trial-job-7", 2));
  EXPECT_LT(std::chrono::duration_cast<milliseconds>(Clock::now() - start).count(), 5000);
  ASSERT_FALSE(b1.ok());
  EXPECT_EQ(b1.status().code(), StatusCode::kFailedPrecondition) << b1.status().to_string();
  EXPECT_NE(b1.status().message().find("could not take the store over"), std::string::npos)
      << b1.status().message();
  EXPECT_NE(b1.status().message().find("job 'job-a'"), std::string::npos) << b1.status().message();
  // Started again once job A has closed the store, the job runs: the new rank 0 moves its
  // id past the refused ticket while rank 1 waits.
  a = unavailable("closed");
  std::thread rank1([&] { b1 = open_store(dir.url(), 1, seconds(20), job("trial-job-7", 2)); });
  std::this_thread::sleep_for(milliseconds(300));
  auto b0 = open_store(dir.url(), 0, seconds(20), job("trial-job-7", 2));
  rank1.join();
  EXPECT_TRUE(b0.ok()) << b0.status().to_string();
  EXPECT_TRUE(b1.ok()) << b1.status().to_string();
}

TEST(Job, WithoutJobIdsARankIsClaimedOnceAndWorldSizesMustAgree) {
  TempDir dir;
  auto rank0 = open_store(dir.url(), 0, seconds(10), job("", 3));
  ASSERT_TRUE(rank0.ok()) << rank0.status().to_string();
  auto rank1 = open_store(dir.url(), 1, seconds(10), job("", 3));
  ASSERT_TRUE(rank1.ok()) << rank1.status().to_string();
  // In this process, rank 1 is open already; in another, it has joined already.
  auto again = open_store(dir.url(), 1, seconds(10), job("", 3));
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(again.status().message().find("open in this process already as rank 1"),
            std::string::npos)
      << again.status().message();
  ASSERT_EQ(wait_job(start_job("rank1", dir.url(), 0)), kRefused);
  auto other_size = open_store(dir.url(), 2, seconds(10), job("", 4));
  ASSERT_FALSE(other_size.ok());
  EXPECT_NE(other_size.status().message().find("of 3 ranks"), std::string::npos)
      << other_size.status().message();
  // The jobs' keys are their own: rank 0 and rank 1 share them.
  ASSERT_TRUE((*rank1)->set("k", "v").ok());
  EXPECT_EQ(*(*rank0)->get("k", seconds(1)), "v");
}

// A run that crashed left its keys (and its communicator counters) behind: the next job on
// the directory, of another size, ignores them with a message and runs correctly. It used to
// fail after 20 s inside Gloo ("enforce fail ... 136 vs 45").
TEST(Job, AStoreLeftByACrashedRunIsIgnoredWithAMessage) {
#if !HPS_HAVE_GLOO
  GTEST_SKIP() << "needs the Gloo communicator";
#endif
  TempDir dir;
  ASSERT_EQ(wait_job(start_job("crash", dir.url(), 0)), kCrashed) << "the first run failed";

  ::testing::internal::CaptureStderr();
  const auto start = Clock::now();
  auto stores = open_ranks(dir.url(), 4, StoreOptions{});
  double sum = 0;
  Status s = stores.ok() ? all_reduce_once(*stores, 4, 100, &sum, seconds(5)) : stores.status();
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(sum, 4 * 100 + 1 + 2 + 3 + 4);
  EXPECT_LT(std::chrono::duration_cast<milliseconds>(Clock::now() - start).count(), 5000);
  EXPECT_NE(log.find("ended without closing it"), std::string::npos) << log;
}

// The trial: two 2-rank jobs start together on one directory. Either one is
// refused with a clear error and the other sums right, or they ran one after the other;
// never do they pair across jobs (every process used to exit 0 with wrong sums).
TEST(Job, TwoJobsStartedTogetherOnOneDirectoryNeverPair) {
#if !HPS_HAVE_GLOO
  GTEST_SKIP() << "needs the Gloo communicator";
#endif
  for (int trial = 0; trial < 3; ++trial) {
    TempDir dir;
    int go[2];
    ASSERT_EQ(::pipe(go), 0);
    std::vector<pid_t> jobs;
    for (int j = 0; j < 2; ++j) jobs.push_back(start_job("trial", dir.url(), j, go));
    ::close(go[0]);
    ::close(go[1]);
    std::map<int, int> outcomes;
    for (pid_t pid : jobs) ++outcomes[wait_job(pid)];
    EXPECT_EQ(outcomes[kWrong] + outcomes[-1] + outcomes[127], 0)
        << "trial " << trial << ": a job failed or summed wrongly";
    EXPECT_GE(outcomes[kCorrect], 1) << "trial " << trial << ": neither job ran";
  }
}

// A process whose main thread called pthread_exit lives on in its other threads, though its
// stat shows the main thread's Z: it has not ended (a peer's transfers with it were aborted
// as with a dead rank). It has once its last thread is gone, before it is reaped.
TEST(Host, AProcessLivingOnAfterItsMainThreadExitedHasNotEnded) {
  int release[2];
  ASSERT_EQ(::pipe(release), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    std::thread([fd = release[0]] {
      char byte;
      while (::read(fd, &byte, 1) < 0 && errno == EINTR) {  // until the parent writes
      }
      ::_exit(0);
    }).detach();
    // The main thread alone ends, as pthread_exit ends it (without its unwinding, which
    // the test framework's frames would catch).
    ::syscall(SYS_exit, 0);
  }
  ::close(release[0]);
  const auto main_thread_ended = [&] {
    std::ifstream stat("/proc/" + std::to_string(child) + "/stat");
    std::string text;
    std::getline(stat, text);
    const size_t paren = text.rfind(')');
    return paren != std::string::npos && paren + 2 < text.size() && text[paren + 2] == 'Z';
  };
  for (int i = 0; i < 500 && !main_thread_ended(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(main_thread_ended());
  EXPECT_FALSE(host::process_ended(child)) << "its other thread still runs";
  ASSERT_EQ(::write(release[1], "x", 1), 1);
  for (int i = 0; i < 500 && !host::process_ended(child); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(host::process_ended(child)) << "ended, not reaped yet";
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ::close(release[1]);
}

TEST(Job, IdentityComesFromTheLaunchersVariables) {
  const char* names[] = {"HPS_JOB_ID",     "TORCHELASTIC_RUN_ID",     "TORCHELASTIC_RESTART_COUNT",
                         "PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "SLURM_JOB_ID",
                         "SLURM_STEP_ID",  "SLURM_RESTART_COUNT"};
  std::map<std::string, std::string> saved;
  for (const char* n : names) {
    if (const char* v = std::getenv(n)) saved[n] = v;
    ::unsetenv(n);
  }
  EXPECT_EQ(job_identity_from_env()->id, "");
  ::setenv("SLURM_JOB_ID", "1234", 1);
  ::setenv("SLURM_STEP_ID", "0", 1);
  EXPECT_EQ(job_identity_from_env()->id, "slurm:1234:0");
  ::setenv("TORCHELASTIC_RUN_ID", "none", 1);  // torchrun's default: no id
  EXPECT_EQ(job_identity_from_env()->id, "slurm:1234:0");
  ::setenv("TORCHELASTIC_RUN_ID", "abc", 1);
  ::setenv("TORCHELASTIC_RESTART_COUNT", "2", 1);
  EXPECT_EQ(job_identity_from_env()->id, "torchrun:abc:2");
  ::setenv("HPS_JOB_ID", "mine", 1);
  auto id = job_identity_from_env();
  EXPECT_EQ(id->id, "mine");
  EXPECT_EQ(id->source, "HPS_JOB_ID");
  ::setenv("HPS_JOB_ID", "bad\nid", 1);
  auto bad = job_identity_from_env();
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("HPS_JOB_ID"), std::string::npos);
  ::setenv("HPS_JOB_ID", std::string(300, 'x').c_str(), 1);
  EXPECT_EQ(job_identity_from_env().status().code(), StatusCode::kInvalidArgument);
  ::unsetenv("HPS_JOB_ID");
  // A message names the variable that holds the bad value, with that value's own length.
  auto message_of = [](StatusOr<JobIdentity> r) {
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    return std::string(r.status().message());
  };
  ::setenv("TORCHELASTIC_RESTART_COUNT", "\001", 1);
  auto control = message_of(job_identity_from_env());
  EXPECT_NE(control.find("TORCHELASTIC_RESTART_COUNT holds a control character"), std::string::npos)
      << control;
  ::unsetenv("TORCHELASTIC_RUN_ID");
  ::unsetenv("TORCHELASTIC_RESTART_COUNT");
  ::setenv("SLURM_JOB_ID", "5", 1);
  ::setenv("SLURM_STEP_ID", std::string(300, '1').c_str(), 1);
  auto step = message_of(job_identity_from_env());
  EXPECT_NE(step.find("SLURM_STEP_ID holds 300 bytes"), std::string::npos) << step;
  EXPECT_EQ(step.find("SLURM_JOB_ID"), std::string::npos) << step;
  ::unsetenv("SLURM_STEP_ID");
  ::setenv("SLURM_JOB_ID", std::string(251, '7').c_str(), 1);
  auto joined = message_of(job_identity_from_env());
  EXPECT_NE(joined.find("SLURM_JOB_ID (251 bytes)"), std::string::npos) << joined;
  EXPECT_NE(joined.find("'slurm:'"), std::string::npos) << joined;
  EXPECT_NE(joined.find("is 257 bytes"), std::string::npos) << joined;
  ::setenv("SLURM_JOB_ID", std::string(250, '7').c_str(), 1);
  EXPECT_EQ(job_identity_from_env()->id, "slurm:" + std::string(250, '7'));
  for (const char* n : names) {
    auto it = saved.find(n);
    if (it != saved.end()) {
      ::setenv(n, it->second.c_str(), 1);
    } else {
      ::unsetenv(n);
    }
  }
}

}  // namespace
}  // namespace hps
