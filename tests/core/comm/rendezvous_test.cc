// rendezvous_from_env over each launcher's variables, their priority and bad input;
// open_store over each URL scheme.
#include "core/comm/rendezvous.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

#include "core/comm/socket.h"
#include "core/common/env.h"

namespace hps {
namespace {

using std::chrono::seconds;

constexpr const char* kVariables[] = {
    "HPS_RANK",
    "HPS_WORLD_SIZE",
    "HPS_LOCAL_RANK",
    "HPS_STORE",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "HPS_STORE_TOKEN",
    "HPS_STORE_FD",
    "HPS_JOB_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
};

// Every test starts with none of the variables set and leaves the environment as it was.
class RendezvousEnv : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* name : kVariables) {
      if (const char* value = std::getenv(name)) saved_[name] = value;
      ::unsetenv(name);
    }
  }
  void TearDown() override {
    for (const char* name : kVariables) {
      auto it = saved_.find(name);
      if (it != saved_.end()) {
        ::setenv(name, it->second.c_str(), 1);
      } else {
        ::unsetenv(name);
      }
    }
  }
  static void set(const char* name, const char* value) { ::setenv(name, value, 1); }

  // The error of rendezvous_from_env, which must fail.
  static Status failure() {
    auto info = rendezvous_from_env();
    EXPECT_FALSE(info.ok()) << "unexpectedly succeeded: " << info->source;
    return info.status();
  }

 private:
  std::map<std::string, std::string> saved_;
};

// The error names `variable`.
void expect_error_naming(const Status& s, const std::string& variable, const std::string& what) {
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find(variable), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(what), std::string::npos) << s.message();
}

TEST_F(RendezvousEnv, HpshardVariables) {
  set("HPS_RANK", "2");
  set("HPS_WORLD_SIZE", "4");
  set("HPS_LOCAL_RANK", "1");
  set("HPS_STORE", "file:///tmp/hps-rdzv");
  auto info = rendezvous_from_env();
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_EQ(info->rank, 2);
  EXPECT_EQ(info->world_size, 4);
  EXPECT_EQ(info->local_rank, 1);
  EXPECT_EQ(info->store_url, "file:///tmp/hps-rdzv");
  EXPECT_NE(info->source.find("HPS_RANK"), std::string::npos) << info->source;
  EXPECT_NE(info->source.find("HPS_LOCAL_RANK"), std::string::npos) << info->source;
}

TEST_F(RendezvousEnv, LocalRankDefaultsToRank) {
  set("HPS_RANK", "3");
  set("HPS_WORLD_SIZE", "4");
  set("HPS_STORE", "tcp://10.0.0.1:29500");
  auto info = rendezvous_from_env();
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_EQ(info->local_rank, 3);
  EXPECT_EQ(info->source.find("HPS_LOCAL_RANK"), std::string::npos) << info->source;
}

TEST_F(RendezvousEnv, Torchrun) {
  set("RANK", "5");
  set("WORLD_SIZE", "8");
  set("LOCAL_RANK", "1");
  set("MASTER_ADDR", "node0");
  set("MASTER_PORT", "29500");
  auto info = rendezvous_from_env();
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_EQ(info->rank, 5);
  EXPECT_EQ(info->world_size, 8);
  EXPECT_EQ(info->local_rank, 1);
  EXPECT_EQ(info->store_url, "tcp://node0:29500");
  EXPECT_NE(info->source.find("torchrun"), std::string::npos) << info->source;
  EXPECT_NE(info->source.find("MASTER_ADDR"), std::string::npos) << info->source;

  set("MASTER_ADDR", "fd00::1");  // an IPv6 address is bracketed in the URL
  EXPECT_EQ(rendezvous_from_env()->store_url, "tcp://[fd00::1]:29500");
  set("MASTER_ADDR", "[fd00::1]");  // brackets given already: not doubled
  EXPECT_EQ(rendezvous_from_env()->store_url, "tcp://[fd00::1]:29500");
  set("MASTER_ADDR", "fe80::1%eth0");  // with a zone
  EXPECT_EQ(rendezvous_from_env()->store_url, "tcp://[fe80::1%eth0]:29500");
  // Text with a colon that is no IPv6 address (host:port) is refused at once, naming the
  // variable: it was bracketed as one, and rank 1 waited the whole timeout for it.
  for (const char* bad :
       {"127.0.0.1:29500", "node0:29500", "[node0]", "::zz", "[1.2.3.4]", "fe80::1%"}) {
    set("MASTER_ADDR", bad);
    expect_error_naming(failure(), "MASTER_ADDR", "not a host name or an IP address");
  }
  set("HPS_STORE", "file:///shared/rdzv");  // HPS_STORE wins over MASTER_*
  EXPECT_EQ(rendezvous_from_env()->store_url, "file:///shared/rdzv");
}

// torchrun's agent serves torch's own store on MASTER_PORT: refused at once with what to
// do (rank 0 could not listen there, the others timed out in a handshake with torch's store).
TEST_F(RendezvousEnv, TorchrunsAgentStoreIsNotTaken) {
  set("RANK", "1");
  set("WORLD_SIZE", "2");
  set("MASTER_ADDR", "node0");
  set("MASTER_PORT", "29500");
  set("TORCHELASTIC_USE_AGENT_STORE", "True");
  const Status s = failure();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("torchrun's agent store"), std::string::npos) << s.to_string();
  EXPECT_NE(s.message().find("HPS_STORE"), std::string::npos) << s.to_string();
  set("HPS_STORE", "tcp://node0:29501");  // given: taken
  auto info = rendezvous_from_env();
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_EQ(info->store_url, "tcp://node0:29501");
  // HPS_STORE naming the agent's own host and port is refused as well, naming HPS_STORE:
  // the same name in any case, or another spelling of its address (resolved).
  const std::pair<const char*, const char*> agent_spellings[] = {
      {"node0", "tcp://node0:29500"},
      {"node0", "tcp://NODE0:29500"},
      {"localhost", "tcp://127.0.0.1:29500"},
      {"::1", "tcp://[0:0::1]:29500"}};
  for (const auto& [master, store] : agent_spellings) {
    set("MASTER_ADDR", master);
    set("HPS_STORE", store);
    expect_error_naming(failure(), "HPS_STORE", "torchrun's agent store");
  }
  set("MASTER_ADDR", "node0");
  set("HPS_STORE", "tcp://node1:29500");  // another host's port of that number: taken
  EXPECT_TRUE(rendezvous_from_env().ok());
  set("TORCHELASTIC_USE_AGENT_STORE", "False");  // without the agent's store: MASTER_PORT
  set("HPS_STORE", "tcp://node0:29500");
  EXPECT_TRUE(rendezvous_from_env().ok());
  ::unsetenv("HPS_STORE");
  EXPECT_EQ(rendezvous_from_env()->store_url, "tcp://node0:29500");
}

TEST_F(RendezvousEnv, OpenMpi) {
  set("OMPI_COMM_WORLD_RANK", "1");
  set("OMPI_COMM_WORLD_SIZE", "2");
  set("OMPI_COMM_WORLD_LOCAL_RANK", "0");
  set("HPS_STORE", "tcp://head:1234");
  auto info = rendezvous_from_env();
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_EQ(info->rank, 1);
  EXPECT_EQ(info->world_size, 2);
  EXPECT_EQ(info->local_rank, 0);
  EXPECT_EQ(info->store_url, "tcp://head:1234");
  EXPECT_NE(info->source.find("Open MPI"), std::string::npos) << info->source;
  EXPECT_NE(info->source.find("HPS_STORE"), std::string::npos) << info->source;

  ::unsetenv("HPS_STORE");
  set("MASTER_ADDR", "head");
  set("MASTER_PORT", "4321");
  EXPECT_EQ(rendezvous_from_env()->store_url, "tcp://head:4321");
}

TEST_F(RendezvousEnv, Slurm) {
  set("SLURM_PROCID", "6");
  set("SLURM_NTASKS", "7");
  set("SLURM_LOCALID", "2");
  set("MASTER_ADDR", "10.1.2.3");
  set("MASTER_PORT", "29400");
  auto info = rendezvous_from_env();
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_EQ(info->rank, 6);
  EXPECT_EQ(info->world_size, 7);
  EXPECT_EQ(info->local_rank, 2);
  EXPECT_EQ(info->store_url, "tcp://10.1.2.3:29400");
  EXPECT_NE(info->source.find("Slurm"), std::string::npos) << info->source;
}

TEST_F(RendezvousEnv, PriorityIsHpshardTorchrunOpenMpiSlurm) {
  set("SLURM_PROCID", "3");
  set("SLURM_NTASKS", "4");
  set("OMPI_COMM_WORLD_RANK", "2");
  set("OMPI_COMM_WORLD_SIZE", "4");
  set("RANK", "1");
  set("WORLD_SIZE", "4");
  set("HPS_RANK", "0");
  set("HPS_WORLD_SIZE", "4");
  set("HPS_STORE", "memory://priority");
  set("MASTER_ADDR", "m");
  set("MASTER_PORT", "1");
  EXPECT_EQ(rendezvous_from_env()->rank, 0);
  ::unsetenv("HPS_RANK");
  ::unsetenv("HPS_WORLD_SIZE");
  EXPECT_EQ(rendezvous_from_env()->rank, 1);
  ::unsetenv("RANK");
  ::unsetenv("WORLD_SIZE");
  EXPECT_EQ(rendezvous_from_env()->rank, 2);
  ::unsetenv("OMPI_COMM_WORLD_RANK");
  ::unsetenv("OMPI_COMM_WORLD_SIZE");
  auto slurm = rendezvous_from_env();
  ASSERT_TRUE(slurm.ok()) << slurm.status().to_string();
  EXPECT_EQ(slurm->rank, 3);
  EXPECT_NE(slurm->source.find("Slurm"), std::string::npos);
}

TEST_F(RendezvousEnv, NothingSetIsNotFound) {
  const Status s = failure();
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_NE(s.message().find("HPS_RANK"), std::string::npos) << s.message();
}

TEST_F(RendezvousEnv, MissingVariablesAreNamed) {
  set("HPS_RANK", "0");
  expect_error_naming(failure(), "HPS_WORLD_SIZE", "not set");
  set("HPS_WORLD_SIZE", "2");
  expect_error_naming(failure(), "HPS_STORE", "not set");

  SetUp();  // clear
  set("WORLD_SIZE", "2");
  expect_error_naming(failure(), "RANK", "not set");
  set("RANK", "0");
  expect_error_naming(failure(), "MASTER_ADDR", "not set");
  set("MASTER_ADDR", "head");
  expect_error_naming(failure(), "MASTER_PORT", "not set");
}

TEST_F(RendezvousEnv, MalformedValuesAreNamed) {
  set("HPS_WORLD_SIZE", "4");
  set("HPS_STORE", "memory://bad");
  set("HPS_RANK", "one");
  expect_error_naming(failure(), "HPS_RANK", "not an integer");
  set("HPS_RANK", "");
  expect_error_naming(failure(), "HPS_RANK", "not an integer");
  set("HPS_RANK", "1x");
  expect_error_naming(failure(), "HPS_RANK", "not an integer");
  set("HPS_RANK", "99999999999");
  expect_error_naming(failure(), "HPS_RANK", "out of range");
  set("HPS_RANK", "4");
  expect_error_naming(failure(), "HPS_RANK", "outside [0, 4)");
  set("HPS_RANK", "-1");
  expect_error_naming(failure(), "HPS_RANK", "outside [0, 4)");
  set("HPS_RANK", "0");
  set("HPS_WORLD_SIZE", "0");
  expect_error_naming(failure(), "HPS_WORLD_SIZE", "at least 1");
  set("HPS_WORLD_SIZE", "4");
  set("HPS_LOCAL_RANK", "-2");
  expect_error_naming(failure(), "HPS_LOCAL_RANK", "outside");
  ::unsetenv("HPS_LOCAL_RANK");
  set("HPS_STORE", "ftp://host/x");
  expect_error_naming(failure(), "HPS_STORE", "unknown scheme 'ftp'");
  set("HPS_STORE", "tcp://host");
  expect_error_naming(failure(), "HPS_STORE", "host:port");
  set("HPS_STORE", "tcp://host:99999");
  expect_error_naming(failure(), "HPS_STORE", "port");
  set("HPS_STORE", "file://relative/dir");
  expect_error_naming(failure(), "HPS_STORE", "absolute path");
  set("HPS_STORE", "/no/scheme");
  expect_error_naming(failure(), "HPS_STORE", "no scheme");

  SetUp();
  set("RANK", "0");
  set("WORLD_SIZE", "2");
  set("MASTER_ADDR", "head");
  set("MASTER_PORT", "http");
  expect_error_naming(failure(), "MASTER_PORT", "not a port");
  set("MASTER_PORT", "0");
  expect_error_naming(failure(), "MASTER_PORT", "not a port");
  set("MASTER_PORT", "65536");
  expect_error_naming(failure(), "MASTER_PORT", "not a port");
  set("MASTER_PORT", "29500");
  // Hosts a resolver would take for something else (or fail on, naming no variable).
  for (const char* addr : {" 127.0.0.1", "[::1", "a/b", "x\ny", "host name", "[fd00::1]x"}) {
    set("MASTER_ADDR", addr);
    expect_error_naming(failure(), "MASTER_ADDR", "not a host name or an IP address");
  }
  set("MASTER_ADDR", "node-0.cluster_a");
  EXPECT_TRUE(rendezvous_from_env().ok());
  set("MASTER_ADDR", "head");
  set("WORLD_SIZE", "-3");
  expect_error_naming(failure(), "WORLD_SIZE", "at least 1");
  set("WORLD_SIZE", "2");
  set("HPS_RANK", "0");
  set("HPS_WORLD_SIZE", "2");
  for (const char* url : {"tcp://[::1]]:29500", "tcp://127.0.0.1:1:2", "tcp://h%st:1"}) {
    set("HPS_STORE", url);
    expect_error_naming(failure(), "HPS_STORE", "not a host name or an IP address");
  }
  set("HPS_STORE", "tcp://[fe80::1%lo]:29500");  // an IPv6 address with its zone
  EXPECT_TRUE(rendezvous_from_env().ok());
}

// HPS_STORE and MASTER_PORT come from outside: a message shows at most 64 of their bytes,
// the others as \xNN, never a terminal escape or a value's whole length.
TEST_F(RendezvousEnv, StoreAndPortValuesAreShownEscapedAndCut) {
  auto expect_shown = [](const Status& status, const char* variable, size_t length) {
    const std::string message(status.message());
    EXPECT_NE(message.find(variable), std::string::npos) << message;
    EXPECT_FALSE(has_control_bytes(message)) << shown_value(message);
    EXPECT_LT(message.size(), 400u) << shown_value(message);
    if (length > 64) {
      EXPECT_NE(message.find("(" + std::to_string(length) + " bytes)"), std::string::npos)
          << message;
    } else {
      EXPECT_NE(message.find("\\x1b"), std::string::npos) << message;
    }
  };
  set("HPS_RANK", "0");
  set("HPS_WORLD_SIZE", "1");
  const std::string long_value(100000, 'a');
  for (const std::string& url : std::vector<std::string>{
           "\033[2J\033[31mEVIL", long_value, "file://" + long_value, long_value + "://x",
           "tcp://" + long_value, "tcp://[" + long_value, "tcp://host:" + long_value,
           "tcp://host:\033]0;pwned\007", "tcp://:1\033[2J", "\033[2J://x"}) {
    set("HPS_STORE", url.c_str());
    expect_shown(failure(), "HPS_STORE", url.size());
  }
  SetUp();
  set("RANK", "0");
  set("WORLD_SIZE", "1");
  set("MASTER_ADDR", "localhost");
  for (const std::string& port :
       std::vector<std::string>{"\033]0;pwned\007", std::string(100000, '1')}) {
    set("MASTER_PORT", port.c_str());
    expect_shown(failure(), "MASTER_PORT", port.size());
  }
}

TEST_F(RendezvousEnv, StoreOptionsComeFromTheEnvironment) {
  set("HPS_STORE_TOKEN", "s3cret");
  set("HPS_JOB_ID", "job-7");
  set("HPS_RANK", "0");
  set("HPS_WORLD_SIZE", "3");
  set("HPS_STORE", "tcp://127.0.0.1:29500");
  auto o = store_options_from_env("tcp://127.0.0.1:29500", 0);
  ASSERT_TRUE(o.ok()) << o.status().to_string();
  EXPECT_EQ(o->token, "s3cret");
  EXPECT_EQ(o->job.id, "job-7");
  EXPECT_EQ(o->world_size, 3);
  EXPECT_EQ(o->listen_fd, -1);
  // The world size belongs to the environment's store only.
  EXPECT_EQ(store_options_from_env("file:///elsewhere", 0)->world_size, 0);

  set("HPS_STORE_TOKEN", "");
  auto empty = store_options_from_env("tcp://127.0.0.1:29500", 0);
  ASSERT_FALSE(empty.ok());
  EXPECT_NE(empty.status().message().find("HPS_STORE_TOKEN"), std::string::npos);
  set("HPS_STORE_TOKEN", std::string(2000, 't').c_str());
  EXPECT_EQ(store_options_from_env("tcp://127.0.0.1:29500", 0).status().code(),
            StatusCode::kInvalidArgument);
}

// hpshard-run hands rank 0 its bound socket; anything else in HPS_STORE_FD is refused by name.
TEST_F(RendezvousEnv, RankZeroTakesTheListeningSocketHandedDownOnce) {
  auto listener = net::listen_on("127.0.0.1", 0, 16);
  ASSERT_TRUE(listener.ok());
  const std::string url = "tcp://127.0.0.1:" + std::to_string(listener->port);
  set("HPS_RANK", "0");
  set("HPS_WORLD_SIZE", "2");
  set("HPS_STORE", url.c_str());
  set("HPS_STORE_FD", "not-a-number");
  auto bad = store_options_from_env(url, 0);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("HPS_STORE_FD"), std::string::npos)
      << bad.status().message();
  set("HPS_STORE_FD", std::to_string(listener->fd).c_str());
  // Another rank, or another store, does not take it.
  EXPECT_EQ(store_options_from_env(url, 1)->listen_fd, -1);
  auto o = store_options_from_env(url, 0);
  ASSERT_TRUE(o.ok()) << o.status().to_string();
  EXPECT_EQ(o->listen_fd, listener->fd);
  // Taken once per process.
  EXPECT_EQ(store_options_from_env(url, 0)->listen_fd, -1);
  std::thread client([&] {
    auto rank1 = open_store(url, 1, seconds(5), StoreOptions{});
    EXPECT_TRUE(rank1.ok()) << rank1.status().to_string();
  });
  auto rank0 = open_store(url, 0, seconds(5), *o);
  client.join();
  ASSERT_TRUE(rank0.ok()) << rank0.status().to_string();
}

// HPS_STORE_FD is for rank 0 of a TCP store: a file or memory store does not read it (a
// stale one in the environment refused the store, or closed the caller's socket).
TEST_F(RendezvousEnv, AFileOrMemoryStoreLeavesTheSocketVariableAlone) {
  auto listener = net::listen_on("127.0.0.1", 0, 16);
  ASSERT_TRUE(listener.ok());
  const int not_a_socket = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(not_a_socket, 0);
  set("HPS_RANK", "0");
  set("HPS_WORLD_SIZE", "1");
  for (const std::string url : {"memory://socket-variable", "file:///nonexistent/hps-store"}) {
    set("HPS_STORE", url.c_str());
    set("HPS_STORE_FD", std::to_string(not_a_socket).c_str());  // would be refused
    auto o = store_options_from_env(url, 0);
    ASSERT_TRUE(o.ok()) << url << ": " << o.status().to_string();
    EXPECT_EQ(o->listen_fd, -1) << url;
    set("HPS_STORE_FD", std::to_string(listener->fd).c_str());
    o = store_options_from_env(url, 0);
    ASSERT_TRUE(o.ok()) << url << ": " << o.status().to_string();
    EXPECT_EQ(o->listen_fd, -1) << url;
  }
  // Still open: nothing took it.
  EXPECT_NE(net::local_port(listener->fd), 0);
  net::close_fd(listener->fd);
  ::close(not_a_socket);
}

// A socket handed down bound to another address than the URL names is refused, saying so
// (rank 0 timed out connecting to its own server).
TEST(OpenStore, ASocketHandedDownOnAnotherAddressIsRefused) {
  auto listener = net::listen_on("127.0.0.2", 0, 16);
  ASSERT_TRUE(listener.ok()) << listener.status().to_string();
  StoreOptions o;
  o.listen_fd = listener->fd;
  const std::string url = "tcp://127.0.0.1:" + std::to_string(listener->port);
  const auto start = std::chrono::steady_clock::now();
  auto s = open_store(url, 0, seconds(5), o);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument) << s.status().to_string();
  EXPECT_NE(s.status().message().find("bound to 127.0.0.2"), std::string::npos)
      << s.status().to_string();
  EXPECT_LT(std::chrono::steady_clock::now() - start, seconds(2));
  // Bound to every address: taken.
  auto any = net::listen_on("0.0.0.0", 0, 16);
  ASSERT_TRUE(any.ok());
  o.listen_fd = any->fd;
  auto served = open_store("tcp://127.0.0.1:" + std::to_string(any->port), 0, seconds(5), o);
  EXPECT_TRUE(served.ok()) << served.status().to_string();
  // Bound to every IPv4 address, with an IPv6 URL: that family's connections never arrive.
  auto v4_any = net::listen_on("0.0.0.0", 0, 16);
  ASSERT_TRUE(v4_any.ok());
  o.listen_fd = v4_any->fd;
  auto other_family = open_store("tcp://[::1]:" + std::to_string(v4_any->port), 0, seconds(5), o);
  ASSERT_FALSE(other_family.ok());
  EXPECT_EQ(other_family.status().code(), StatusCode::kInvalidArgument)
      << other_family.status().to_string();
  EXPECT_NE(other_family.status().message().find("bound to 0.0.0.0"), std::string::npos)
      << other_family.status().to_string();
}

// ---- open_store --------------------------------------------------------------------

TEST(OpenStore, MemoryStoresAreSharedByName) {
  auto a = open_store("memory://open-store-test", 0, seconds(1));
  auto b = open_store("memory://open-store-test", 1, seconds(1));
  auto c = open_store("memory://another", 0, seconds(1));
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  ASSERT_TRUE((*a)->set("k", "shared").ok());
  EXPECT_EQ(*(*b)->get("k", seconds(1)), "shared");
  EXPECT_FALSE(*(*c)->check({"k"}));
}

TEST(OpenStore, FileUrl) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("hps_open_store_test." + std::to_string(::getpid()));
  auto a = open_store("file://" + dir.string(), 0, seconds(1));
  auto b = open_store("file://" + dir.string(), 1, seconds(1));
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  ASSERT_TRUE((*a)->set("k", "on disk").ok());
  EXPECT_EQ(*(*b)->get("k", seconds(1)), "on disk");
  EXPECT_TRUE(std::filesystem::is_directory(dir));
  std::filesystem::remove_all(dir);
}

TEST(OpenStore, TcpUrlRankZeroServes) {
  uint16_t port = 0;
  {
    auto probe = TcpStoreServer::start("127.0.0.1", 0);
    ASSERT_TRUE(probe.ok());
    port = (*probe)->port();
  }
  for (const std::string host : {"127.0.0.1", "localhost"}) {
    const std::string url = "tcp://" + host + ":" + std::to_string(port);
    // Rank 1 starts first and waits for rank 0's server.
    StatusOr<std::shared_ptr<Store>> rank1 = unavailable("not opened");
    std::thread early([&] { rank1 = open_store(url, 1, seconds(5)); });
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    auto rank0 = open_store(url, 0, seconds(5));
    early.join();
    ASSERT_TRUE(rank0.ok()) << url << ": " << rank0.status().to_string();
    ASSERT_TRUE(rank1.ok()) << url << ": " << rank1.status().to_string();
    ASSERT_TRUE((*rank1)->set("from", "rank 1").ok());
    EXPECT_EQ(*(*rank0)->get("from", seconds(1)), "rank 1");
    rank1 = unavailable("closed");  // clients before the server
  }
}

// Rank 0 whose port another process holds (a second rank 0 of the job: HPS_RANK=0 given to
// two ranks) is told so, not only "Address already in use" (launcher red team).
TEST(OpenStore, RankZeroWhosePortIsHeldIsToldWhy) {
  auto holder = net::listen_on("127.0.0.1", 0, 16);
  ASSERT_TRUE(holder.ok());
  const std::string url = "tcp://127.0.0.1:" + std::to_string(holder->port);
  auto rank0 = open_store(url, 0, seconds(5));
  net::close_fd(holder->fd);
  ASSERT_EQ(rank0.status().code(), StatusCode::kUnavailable) << rank0.status().to_string();
  const std::string m = rank0.status().message();
  EXPECT_NE(m.find("Address already in use"), std::string::npos) << m;
  EXPECT_NE(m.find("a second rank 0 of this job"), std::string::npos) << m;
  EXPECT_NE(m.find(url), std::string::npos) << m;
}

// The store a C API handle holds (open_store's job and prefix stores under an abortable
// one): aborted, rank 0's serving store goes without waiting for a rank that never closes
// its connection (a peer stopped, a program leaving on Ctrl-C); not aborted, it waits.
TEST(OpenStore, AnAbortedServingStoreGoesWithoutWaitingForTheOthers) {
  for (const bool abort : {true, false}) {
    uint16_t port = 0;
    {
      auto probe = TcpStoreServer::start("127.0.0.1", 0);
      ASSERT_TRUE(probe.ok());
      port = (*probe)->port();
    }
    const std::string url = "tcp://127.0.0.1:" + std::to_string(port);
    StatusOr<std::shared_ptr<Store>> rank1 = unavailable("not opened");
    std::thread early([&] { rank1 = open_store(url, 1, seconds(5)); });
    auto rank0 = open_store(url, 0, seconds(2));
    early.join();
    ASSERT_TRUE(rank0.ok()) << rank0.status().to_string();
    ASSERT_TRUE(rank1.ok()) << rank1.status().to_string();
    auto handle = std::make_shared<AbortableStore>(*rank0);
    rank0 = unavailable("held by the handle");
    if (abort) handle->abort();
    const auto start = std::chrono::steady_clock::now();
    handle.reset();
    const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::steady_clock::now() - start);
    if (abort) {
      EXPECT_LT(took.count(), 1000) << "the aborted serving store waited for rank 1";
    } else {
      EXPECT_GE(took.count(), 1500) << "the serving store did not wait for rank 1";
    }
    rank1 = unavailable("closed");
  }
}

// Whether a socket listens on `port` bound to `address` (hex as in /proc/net/tcp,
// e.g. 0100007F for 127.0.0.1).
bool listening_on(uint16_t port, const std::string& address) {
  std::ifstream tcp("/proc/net/tcp");
  std::string line;
  std::getline(tcp, line);
  char wanted[16];
  std::snprintf(wanted, sizeof wanted, ":%04X", port);
  while (std::getline(tcp, line)) {
    std::istringstream fields(line);
    std::string slot, local, remote, state;
    fields >> slot >> local >> remote >> state;
    if (state == "0A" && local.size() > 5 && local.substr(local.size() - 5) == wanted) {
      return local.substr(0, local.size() - 5) == address;
    }
  }
  return false;
}

TEST(OpenStore, LocalhostBindsLoopbackAndANumericAddressItself) {
  EXPECT_EQ(*store_bind_address("localhost"), "127.0.0.1");
  EXPECT_EQ(*store_bind_address("LocalHost"), "127.0.0.1");
  EXPECT_EQ(*store_bind_address("node.localhost"), "127.0.0.1");
  EXPECT_EQ(*store_bind_address("10.1.2.3"), "10.1.2.3");
  EXPECT_EQ(*store_bind_address("::1"), "::1");
  char own[256] = {};
  ::gethostname(own, sizeof own - 1);
  EXPECT_EQ(*store_bind_address(own), "0.0.0.0");

  uint16_t port = 0;
  {
    auto probe = TcpStoreServer::start("127.0.0.1", 0);
    ASSERT_TRUE(probe.ok());
    port = (*probe)->port();
  }
  auto store = open_store("tcp://localhost:" + std::to_string(port), 0, seconds(5));
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  EXPECT_TRUE(listening_on(port, "0100007F")) << "tcp://localhost did not bind 127.0.0.1 only";
}

TEST(OpenStore, ATcpStoreServesOnlyRanksWithTheToken) {
  uint16_t port = 0;
  {
    auto probe = TcpStoreServer::start("127.0.0.1", 0);
    ASSERT_TRUE(probe.ok());
    port = (*probe)->port();
  }
  const std::string url = "tcp://127.0.0.1:" + std::to_string(port);
  StoreOptions with;
  with.token = "job token";
  StatusOr<std::shared_ptr<Store>> rank1 = unavailable("not opened");
  std::thread early([&] { rank1 = open_store(url, 1, seconds(5), with); });
  auto rank0 = open_store(url, 0, seconds(5), with);
  early.join();
  ASSERT_TRUE(rank0.ok()) << rank0.status().to_string();
  ASSERT_TRUE(rank1.ok()) << rank1.status().to_string();
  auto stranger = open_store(url, 2, seconds(5), StoreOptions{});
  ASSERT_FALSE(stranger.ok());
  EXPECT_EQ(stranger.status().code(), StatusCode::kFailedPrecondition);
  rank1 = unavailable("closed");
}

TEST(OpenStore, BadUrlsAreInvalidArguments) {
  for (const char* url :
       {"ftp://x", "memory://", "file://relative", "tcp://:80", "tcp://h:0", "tcp://h:port",
        "tcp://[::1]80", "no-scheme", "tcp://[zzz]:80", "tcp://[1.2.3.4]:80", "tcp://[::1%]:80"}) {
    auto s = open_store(url, 0, seconds(1));
    ASSERT_FALSE(s.ok()) << url;
    EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument) << url;
    EXPECT_NE(s.status().message().find(url), std::string::npos) << s.status().message();
  }
  EXPECT_EQ(open_store("memory://x", -1, seconds(1)).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hps
