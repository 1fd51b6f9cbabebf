// The control mesh accepts only ranks of its own group: a stranger who connects to a rank's
// published port first (claiming to be a peer) is closed, and the real peer still connects.
#include "core/comm/gloo/control_mesh.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>
#include <vector>

#include "core/comm/socket.h"

namespace hps::gloo_backend {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::seconds;

TEST(ControlMesh, AStrangerIsClosedAndThePeersStillConnect) {
  auto store = make_in_memory_store();
  const auto deadline = Clock::now() + seconds(20);
  StatusOr<std::unique_ptr<ControlMesh>> rank0 = unavailable("not made");
  std::thread first([&] { rank0 = ControlMesh::create(*store, 0, 2, "127.0.0.1", deadline); });

  // The stranger reads where rank 0 listens (a port scan would find it too), but not the
  // nonce published beside it; it claims to be rank 1, as the old 4-byte hello let it.
  auto published = store->get("control/0", seconds(10));
  ASSERT_TRUE(published.ok()) << published.status().to_string();
  const std::string address = published->substr(0, published->find(' '));
  const uint16_t port = static_cast<uint16_t>(std::stoul(address.substr(address.rfind(':') + 1)));
  auto stranger = net::connect_once("127.0.0.1", port, Clock::now() + seconds(5));
  ASSERT_TRUE(stranger.ok());
  char claim[20] = {0, 0, 0, 1};  // rank 1, and a guessed nonce
  ASSERT_TRUE(net::send_all(*stranger, std::string_view(claim, sizeof claim), deadline).ok());
  char byte = 0;
  EXPECT_FALSE(net::recv_all(*stranger, &byte, 1, Clock::now() + seconds(10)).ok())
      << "the stranger was answered";
  net::close_fd(*stranger);

  StatusOr<std::unique_ptr<ControlMesh>> rank1 = unavailable("not made");
  std::thread second([&] { rank1 = ControlMesh::create(*store, 1, 2, "127.0.0.1", deadline); });
  first.join();
  second.join();
  ASSERT_TRUE(rank0.ok()) << rank0.status().to_string();
  ASSERT_TRUE(rank1.ok()) << rank1.status().to_string();
  // And the mesh carries messages between the real ranks.
  const int32_t from0 = 10, from1 = 11;
  ASSERT_TRUE((*rank0)->post(&from0, sizeof from0, deadline).ok());
  ASSERT_TRUE((*rank1)->post(&from1, sizeof from1, deadline).ok());
  int32_t all0[2] = {from0, 0}, all1[2] = {0, from1};
  ASSERT_TRUE((*rank0)->collect(all0, sizeof(int32_t), deadline).ok());
  ASSERT_TRUE((*rank1)->collect(all1, sizeof(int32_t), deadline).ok());
  EXPECT_EQ(all0[1], from1);
  EXPECT_EQ(all1[0], from0);
}

// Rank 0 is played by a socket that reads rank 1's hello and then closes without answering
// (a rank killed at that moment), or answers with a wrong nonce (not a rank of the group):
// the first is ABORTED saying no answer came, not that the peer failed to prove it belongs
// to the group (it said so for a killed rank); the second says so.
TEST(ControlMesh, APeerThatClosesIsNotTakenForAStranger) {
  for (const bool answers : {false, true}) {
    auto store = make_in_memory_store();
    const int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(listener, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
    ASSERT_EQ(::listen(listener, 4), 0);
    socklen_t length = sizeof address;
    ASSERT_EQ(::getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length), 0);
    ASSERT_TRUE(store
                    ->set("control/0", "127.0.0.1:" + std::to_string(ntohs(address.sin_port)) +
                                           " " + std::string(32, '0'))
                    .ok());
    std::thread fake_rank0([&] {
      const int fd = ::accept(listener, nullptr, nullptr);
      if (fd < 0) return;
      char hello[20];
      (void)net::recv_all(fd, hello, sizeof hello, Clock::now() + seconds(10));
      if (answers) {
        const char wrong[16] = {1};
        (void)net::send_all(fd, std::string_view(wrong, sizeof wrong), Clock::now() + seconds(5));
      }
      ::close(fd);
    });
    auto rank1 = ControlMesh::create(*store, 1, 2, "127.0.0.1", Clock::now() + seconds(20));
    fake_rank0.join();
    ::close(listener);
    ASSERT_FALSE(rank1.ok());
    EXPECT_EQ(rank1.status().code(), StatusCode::kAborted) << rank1.status().to_string();
    const bool stranger =
        rank1.status().message().find("did not prove it belongs") != std::string::npos;
    EXPECT_EQ(stranger, answers) << rank1.status().to_string();
    if (!answers) {
      EXPECT_NE(rank1.status().message().find("no answer to this rank's hello"), std::string::npos)
          << rank1.status().to_string();
    }
  }
}

// A store that answers every get after `delay`, as a TCP store's server answers while it is
// paused (stopped for a moment, or busy): a get given less time fails with TIMEOUT.
class SlowStore : public ForwardingStore {
 public:
  SlowStore(std::shared_ptr<Store> inner, std::chrono::milliseconds delay)
      : ForwardingStore(std::move(inner)), delay_(delay) {}
  StatusOr<std::string> get(std::string_view key, Milliseconds timeout) override {
    if (timeout < delay_) {
      std::this_thread::sleep_for(timeout);
      return timeout_error("get '" + std::string(key) + "': the store did not answer in time");
    }
    std::this_thread::sleep_for(delay_);
    return ForwardingStore::get(key, timeout - delay_);
  }

 private:
  std::chrono::milliseconds delay_;
};

// The ranks of a mesh of `size` made over `store` (each on a thread of its own) by
// `deadline`; empty, with the failures reported, when any is refused.
std::vector<std::unique_ptr<ControlMesh>> meshes(Store& store, int32_t size,
                                                 Clock::time_point deadline) {
  std::vector<StatusOr<std::unique_ptr<ControlMesh>>> made;
  for (int32_t r = 0; r < size; ++r) made.emplace_back(unavailable("not made"));
  std::vector<std::thread> ranks;
  for (int32_t r = 0; r < size; ++r) {
    ranks.emplace_back([&, r] {
      made[static_cast<size_t>(r)] = ControlMesh::create(store, r, size, "127.0.0.1", deadline);
    });
  }
  for (auto& t : ranks) t.join();
  std::vector<std::unique_ptr<ControlMesh>> out;
  for (auto& m : made) {
    EXPECT_TRUE(m.ok()) << m.status().to_string();
    if (!m.ok()) return {};
    out.push_back(std::move(m).value());
  }
  return out;
}

// Ranks 0 and 1 over a fresh store.
std::pair<std::unique_ptr<ControlMesh>, std::unique_ptr<ControlMesh>> mesh_pair() {
  auto made = meshes(*make_in_memory_store(), 2, Clock::now() + seconds(20));
  if (made.empty()) return {};
  return {std::move(made[0]), std::move(made[1])};
}

// The accepting rank reads the connecting peer's published address from the store; a store
// slow to answer (its server paused for 300 ms) delays the mesh, it does not refuse the peer
// (it read the address with a 1 ms timeout, closed rank 1 as "not a peer" and timed out).
TEST(ControlMesh, AStoreSlowToAnswerDelaysTheMeshButRefusesNoPeer) {
  SlowStore slow(make_in_memory_store(), std::chrono::milliseconds(300));
  EXPECT_EQ(meshes(slow, 2, Clock::now() + seconds(5)).size(), 2u);
}

// A rank that ends the group says why on its way out: its peer's collect() quotes it (after
// the messages posted before it), whole when short and cut at a character with "..." when
// long, its control bytes replaced; an abort says so. Over TCP a survivor's error named only
// the peer whose connection closed.
TEST(ControlMesh, APeerThatEndsTheGroupSaysWhy) {
  const auto deadline = Clock::now() + seconds(20);
  const std::string long_reason = std::string(500, 'x') + "\u00fc";
  for (const std::string& reason : {std::string("bad \x01 input \u00fc"), long_reason}) {
    auto [rank0, rank1] = mesh_pair();
    ASSERT_TRUE(rank0 && rank1);
    const int32_t posted = 11;
    ASSERT_TRUE(rank1->post(&posted, sizeof posted, deadline).ok());
    rank1->fail(reason);
    int32_t all[2] = {0, 0};
    ASSERT_TRUE(rank0->collect(all, sizeof(int32_t), deadline).ok());
    EXPECT_EQ(all[1], posted);
    const Status ended = rank0->collect(all, sizeof(int32_t), deadline);
    EXPECT_EQ(ended.code(), StatusCode::kAborted) << ended.to_string();
    const std::string& m = ended.message();
    ASSERT_EQ(m.rfind("rank 1 failed an earlier operation (its error: ", 0), 0u) << m;
    if (reason == long_reason) {
      const std::string quoted = m.substr(m.find(": ") + 2);
      EXPECT_EQ(quoted, std::string(380, 'x') + "...)") << m;
    } else {
      EXPECT_NE(m.find("(its error: bad ? input \u00fc)"), std::string::npos) << m;
    }
    // Later calls: the connection has ended.
    EXPECT_FALSE(rank0->collect(all, sizeof(int32_t), deadline).ok());
  }
  auto [rank0, rank1] = mesh_pair();
  ASSERT_TRUE(rank0 && rank1);
  rank1->abort();
  rank1->fail("too late: the abort said why first");
  int32_t all[2] = {0, 0};
  const Status ended = rank0->collect(all, sizeof(int32_t), deadline);
  EXPECT_EQ(ended.message(), "rank 1 aborted the communicator") << ended.to_string();
}

// check_peer_ended(peer) once it says so (the end of the connection comes a moment after the
// peer ended it), or as it says after a second.
Status ended_within_a_second(const ControlMesh& mesh, int32_t peer) {
  const auto until = Clock::now() + seconds(1);
  Status s = mesh.check_peer_ended(peer);
  while (s.ok() && Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    s = mesh.check_peer_ended(peer);
  }
  return s;
}

// After a transfer with a peer failed, farewell() reads past the messages the peer posted
// for collectives not collected here; check_peers_alive() reads a farewell at the head of
// the connection; a peer that closed without one (it exited) has none. check_peer_ended()
// sees the end past unread messages, and not once this rank's own mesh has ended.
TEST(ControlMesh, AFarewellIsFoundPastThePostedMessages) {
  const auto deadline = Clock::now() + seconds(20);
  const std::string closed = "rank 1 closed its control connection";
  {
    auto [rank0, rank1] = mesh_pair();
    ASSERT_TRUE(rank0 && rank1);
    for (int32_t i = 0; i < 100; ++i) ASSERT_TRUE(rank1->post(&i, sizeof i, deadline).ok());
    EXPECT_TRUE(rank0->check_peer_ended(1).ok());
    rank1->fail("its step failed");
    EXPECT_TRUE(rank0->check_peers_alive({1}).ok());  // messages first: not read yet
    const Status ended = ended_within_a_second(*rank0, 1);
    EXPECT_EQ(ended.code(), StatusCode::kAborted);
    EXPECT_EQ(ended.message().rfind(closed, 0), 0u) << ended.message();
    EXPECT_TRUE(rank1->check_peer_ended(0).ok());  // its own end, not rank 0's
    EXPECT_EQ(rank0->farewell(1, Clock::now() + seconds(5)),
              "rank 1 failed an earlier operation (its error: its step failed)");
  }
  {
    auto [rank0, rank1] = mesh_pair();
    ASSERT_TRUE(rank0 && rank1);
    rank1->abort();
    const Status alive = rank0->check_peers_alive({1});
    EXPECT_EQ(alive.message(), "rank 1 aborted the communicator") << alive.to_string();
    EXPECT_EQ(rank0->farewell(1, Clock::now() + seconds(5)), "rank 1 aborted the communicator");
  }
  {
    auto [rank0, rank1] = mesh_pair();
    ASSERT_TRUE(rank0 && rank1);
    const int32_t posted = 7;
    ASSERT_TRUE(rank1->post(&posted, sizeof posted, deadline).ok());
    rank1.reset();  // closed without a farewell
    EXPECT_EQ(ended_within_a_second(*rank0, 1).message().rfind(closed, 0), 0u);
    const auto start = Clock::now();
    EXPECT_EQ(rank0->farewell(1, Clock::now() + seconds(5)), std::nullopt);
    EXPECT_LT(Clock::now() - start, seconds(1));
  }
}

// A post to a peer that has ended the group fails quoting its farewell ("Broken pipe"
// before); a post cut short by this rank's own abort says so (it blamed the peer).
TEST(ControlMesh, APostThatFailsSaysWhy) {
  const auto deadline = Clock::now() + seconds(20);
  auto [rank0, rank1] = mesh_pair();
  ASSERT_TRUE(rank0 && rank1);
  rank1->fail("its step failed");
  Status posted = Status::Ok();
  for (int32_t i = 0; i < 200 && posted.ok(); ++i) {
    posted = rank0->post(&i, sizeof i, deadline);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(posted.message(), "rank 1 failed an earlier operation (its error: its step failed)")
      << posted.to_string();

  auto [mine, silent] = mesh_pair();  // `silent` reads nothing: the posts fill its socket
  ASSERT_TRUE(mine && silent);
  std::thread aborts([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    mine->abort();
  });
  std::vector<char> big(4096, 'x');
  do {
    posted = mine->post(big.data(), big.size(), deadline);
  } while (posted.ok());
  aborts.join();
  EXPECT_EQ(posted.message(), "the communicator was aborted") << posted.to_string();
}

// Rank 2 posted its message, then gave up (or aborted) while rank 1 is late: rank 0's
// collect(), waiting for rank 1, ends at once quoting rank 2 (it watched only the ranks
// whose message had not come, and waited for the late one until its deadline).
TEST(ControlMesh, APeerThatEndsTheGroupAfterItsMessageEndsTheWaitForALateOne) {
  for (const bool aborts : {false, true}) {
    auto ranks = meshes(*make_in_memory_store(), 3, Clock::now() + seconds(20));
    ASSERT_EQ(ranks.size(), 3u);
    const int32_t mine = 2;
    ASSERT_TRUE(ranks[2]->post(&mine, sizeof mine, Clock::now() + seconds(5)).ok());
    std::thread gives_up([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      if (aborts) {
        ranks[2]->abort();
      } else {
        ranks[2]->fail("no word from rank 1");
      }
    });
    int32_t all[3] = {0, 0, 0};
    const auto start = Clock::now();
    const Status s = ranks[0]->collect(all, sizeof(int32_t), Clock::now() + seconds(20));
    gives_up.join();
    EXPECT_LT(Clock::now() - start, seconds(5));
    EXPECT_EQ(s.code(), StatusCode::kAborted) << s.to_string();
    EXPECT_EQ(s.message(), aborts ? "rank 2 aborted the communicator"
                                  : "rank 2 failed an earlier operation (its error: no word "
                                    "from rank 1)")
        << s.to_string();
  }
}

}  // namespace
}  // namespace hps::gloo_backend
