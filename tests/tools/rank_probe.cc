// A rank for the launcher tests. It prints its rendezvous variables, then:
//   rank_probe meet                      meets every other rank through the store of
//                                        open_store(rendezvous_from_env()) and exits 0;
//   rank_probe fail RANK CODE [stubborn] rank RANK exits CODE; the others sleep 60 s
//                                        (ignoring SIGTERM when "stubborn");
//   rank_probe signal RANK SIGNAL        rank RANK kills itself with SIGNAL; the others sleep.
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "core/comm/rendezvous.h"

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
  std::fflush(stdout);

  if (mode == "meet") return meet(*info);
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
  std::fprintf(stderr, "usage: rank_probe [meet | fail RANK CODE [stubborn] | signal RANK SIG]\n");
  return 2;
}
