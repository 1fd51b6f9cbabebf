// No rank gets a communicator whose Gloo pair leads to another process. Gloo's pairs are
// not authenticated: a process that reads a rank's published address (or scans for it) and
// connects first, sending the pair's sequence number, takes the pair. The Gloo hpshard
// builds against accepts one connection per pair, so the real peer's connection is refused
// and its creation fails; every other rank then waits for it in the store's later rounds
// and fails at the timeout. The store below plays that process. (A Gloo whose pairs share
// one listener would keep the real peer connected to nothing: this test says whether the
// property survives such an upgrade.) A peer that dies between publishing its addresses and
// connecting costs the others the timeout once, and is named.
#include <arpa/inet.h>
#include <gloo/transport/tcp/device.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/comm/communicator.h"
#include "core/comm/host.h"
#include "core/comm/store.h"

namespace hps {
namespace {

using std::chrono::milliseconds;

// The layout of a Gloo TCP address as Gloo publishes it: the listening socket's address,
// then the pair's sequence number.
struct GlooAddress {
  sockaddr_storage ss;
  ssize_t seq;
};

class HijackingStore final : public ForwardingStore {
 public:
  // With `take` false it only counts the addresses it would have taken.
  HijackingStore(std::shared_ptr<Store> base, bool take)
      : ForwardingStore(std::move(base)), take_(take) {}
  ~HijackingStore() override {
    for (int fd : taken_) ::close(fd);
  }

  Status set(std::string_view key, std::string_view value) override {
    // Gloo's full-mesh rendezvous publishes each rank's addresses under the rank's number.
    if (key.find("/gloo/") != std::string_view::npos && value.size() % sizeof(GlooAddress) == 0) {
      take(value);
    }
    return ForwardingStore::set(key, value);
  }
  size_t seen() {
    std::lock_guard lock(mutex_);
    return seen_;
  }

 private:
  // Before the peers can read these addresses, connects to each and sends its sequence
  // number, as the peer would.
  void take(std::string_view value) {
    for (size_t at = 0; at < value.size(); at += sizeof(GlooAddress)) {
      if (!take_) {
        std::lock_guard lock(mutex_);
        ++seen_;
        continue;
      }
      GlooAddress a{};
      std::memcpy(&a, value.data() + at, sizeof a);
      const socklen_t length =
          a.ss.ss_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
      const int fd = ::socket(a.ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
      ASSERT_GE(fd, 0);
      ASSERT_EQ(::connect(fd, reinterpret_cast<const sockaddr*>(&a.ss), length), 0)
          << std::strerror(errno);
      ASSERT_EQ(::send(fd, &a.seq, sizeof a.seq, MSG_NOSIGNAL), static_cast<ssize_t>(sizeof a.seq));
      std::lock_guard lock(mutex_);
      taken_.push_back(fd);
      ++seen_;
    }
    // Let the listener read the numbers before the real peers connect (with `take` false
    // the same delay, so the control differs in the connections only).
    std::this_thread::sleep_for(milliseconds(300));
  }

  const bool take_;
  std::mutex mutex_;
  std::vector<int> taken_;
  size_t seen_ = 0;
};

// Two ranks over `store` as the takeover test runs them; each rank's all_reduce of r + 1 is
// checked where the communicator was made.
std::vector<Status> connect_two(const std::shared_ptr<Store>& store) {
  CommOptions options;
  options.timeout = milliseconds(3000);
  options.shared_memory = false;    // every collective over the Gloo pairs
  options.check_arguments = false;  // no control mesh, whose own handshake would fail
  std::vector<Status> results(2);
  std::vector<std::thread> ranks;
  for (int32_t r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      auto comm = create_communicator(store, r, 2, Device::cpu(), options);
      Status& s = results[static_cast<size_t>(r)];
      s = comm.status();
      if (!s.ok()) return;
      int32_t value = r + 1;
      auto work = (*comm)->all_reduce(&value, &value, 1, DType::kInt32, ReduceOp::kSum, nullptr);
      s = work.ok() ? (*work)->wait() : work.status();
      if (s.ok() && value != 3) s = internal_error("all_reduce gave " + std::to_string(value));
    });
  }
  for (auto& t : ranks) t.join();
  return results;
}

TEST(GlooPairTakeover, ATakenPairFailsTheCommunicatorOnEveryRank) {
  auto store = std::make_shared<HijackingStore>(make_in_memory_store(), true);
  const std::vector<Status> results = connect_two(store);
  ASSERT_GT(store->seen(), 0u) << "the store saw no Gloo address to take";
  for (int32_t r = 0; r < 2; ++r) {
    EXPECT_FALSE(results[static_cast<size_t>(r)].ok())
        << "rank " << r << " returned a communicator although a pair was taken";
  }
}

// The control: the same store, delay and options, the addresses left alone.
TEST(GlooPairTakeover, UntouchedPairsConnectAndCarryData) {
  auto store = std::make_shared<HijackingStore>(make_in_memory_store(), false);
  const std::vector<Status> results = connect_two(store);
  EXPECT_GT(store->seen(), 0u);
  for (const Status& s : results) EXPECT_TRUE(s.ok()) << s.to_string();
}

// A peer that publishes its Gloo addresses and dies before connecting (killed between the
// two). The store below plays it: when rank 0 publishes its addresses, it publishes rank
// 1's from a pair of its own and closes that pair at once.
class DeadPeerStore final : public ForwardingStore {
 public:
  explicit DeadPeerStore(std::shared_ptr<Store> base) : ForwardingStore(std::move(base)) {}
  Status set(std::string_view key, std::string_view value) override {
    HPS_RETURN_IF_ERROR(ForwardingStore::set(key, value));
    const std::string_view mine = "/gloo/0";
    if (key.size() < mine.size() || key.substr(key.size() - mine.size()) != mine) {
      return Status::Ok();
    }
    ::gloo::transport::tcp::attr attr;
    attr.hostname = "127.0.0.1";
    auto device = ::gloo::transport::tcp::CreateDevice(attr);
    auto context = device->createContext(1, 2);
    const std::vector<char> address = context->createPair(0)->address().bytes();
    std::string peer_key(key);
    peer_key.back() = '1';
    return ForwardingStore::set(peer_key, std::string_view(address.data(), address.size()));
    // The pair closes here: rank 0's connection is refused, or never comes.
  }
};

// Rank 0 is told within its timeout (not Gloo's five times it) which rank it lost.
TEST(GlooDeadPeer, CreationFailsWithinTheTimeoutNamingThePeer) {
  CommOptions options;
  options.timeout = milliseconds(1500);
  options.shared_memory = false;
  options.check_arguments = false;
  // Which end of the pair connects depends on the addresses: several tries see both.
  for (int attempt = 0; attempt < 4; ++attempt) {
    auto store = std::make_shared<DeadPeerStore>(make_in_memory_store());
    const auto start = std::chrono::steady_clock::now();
    auto comm = create_communicator(store, 0, 2, Device::cpu(), options);
    const auto took = std::chrono::steady_clock::now() - start;
    ASSERT_FALSE(comm.ok()) << "connected to a dead peer";
    const Status& s = comm.status();
    EXPECT_TRUE(s.code() == StatusCode::kAborted || s.code() == StatusCode::kTimeout)
        << s.to_string();
    EXPECT_NE(s.message().find("the connection to rank 1 failed"), std::string::npos)
        << s.to_string();
    EXPECT_LT(took, milliseconds(2 * 1500)) << s.to_string();
  }
}

// Over TCP without the argument check (no control connections to tell), a peer whose
// connections close mid-collective is named by the rank its address belongs to.
TEST(GlooDeadPeer, AClosedConnectionNamesThePeer) {
  CommOptions options;
  options.timeout = milliseconds(20'000);
  options.shared_memory = false;
  options.check_arguments = false;
  auto store = make_in_memory_store();
  Status survivor;
  std::thread leaver([&] {
    auto comm = create_communicator(store, 1, 2, Device::cpu(), options);
    ASSERT_TRUE(comm.ok()) << comm.status().to_string();
    (*comm)->abort();  // then destroyed: its connections close at once
  });
  auto comm = create_communicator(store, 0, 2, Device::cpu(), options);
  ASSERT_TRUE(comm.ok()) << comm.status().to_string();
  leaver.join();
  std::vector<float> x(1 << 16, 1.0f), y(x.size());
  const auto start = std::chrono::steady_clock::now();
  auto work =
      (*comm)->all_reduce(x.data(), y.data(), x.size(), DType::kFloat32, ReduceOp::kSum, nullptr);
  survivor = work.ok() ? (*work)->wait() : work.status();
  EXPECT_EQ(survivor.code(), StatusCode::kAborted) << survivor.to_string();
  EXPECT_NE(survivor.message().find("the connection to rank 1 failed"), std::string::npos)
      << survivor.to_string();
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(10'000));
}

// Rank 1 sends rank 0 `count` floats over TCP; rank `leaver` aborts `after` posting its
// side. The survivor's status and how long its wait lasted.
struct MidTransfer {
  Status survivor;
  std::chrono::steady_clock::duration waited{};
};
MidTransfer abort_mid_transfer(int32_t leaver, size_t count, milliseconds after) {
  CommOptions options;
  options.timeout = milliseconds(60'000);
  options.shared_memory = false;
  auto store = make_in_memory_store();
  MidTransfer result;
  std::thread ranks[2];
  for (int32_t r = 0; r < 2; ++r) {
    ranks[r] = std::thread([&, r] {
      auto comm = create_communicator(store, r, 2, Device::cpu(), options);
      ASSERT_TRUE(comm.ok()) << comm.status().to_string();
      std::vector<float> data(count, static_cast<float>(r));
      auto work = r == 1 ? (*comm)->send(data.data(), count, DType::kFloat32, 0)
                         : (*comm)->recv(data.data(), count, DType::kFloat32, 1);
      ASSERT_TRUE(work.ok()) << work.status().to_string();
      if (r == leaver) {
        std::this_thread::sleep_for(after);
        (*comm)->abort();
        (void)(*work)->wait();
        return;
      }
      const auto start = std::chrono::steady_clock::now();
      result.survivor = (*work)->wait();
      result.waited = std::chrono::steady_clock::now() - start;
    });
  }
  for (auto& t : ranks) t.join();
  return result;
}

// Gloo tells a failed connection to the transfers still queued on it, not to one under way
// (a send partly written, a receive partly read). A peer that aborts mid-transfer fails the
// survivor's wait within a fraction of a second, not at its timeout (a minute here): the
// ranks are threads of this process, so only the connection's failure can tell. The
// survivor's error says what the leaver did: its farewell on the control connections.
TEST(GlooDeadPeer, APeerThatAbortsMidTransferFailsTheSurvivorsWaitAtOnce) {
  constexpr size_t kCount = size_t{64} << 20;  // 256 MiB: the transfer lasts a while
  const auto whole = abort_mid_transfer(-1, kCount, milliseconds(0));
  ASSERT_TRUE(whole.survivor.ok()) << whole.survivor.to_string();
  // Aborted a fifth of the way through a healthy transfer's time.
  const auto after =
      std::max(milliseconds(1), std::chrono::duration_cast<milliseconds>(whole.waited / 5));
  for (const int32_t leaver : {0, 1}) {
    SCOPED_TRACE(leaver == 1 ? "the sender aborts" : "the receiver aborts");
    const MidTransfer t = abort_mid_transfer(leaver, kCount, after);
    EXPECT_EQ(t.survivor.code(), StatusCode::kAborted) << t.survivor.to_string();
    EXPECT_NE(
        t.survivor.message().find("rank " + std::to_string(leaver) + " aborted the communicator"),
        std::string::npos)
        << t.survivor.to_string();
    EXPECT_LT(t.waited, milliseconds(10'000))
        << "a healthy transfer took " << whole.waited.count() / 1'000'000 << " ms";
  }
}

// A process of this host that has ended (started, then exited and reaped), as a rank
// would have published it.
std::string ended_process_record() {
  int gate[2];
  if (::pipe(gate) != 0) return {};
  const pid_t pid = ::fork();
  if (pid == 0) {
    char byte;
    ::close(gate[1]);
    (void)!::read(gate[0], &byte, 1);
    ::_exit(0);
  }
  ::close(gate[0]);
  host::Process p{host::identity(), static_cast<int32_t>(pid),
                  host::process_start_time(static_cast<int32_t>(pid))};
  ::close(gate[1]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return p.encode();
}

// Where a rank's process record lies in a fresh store: the first communicator's key space.
const std::string kRank2Record = "comm1/process/2";

// Rank 2 published its process, then ended before connecting: ranks 0 and 1 name it at
// once (they waited their whole timeout for its addresses).
TEST(GlooDeadPeer, APeerWhoseProcessEndedBeforeConnectingIsNamedAtOnce) {
  CommOptions options;
  options.timeout = milliseconds(20'000);
  auto store = make_in_memory_store();
  const std::string record = ended_process_record();
  ASSERT_FALSE(record.empty());
  ASSERT_TRUE(store->set(kRank2Record, record).ok());
  const int32_t pid = host::Process::parse(record)->pid;
  Status results[2];
  const auto start = std::chrono::steady_clock::now();
  std::thread other(
      [&] { results[1] = create_communicator(store, 1, 3, Device::cpu(), options).status(); });
  results[0] = create_communicator(store, 0, 3, Device::cpu(), options).status();
  other.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(5'000));
  for (const Status& s : results) {
    EXPECT_EQ(s.code(), StatusCode::kAborted) << s.to_string();
    EXPECT_NE(
        s.message().find("rank 2 (process " + std::to_string(pid) + " on this host) has ended"),
        std::string::npos)
        << s.to_string();
  }
}

// A rank that never came: the timeout says which one (it named a store key, whichever the
// wait was on).
TEST(GlooDeadPeer, ATimedOutCreationNamesTheRanksThatNeverBegan) {
  CommOptions options;
  options.timeout = milliseconds(1'500);
  auto store = make_in_memory_store();
  Status results[2];
  std::thread other(
      [&] { results[1] = create_communicator(store, 1, 4, Device::cpu(), options).status(); });
  results[0] = create_communicator(store, 0, 4, Device::cpu(), options).status();
  other.join();
  for (const Status& s : results) {
    EXPECT_EQ(s.code(), StatusCode::kTimeout) << s.to_string();
    EXPECT_NE(s.message().find("ranks 2, 3 never began creating it"), std::string::npos)
        << s.to_string();
  }
}

// A child rank's communicator over TCP (check_arguments as given) through the file store in
// `dir`; the child exits with status 1 where either cannot be made.
std::unique_ptr<Communicator> child_communicator(const char* dir, int32_t rank, int32_t size,
                                                 bool check_arguments) {
  CommOptions options;
  options.timeout = milliseconds(20'000);
  options.shared_memory = false;
  options.check_arguments = check_arguments;
  auto store = make_file_store(dir);
  if (!store.ok()) ::_exit(1);
  auto comm = create_communicator(*store, rank, size, Device::cpu(), options);
  if (!comm.ok()) ::_exit(1);
  return std::move(*comm);
}

// Rank 2 of the test below, in a process of its own: this binary again, running only this
// test with HPS_DEAD_PEER_STORE naming the file store's directory.
TEST(GlooDeadPeerChild, DISABLED_Rank2) {
  const char* dir = std::getenv("HPS_DEAD_PEER_STORE");
  if (dir == nullptr) GTEST_SKIP() << "runs only as rank 2 of another test";
  auto comm = child_communicator(dir, 2, 3, false);
  while (true) ::pause();  // killed by the test
}

// Runs this binary's (disabled) test `name` in a child process with `env` set; its pid.
pid_t run_child_test(const std::string& name,
                     const std::vector<std::pair<std::string, std::string>>& env) {
  const std::string filter = "--gtest_filter=" + name;
  const pid_t child = ::fork();
  if (child == 0) {
    for (const auto& [key, value] : env) ::setenv(key.c_str(), value.c_str(), 1);
    ::execl("/proc/self/exe", "pair_takeover_test", filter.c_str(),
            "--gtest_also_run_disabled_tests", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  return child;
}

// Rank 1 of 2, run by AClosedRanksConnectionsEndWithAFin: closes its communicator, then
// exits (the exit's own destructors run) at once or after HPS_EXITING_PEER_LINGER_MS.
TEST(GlooDeadPeerChild, DISABLED_ClosesThenExits) {
  const char* dir = std::getenv("HPS_EXITING_PEER_STORE");
  if (dir == nullptr) GTEST_SKIP() << "runs only as rank 1 of another test";
  child_communicator(dir, 1, 2, true).reset();
  if (const char* linger = std::getenv("HPS_EXITING_PEER_LINGER_MS")) {
    std::this_thread::sleep_for(milliseconds(std::atoi(linger)));
  }
  std::exit(0);
}

// A communicator closed in health keeps its connections open a while (its last sends may
// still be queued for a peer), then closes them with a FIN, which sends what is queued
// first; a process that exits meanwhile leaves them for the exit to close the same way. A
// reset (SO_LINGER 0, as a close that fails the peers) would discard what the peers had not
// yet received: the peer sees "Connection closed by peer", not "Connection reset by peer",
// whether the rank exits at once or after the 5 s grace.
class GlooClosedPeer : public ::testing::TestWithParam<int> {};
TEST_P(GlooClosedPeer, AClosedRanksConnectionsEndWithAFin) {
  CommOptions options;
  options.timeout = milliseconds(20'000);
  options.shared_memory = false;
  char dir[] = "/tmp/hps_exiting_peer.XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  const pid_t child = run_child_test("GlooDeadPeerChild.DISABLED_ClosesThenExits",
                                     {{"HPS_EXITING_PEER_STORE", dir},
                                      {"HPS_EXITING_PEER_LINGER_MS", std::to_string(GetParam())}});
  ASSERT_GE(child, 0);
  auto opened = make_file_store(dir);
  ASSERT_TRUE(opened.ok()) << opened.status().to_string();
  auto comm = create_communicator(*opened, 0, 2, Device::cpu(), options);
  int status = 0;
  ::waitpid(child, &status, 0);
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(comm.ok()) << comm.status().to_string();
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the child's status " << status;
  float x = 0;
  auto work = (*comm)->recv(&x, 1, DType::kFloat32, 1);
  const Status s = work.ok() ? (*work)->wait() : work.status();
  EXPECT_EQ(s.code(), StatusCode::kAborted) << s.to_string();
  EXPECT_NE(s.message().find("Connection closed by peer"), std::string::npos) << s.to_string();
  EXPECT_EQ(s.message().find("reset"), std::string::npos) << s.to_string();
}
INSTANTIATE_TEST_SUITE_P(AtOnceOrAfterTheGrace, GlooClosedPeer, ::testing::Values(0, 6000));

// Rank 2 of 3 is killed between collectives over TCP: each survivor names rank 2 first,
// also one whose failed connection is to the other survivor (which aborted its own on
// seeing rank 2 go). Survivors named each other in 6 of 24 kills.
TEST(GlooDeadPeer, SurvivorsNameTheRankWhoseProcessEnded) {
  CommOptions options;
  options.timeout = milliseconds(20'000);
  options.shared_memory = false;
  options.check_arguments = false;
  char dir[] = "/tmp/hps_dead_peer.XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  const pid_t child =
      run_child_test("GlooDeadPeerChild.DISABLED_Rank2", {{"HPS_DEAD_PEER_STORE", dir}});
  ASSERT_GE(child, 0);
  auto opened = make_file_store(dir);
  ASSERT_TRUE(opened.ok()) << opened.status().to_string();
  std::shared_ptr<Store> store = *opened;
  std::unique_ptr<Communicator> comms[2];
  std::thread threads[2];
  for (int r = 0; r < 2; ++r) {
    threads[r] = std::thread([&, r] {
      auto c = create_communicator(store, r, 3, Device::cpu(), options);
      if (c.ok()) comms[r] = std::move(*c);
    });
  }
  for (auto& t : threads) t.join();
  ::kill(child, SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  std::filesystem::remove_all(dir);
  for (auto& c : comms) ASSERT_TRUE(c) << "creation failed";
  Status results[2];
  std::vector<float> data[2];
  for (int r = 0; r < 2; ++r) {
    threads[r] = std::thread([&, r] {
      data[r].assign(1 << 16, 1.0f);
      auto work = comms[r]->all_reduce(data[r].data(), data[r].data(), data[r].size(),
                                       DType::kFloat32, ReduceOp::kSum, nullptr);
      results[r] = work.ok() ? (*work)->wait() : work.status();
    });
  }
  for (auto& t : threads) t.join();
  for (const Status& s : results) {
    EXPECT_EQ(s.code(), StatusCode::kAborted) << s.to_string();
    EXPECT_NE(s.message().find("rank 2 (process " + std::to_string(child) + " on this host)"),
              std::string::npos)
        << s.to_string();
  }
}

}  // namespace
}  // namespace hps
