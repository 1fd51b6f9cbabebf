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
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

#include "core/comm/communicator.h"
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

}  // namespace
}  // namespace hps
