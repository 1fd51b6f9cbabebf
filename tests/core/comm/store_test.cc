// One conformance suite run over every Store (in-memory, file, TCP), then what only one of
// them has: TCP clients, connect retry and server death; file stores shared by processes.
#include "core/comm/store.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <thread>

namespace hps {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using std::chrono::seconds;

milliseconds since(Clock::time_point start) {
  return std::chrono::duration_cast<milliseconds>(Clock::now() - start);
}

// A fresh directory under the temp dir, removed when the test ends.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ =
        std::filesystem::temp_directory_path() / ("hps_store_test." + std::to_string(::getpid()) +
                                                  "." + std::to_string(counter.fetch_add(1)));
    std::filesystem::remove_all(path_);
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// Each kind of store gives two handles on the same keys: `a` and `b` (another client of the
// TCP server, another FileStore on the directory, the same object in memory).
struct InMemoryKind {
  static constexpr const char* kName = "InMemory";
  std::shared_ptr<Store> a, b;
  void open() { a = b = make_in_memory_store(); }
};

struct FileKind {
  static constexpr const char* kName = "File";
  TempDir dir;
  std::shared_ptr<Store> a, b;
  void open() {
    auto first = make_file_store(dir.path().string());
    ASSERT_TRUE(first.ok()) << first.status().to_string();
    auto second = make_file_store(dir.path().string());
    ASSERT_TRUE(second.ok()) << second.status().to_string();
    a = *first;
    b = *second;
  }
};

struct TcpKind {
  static constexpr const char* kName = "Tcp";
  std::shared_ptr<Store> a, b;
  void open() {
    uint16_t port = 0;
    auto server = make_tcp_store("127.0.0.1", 0, true, seconds(5), &port);
    ASSERT_TRUE(server.ok()) << server.status().to_string();
    ASSERT_NE(port, 0);
    auto client = make_tcp_store("127.0.0.1", port, false, seconds(5));
    ASSERT_TRUE(client.ok()) << client.status().to_string();
    a = *server;
    b = *client;
  }
  ~TcpKind() {
    b.reset();  // the client before the serving store
    a.reset();
  }
};

template <typename Kind>
class StoreConformance : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_NO_FATAL_FAILURE(kind_.open()); }
  Store& store() { return *kind_.a; }
  Store& other() { return *kind_.b; }
  std::shared_ptr<Store> store_ptr() { return kind_.a; }

 private:
  Kind kind_;
};

struct KindName {
  template <typename Kind>
  static std::string GetName(int) {
    return Kind::kName;
  }
};

using StoreKinds = ::testing::Types<InMemoryKind, FileKind, TcpKind>;
TYPED_TEST_SUITE(StoreConformance, StoreKinds, KindName);

TYPED_TEST(StoreConformance, SetThenGetFromEitherHandle) {
  ASSERT_TRUE(this->store().set("alpha", "1").ok());
  auto v = this->other().get("alpha", seconds(1));
  ASSERT_TRUE(v.ok()) << v.status().to_string();
  EXPECT_EQ(*v, "1");
  ASSERT_TRUE(this->other().set("alpha", "two").ok());  // replaces
  EXPECT_EQ(*this->store().get("alpha", seconds(1)), "two");
}

TYPED_TEST(StoreConformance, GetWaitsForALaterSet) {
  std::thread writer([&] {
    std::this_thread::sleep_for(milliseconds(150));
    EXPECT_TRUE(this->other().set("late", "arrived").ok());
  });
  const auto start = Clock::now();
  auto v = this->store().get("late", seconds(5));
  const auto took = since(start);
  writer.join();
  ASSERT_TRUE(v.ok()) << v.status().to_string();
  EXPECT_EQ(*v, "arrived");
  EXPECT_GE(took.count(), 100);
  EXPECT_LT(took.count(), 4000);
}

TYPED_TEST(StoreConformance, AddFromEightThreadsIsAtomic) {
  constexpr int kThreads = 8;
  constexpr int kAdds = 1000;
  std::vector<std::vector<int64_t>> seen(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Store& s = t % 2 == 0 ? this->store() : this->other();
      for (int i = 0; i < kAdds; ++i) {
        auto r = s.add("counter", 1);
        if (!r.ok()) {
          ADD_FAILURE() << r.status().to_string();
          return;
        }
        seen[static_cast<size_t>(t)].push_back(*r);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(*this->store().add("counter", 0), kThreads * kAdds);
  // Every add saw a distinct value: no two read-modify-writes interleaved.
  std::vector<int64_t> all;
  for (auto& s : seen) all.insert(all.end(), s.begin(), s.end());
  std::sort(all.begin(), all.end());
  std::vector<int64_t> expected(kThreads * kAdds);
  std::iota(expected.begin(), expected.end(), 1);
  EXPECT_EQ(all, expected);
}

TYPED_TEST(StoreConformance, AddStartsAtZeroAndRejectsNonIntegers) {
  EXPECT_EQ(*this->store().add("n", 5), 5);
  EXPECT_EQ(*this->other().add("n", -7), -2);
  EXPECT_EQ(*this->store().get("n", seconds(1)), "-2");
  ASSERT_TRUE(this->store().set("word", "not a number").ok());
  auto r = this->other().add("word", 1);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("'word'"), std::string::npos) << r.status().message();
}

TYPED_TEST(StoreConformance, WaitForSeveralKeys) {
  std::thread writer([&] {
    for (const char* k : {"k1", "k2", "k3"}) {
      std::this_thread::sleep_for(milliseconds(40));
      EXPECT_TRUE(this->other().set(k, k).ok());
    }
  });
  const auto start = Clock::now();
  Status s = this->store().wait({"k1", "k2", "k3"}, seconds(5));
  const auto took = since(start);
  writer.join();
  EXPECT_TRUE(s.ok()) << s.to_string();
  EXPECT_GE(took.count(), 100);
  EXPECT_TRUE(*this->store().check({"k1", "k2", "k3"}));
}

TYPED_TEST(StoreConformance, CheckDoesNotWait) {
  EXPECT_FALSE(*this->store().check({"x"}));
  ASSERT_TRUE(this->other().set("x", "1").ok());
  EXPECT_TRUE(*this->store().check({"x"}));
  EXPECT_FALSE(*this->store().check({"x", "y"}));
  EXPECT_TRUE(*this->store().check({}));
}

TYPED_TEST(StoreConformance, TimeoutsAreBoundedAndNameTheKeys) {
  auto start = Clock::now();
  auto v = this->store().get("missing", milliseconds(100));
  EXPECT_LT(since(start).count(), 2000);
  EXPECT_GE(since(start).count(), 90);
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), StatusCode::kTimeout);
  EXPECT_NE(v.status().message().find("'missing'"), std::string::npos) << v.status().message();

  ASSERT_TRUE(this->store().set("present", "1").ok());
  start = Clock::now();
  Status s = this->other().wait({"present", "absent"}, milliseconds(100));
  EXPECT_LT(since(start).count(), 2000);
  EXPECT_EQ(s.code(), StatusCode::kTimeout);
  EXPECT_NE(s.message().find("'absent'"), std::string::npos) << s.message();

  // A zero timeout answers at once.
  start = Clock::now();
  EXPECT_EQ(this->store().get("missing", milliseconds(0)).status().code(), StatusCode::kTimeout);
  EXPECT_LT(since(start).count(), 1000);
}

TYPED_TEST(StoreConformance, BinaryKeysAndValuesRoundTrip) {
  std::string bytes;
  for (int i = 0; i < 256; ++i) bytes.push_back(static_cast<char>(i));
  const std::string value = std::string("a\0b", 3) + bytes;
  const std::string key = std::string("dir/../odd key\0:%.", 18);
  ASSERT_TRUE(this->store().set(key, value).ok());
  auto v = this->other().get(key, seconds(1));
  ASSERT_TRUE(v.ok()) << v.status().to_string();
  EXPECT_EQ(*v, value);
  // Keys that differ only after a '\0' or in '/' vs '%2F' stay distinct.
  ASSERT_TRUE(this->store().set(std::string("n\0a", 3), "first").ok());
  ASSERT_TRUE(this->store().set(std::string("n\0b", 3), "second").ok());
  ASSERT_TRUE(this->store().set("p/q", "slash").ok());
  ASSERT_TRUE(this->store().set("p%2Fq", "escaped").ok());
  EXPECT_EQ(*this->other().get(std::string("n\0a", 3), seconds(1)), "first");
  EXPECT_EQ(*this->other().get(std::string("n\0b", 3), seconds(1)), "second");
  EXPECT_EQ(*this->other().get("p/q", seconds(1)), "slash");
  EXPECT_EQ(*this->other().get("p%2Fq", seconds(1)), "escaped");
  // An empty value is a set key.
  ASSERT_TRUE(this->store().set("empty", "").ok());
  EXPECT_TRUE(*this->other().check({"empty"}));
  EXPECT_EQ(*this->other().get("empty", seconds(1)), "");
}

TYPED_TEST(StoreConformance, OneMebibyteValue) {
  std::string big(1 << 20, '\0');
  std::mt19937 random(7);
  for (auto& c : big) c = static_cast<char>(random() & 0xFF);
  ASSERT_TRUE(this->store().set("big", big).ok());
  auto v = this->other().get("big", seconds(5));
  ASSERT_TRUE(v.ok()) << v.status().to_string();
  EXPECT_EQ(v->size(), big.size());
  EXPECT_TRUE(*v == big);
}

TYPED_TEST(StoreConformance, PrefixStoreSeparatesSpaces) {
  auto group = make_prefix_store(this->store_ptr(), "group0");
  ASSERT_TRUE(group->set("key", "inside").ok());
  EXPECT_EQ(*this->other().get("group0/key", seconds(1)), "inside");
  EXPECT_FALSE(*this->other().check({"key"}));
  EXPECT_EQ(*group->add("count", 2), 2);
}

// ---- TCP ---------------------------------------------------------------------------

// A port nothing listens on right now: served once, then released.
uint16_t released_port() {
  uint16_t port = 0;
  auto probe = TcpStoreServer::start("127.0.0.1", 0);
  EXPECT_TRUE(probe.ok()) << probe.status().to_string();
  if (probe.ok()) port = (*probe)->port();
  return port;
}

TEST(TcpStore, ClientsInThreadsMeetOverLoopback) {
  uint16_t port = 0;
  auto server = make_tcp_store("127.0.0.1", 0, true, seconds(5), &port);
  ASSERT_TRUE(server.ok()) << server.status().to_string();
  constexpr int kRanks = 4;
  std::vector<std::thread> ranks;
  std::atomic<int> met{0};
  for (int r = 0; r < kRanks; ++r) {
    ranks.emplace_back([&, r] {
      auto client = make_tcp_store("127.0.0.1", port, false, seconds(5));
      ASSERT_TRUE(client.ok()) << client.status().to_string();
      ASSERT_TRUE((*client)->set("rank/" + std::to_string(r), std::to_string(r * r)).ok());
      std::vector<std::string> keys;
      for (int k = 0; k < kRanks; ++k) keys.push_back("rank/" + std::to_string(k));
      ASSERT_TRUE((*client)->wait(keys, seconds(5)).ok());
      for (int k = 0; k < kRanks; ++k) {
        EXPECT_EQ(*(*client)->get(keys[static_cast<size_t>(k)], seconds(1)), std::to_string(k * k));
      }
      ++met;
    });
  }
  for (auto& t : ranks) t.join();
  EXPECT_EQ(met.load(), kRanks);
}

TEST(TcpStore, ClientRetriesUntilTheServerStarts) {
  const uint16_t port = released_port();
  ASSERT_NE(port, 0);
  StatusOr<std::shared_ptr<Store>> client = unavailable("not connected");
  std::thread early([&] { client = make_tcp_store("127.0.0.1", port, false, seconds(5)); });
  std::this_thread::sleep_for(milliseconds(300));
  auto server = make_tcp_store("127.0.0.1", port, true, seconds(5));
  early.join();
  ASSERT_TRUE(server.ok()) << server.status().to_string();
  ASSERT_TRUE(client.ok()) << client.status().to_string();
  ASSERT_TRUE((*server)->set("hello", "world").ok());
  EXPECT_EQ(*(*client)->get("hello", seconds(1)), "world");
  client = unavailable("closed");
}

TEST(TcpStore, ConnectGivesUpAtItsTimeout) {
  const uint16_t port = released_port();
  ASSERT_NE(port, 0);
  const auto start = Clock::now();
  auto client = make_tcp_store("127.0.0.1", port, false, milliseconds(200));
  EXPECT_LT(since(start).count(), 2000);
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), StatusCode::kTimeout);
  EXPECT_NE(client.status().message().find("127.0.0.1:" + std::to_string(port)), std::string::npos)
      << client.status().message();
}

TEST(TcpStore, ServerDeathEndsBlockedAndLaterCallsWithAnError) {
  uint16_t port = 0;
  auto server = make_tcp_store("127.0.0.1", 0, true, seconds(5), &port);
  ASSERT_TRUE(server.ok()) << server.status().to_string();
  auto client = make_tcp_store("127.0.0.1", port, false, seconds(5));
  ASSERT_TRUE(client.ok()) << client.status().to_string();
  ASSERT_TRUE((*client)->set("before", "1").ok());

  Status blocked = Status::Ok();
  auto blocked_took = milliseconds(0);
  std::thread waiter([&] {
    const auto start = Clock::now();
    blocked = (*client)->get("never", seconds(30)).status();
    blocked_took = since(start);
  });
  std::this_thread::sleep_for(milliseconds(200));
  server = unavailable("destroyed");  // stops the server thread, closes its connections
  waiter.join();
  EXPECT_LT(blocked_took.count(), 5000);
  EXPECT_TRUE(blocked.code() == StatusCode::kAborted || blocked.code() == StatusCode::kBackendError)
      << blocked.to_string();
  EXPECT_NE(blocked.message().find("server"), std::string::npos) << blocked.message();

  const auto start = Clock::now();
  Status later = (*client)->set("after", "1");
  EXPECT_LT(since(start).count(), 5000);
  EXPECT_TRUE(later.code() == StatusCode::kAborted || later.code() == StatusCode::kBackendError)
      << later.to_string();
}

TEST(TcpStore, ServesOnEveryInterface) {
  uint16_t port = 0;
  auto server = make_tcp_store("0.0.0.0", 0, true, seconds(5), &port);
  ASSERT_TRUE(server.ok()) << server.status().to_string();
  auto client = make_tcp_store("127.0.0.1", port, false, seconds(5));
  ASSERT_TRUE(client.ok()) << client.status().to_string();
  ASSERT_TRUE((*server)->set("k", "v").ok());
  EXPECT_EQ(*(*client)->get("k", seconds(1)), "v");
}

TEST(TcpStore, ABusyPortIsAnError) {
  auto first = TcpStoreServer::start("127.0.0.1", 0);
  ASSERT_TRUE(first.ok());
  auto second = TcpStoreServer::start("127.0.0.1", (*first)->port());
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(make_tcp_store("127.0.0.1", 0, false, seconds(1)).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(TcpStore, AGarbagePeerDoesNotHurtTheServer) {
  uint16_t port = 0;
  auto server = make_tcp_store("127.0.0.1", 0, true, seconds(5), &port);
  ASSERT_TRUE(server.ok());
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  const char junk[] = "\xff\xff\xff\xffGET / HTTP/1.0\r\n\r\n";
  ASSERT_GT(::send(fd, junk, sizeof junk, MSG_NOSIGNAL), 0);
  char reply = 0;
  EXPECT_EQ(::recv(fd, &reply, 1, 0), 0);  // the server hung up
  ::close(fd);
  ASSERT_TRUE((*server)->set("still", "fine").ok());
  EXPECT_EQ(*(*server)->get("still", seconds(1)), "fine");
}

// ---- File --------------------------------------------------------------------------

TEST(FileStore, TwoProcessesAddConcurrently) {
  TempDir dir;
  ASSERT_TRUE(make_file_store(dir.path().string()).ok());
  constexpr int kAdds = 500;
  std::vector<pid_t> children;
  for (int c = 0; c < 2; ++c) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      // The child only touches its own store and leaves without running gtest's exit.
      auto store = make_file_store(dir.path().string());
      int failures = store.ok() ? 0 : 1;
      for (int i = 0; store.ok() && i < kAdds; ++i) {
        if (!(*store)->add("shared", 1).ok()) ++failures;
      }
      ::_exit(failures == 0 ? 0 : 1);
    }
    children.push_back(pid);
  }
  auto store = make_file_store(dir.path().string());
  ASSERT_TRUE(store.ok());
  for (int i = 0; i < kAdds; ++i) ASSERT_TRUE((*store)->add("shared", 1).ok());
  for (pid_t pid : children) {
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  EXPECT_EQ(*(*store)->add("shared", 0), 3 * kAdds);
}

TEST(FileStore, KeysBecomeFlatFileNames) {
  TempDir dir;
  auto store = make_file_store((dir.path() / "nested" / "store").string());
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  for (const char* key : {"a/b/c", "..", ".", "../escape", ".lock"}) {
    ASSERT_TRUE((*store)->set(key, key).ok()) << key;
    EXPECT_EQ(*(*store)->get(key, seconds(1)), key);
  }
  // Nothing escaped the directory and no sub-directories appeared.
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "nested" / "escape"));
  for (const auto& entry : std::filesystem::directory_iterator(dir.path() / "nested" / "store")) {
    EXPECT_TRUE(entry.is_regular_file()) << entry.path();
    EXPECT_EQ(entry.path().filename().string().rfind(".tmp", 0), std::string::npos)
        << "temp file left behind: " << entry.path();
  }
}

TEST(FileStore, BadDirectoriesAreErrors) {
  TempDir dir;
  std::filesystem::create_directories(dir.path());
  const auto file = dir.path() / "plain-file";
  { std::ofstream(file) << "x"; }
  EXPECT_FALSE(make_file_store(file.string()).ok());
  EXPECT_FALSE(make_file_store("").ok());
  auto store = make_file_store(dir.path().string());
  ASSERT_TRUE(store.ok());
  EXPECT_EQ((*store)->set(std::string(300, 'k'), "v").code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hps
