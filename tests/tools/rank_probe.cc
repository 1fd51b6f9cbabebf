// A rank for the launcher tests. It prints its rendezvous variables, then:
//   rank_probe meet                      meets every other rank through the store of
//                                        open_store(rendezvous_from_env()) and exits 0;
//   rank_probe fail RANK CODE [stubborn] rank RANK exits CODE; the others sleep 60 s
//                                        (ignoring SIGTERM when "stubborn");
//   rank_probe signal RANK SIGNAL        rank RANK kills itself with SIGNAL; the others sleep;
//   rank_probe store-fd                  rank 0 checks HPS_STORE_FD is the store's listening
//                                        socket, then every rank meets;
//   rank_probe leak-shm                  every rank makes a shared-memory segment named for
//                                        its job (and the launcher's pid) and is killed
//                                        (SIGKILL) before removing it.
//   rank_probe split-exit                every rank creates the world communicator, splits
//                                        it into ranks 1..N-1 (rank 0 no member, done at
//                                        once), destroys both and its store, and exits 0.
//   rank_probe reopen                    twice: every rank opens the job's store, creates the
//                                        world, sums rank + 1 over it, and closes both;
//                                        rank 0 closes 300 ms late, so the others open the
//                                        store again before it has closed its own.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/comm/communicator.h"
#include "core/comm/host.h"
#include "core/comm/rendezvous.h"
#include "core/comm/shm/shm_group.h"
#include "core/comm/socket.h"

namespace {

int meet(const hps::RendezvousInfo& info) {
  auto store = hps::open_store(info.store_url, info.rank, std::chrono::seconds(20));
  if (!store.ok()) {
    std::fprintf(stderr, "open_store: %s\n", store.status().to_string().c_str());
    return 1;
  }
  const std::string mine = "probe/rank/" + std::to_string(info.rank);
  if (auto s = (*store)->set(mine, "hello from " + std::to_string(info.rank)); !s.ok()) {
    std::fprintf(stderr, "set: %s\n", s.to_string().c_str());
    return 1;
  }
  std::vector<std::string> keys;
  for (int32_t r = 0; r < info.world_size; ++r) keys.push_back("probe/rank/" + std::to_string(r));
  if (auto s = (*store)->wait(keys, std::chrono::seconds(30)); !s.ok()) {
    std::fprintf(stderr, "wait: %s\n", s.to_string().c_str());
    return 1;
  }
  for (int32_t r = 0; r < info.world_size; ++r) {
    auto value = (*store)->get(keys[static_cast<size_t>(r)], std::chrono::seconds(5));
    if (!value.ok() || *value != "hello from " + std::to_string(r)) {
      std::fprintf(stderr, "rank %d has a wrong value\n", r);
      return 1;
    }
  }
  // A client without the job's token is refused by a TCP store that has one.
  if (info.rank == 1 && info.store_url.rfind("tcp://", 0) == 0 && std::getenv("HPS_STORE_TOKEN")) {
    const std::string rest = info.store_url.substr(6);
    const auto colon = rest.rfind(':');
    auto stranger = hps::make_tcp_store(rest.substr(0, colon),
                                        static_cast<uint16_t>(std::stoi(rest.substr(colon + 1))),
                                        false, std::chrono::seconds(20));
    if (stranger.ok()) {
      std::fprintf(stderr, "a client without the token was served\n");
      return 1;
    }
    if (stranger.status().code() != hps::StatusCode::kFailedPrecondition) {
      std::fprintf(stderr, "a client without the token failed otherwise: %s\n",
                   stranger.status().to_string().c_str());
      return 1;
    }
    std::printf("a client without the token was refused\n");
  }
  // Rank 0 may serve the store: it leaves only after every rank is done with it.
  if (auto s = (*store)->set("probe/done/" + std::to_string(info.rank), "1"); !s.ok()) {
    std::fprintf(stderr, "set done: %s\n", s.to_string().c_str());
    return 1;
  }
  if (info.rank == 0) {
    std::vector<std::string> done;
    for (int32_t r = 0; r < info.world_size; ++r) done.push_back("probe/done/" + std::to_string(r));
    if (auto s = (*store)->wait(done, std::chrono::seconds(30)); !s.ok()) {
      std::fprintf(stderr, "wait done: %s\n", s.to_string().c_str());
      return 1;
    }
  }
  std::printf("rank %d of %d met every rank\n", info.rank, info.world_size);
  std::fprintf(stderr, "probe stderr from rank %d\n", info.rank);
  return 0;
}

// Nothing waits for the others at the end: rank 0, done first with the split, leaves while
// the members still make theirs over the store it serves.
// The job's store and the world communicator over it (20 s timeouts); false, the error
// printed after `what`, when either fails.
bool open_world(const hps::RendezvousInfo& info, const std::string& what,
                std::shared_ptr<hps::Store>* store, std::unique_ptr<hps::Communicator>* world) {
  auto opened = hps::open_store(info.store_url, info.rank, std::chrono::seconds(20));
  if (!opened.ok()) {
    std::fprintf(stderr, "%sopen_store: %s\n", what.c_str(), opened.status().to_string().c_str());
    return false;
  }
  *store = *opened;
  hps::CommOptions options;
  options.timeout = hps::Milliseconds(20'000);
  auto created =
      hps::create_communicator(*store, info.rank, info.world_size, hps::Device::cpu(), options);
  if (!created.ok()) {
    std::fprintf(stderr, "%screate: %s\n", what.c_str(), created.status().to_string().c_str());
    return false;
  }
  *world = std::move(*created);
  return true;
}

int split_exit(const hps::RendezvousInfo& info) {
  std::shared_ptr<hps::Store> store;
  std::unique_ptr<hps::Communicator> world;
  if (!open_world(info, "", &store, &world)) return 1;
  std::vector<int32_t> members;
  for (int32_t r = 1; r < info.world_size; ++r) members.push_back(r);
  auto part = world->split(members, "part");
  if (!part.ok()) {
    std::fprintf(stderr, "split: %s\n", part.status().to_string().c_str());
    return 1;
  }
  std::printf("rank %d made its side of the split\n", info.rank);
  return 0;
}

// Two phases of one program, each with the job's store and world of its own.
int reopen(const hps::RendezvousInfo& info) {
  for (int phase = 0; phase < 2; ++phase) {
    std::shared_ptr<hps::Store> store;
    std::unique_ptr<hps::Communicator> world;
    if (!open_world(info, "phase " + std::to_string(phase) + ": ", &store, &world)) return 1;
    double value = info.rank + 1, sum = 0;
    auto work = world->all_reduce(&value, &sum, 1, hps::DType::kFloat64, hps::ReduceOp::kSum);
    const hps::Status done = work.ok() ? (*work)->wait() : work.status();
    const double expected = info.world_size * (info.world_size + 1) / 2.0;
    if (!done.ok() || sum != expected) {
      std::fprintf(stderr, "phase %d: sum %g, not %g: %s\n", phase, sum, expected,
                   done.to_string().c_str());
      return 1;
    }
    std::printf("rank %d phase %d summed %g\n", info.rank, phase, sum);
    std::fflush(stdout);
    world.reset();
    if (info.rank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    store.reset();
  }
  return 0;
}

void sleep_long() {
  std::this_thread::sleep_for(std::chrono::seconds(60));
  std::printf("slept 60 s without being stopped\n");
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "meet";
  auto info = hps::rendezvous_from_env();
  if (!info.ok()) {
    std::fprintf(stderr, "rendezvous_from_env: %s\n", info.status().to_string().c_str());
    return 1;
  }
  for (const char* name : {"HPS_RANK", "HPS_WORLD_SIZE", "HPS_LOCAL_RANK", "HPS_STORE"}) {
    const char* value = std::getenv(name);
    std::printf("%s=%s\n", name, value ? value : "(unset)");
  }
  std::printf("source=%s\npid=%d\n", info->source.c_str(), static_cast<int>(::getpid()));
  // The job's name and whether a token came (never the token itself).
  const char* job = std::getenv("HPS_JOB_ID");
  const char* token = std::getenv("HPS_STORE_TOKEN");
  std::printf("HPS_JOB_ID=%s\ntoken bytes=%zu\n", job ? job : "(unset)",
              token ? std::strlen(token) : size_t{0});
  std::fflush(stdout);

  if (mode == "meet") return meet(*info);
  if (mode == "store-fd") {
    if (info->rank == 0) {
      const char* fd_text = std::getenv("HPS_STORE_FD");
      if (fd_text == nullptr) {
        std::fprintf(stderr, "rank 0 got no HPS_STORE_FD\n");
        return 1;
      }
      const int fd = std::atoi(fd_text);
      int listening = 0;
      socklen_t len = sizeof listening;
      const std::string port = ":" + std::to_string(hps::net::local_port(fd));
      if (::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 || !listening ||
          info->store_url.size() < port.size() ||
          info->store_url.compare(info->store_url.size() - port.size(), port.size(), port) != 0) {
        std::fprintf(stderr, "HPS_STORE_FD=%s is not the store's listening socket\n", fd_text);
        return 1;
      }
      std::printf("rank 0 holds the store's listening socket\n");
    } else if (std::getenv("HPS_STORE_FD") != nullptr) {
      std::fprintf(stderr, "rank %d got HPS_STORE_FD\n", info->rank);
      return 1;
    }
    return meet(*info);
  }
  if (mode == "split-exit") return split_exit(*info);
  if (mode == "reopen") return reopen(*info);
  if (mode == "leak-shm") {
    const char* job_id = std::getenv("HPS_JOB_ID");
    // Named for the launcher's pid, which lives until it has cleaned up: a segment named
    // for this rank's would be fair game for any other group's sweep of segments whose
    // process has ended (tests running beside this one), before the launcher got to it.
    const std::string name = "/hpshard-" + hps::shm::segment_job_tag(job_id ? job_id : "") + "-" +
                             std::to_string(hps::host::pid_namespace()) + "-" +
                             std::to_string(::getppid()) + "-" + std::to_string(info->rank) +
                             "-probe";
    const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
      std::fprintf(stderr, "shm_open %s failed\n", name.c_str());
      return 1;
    }
    std::printf("segment /dev/shm%s\n", name.c_str());
    std::fflush(stdout);
    std::raise(SIGKILL);
  }
  if ((mode == "fail" || mode == "signal") && argc >= 4) {
    const int target = std::atoi(argv[2]);
    const int value = std::atoi(argv[3]);
    if (info->rank != target) {
      if (argc >= 5 && std::string(argv[4]) == "stubborn") std::signal(SIGTERM, SIG_IGN);
      std::printf("rank %d sleeping\n", info->rank);
      std::fflush(stdout);
      sleep_long();
      return 0;
    }
    // Give the others time to start, so the launcher really has ranks to stop.
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    std::printf("rank %d %s %d\n", info->rank, mode == "fail" ? "exiting with" : "raising", value);
    std::fflush(stdout);
    if (mode == "fail") return value;
    std::signal(value, SIG_DFL);
    std::raise(value);
    return 1;
  }
  std::fprintf(stderr,
               "usage: rank_probe [meet | fail RANK CODE [stubborn] | signal RANK SIG | store-fd "
               "| leak-shm | split-exit | reopen]\n");
  return 2;
}
