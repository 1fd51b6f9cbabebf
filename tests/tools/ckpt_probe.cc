// The crash-safety probe of the checkpoint tests (ckpt_crash_test.sh):
//
//   ckpt_probe save ROOT KILL_RANK KILL_AFTER_US   (under hpshard-run) trains a stage 2
//       engine, saves checkpoint "a" and waits for it, trains a step, then saves "b"; rank
//       KILL_RANK kills itself with SIGKILL KILL_AFTER_US microseconds after save("b")
//       returned (-1: nobody is killed and the save's duration is printed; -2: killed once
//       "b" is published).
//   ckpt_probe check ROOT   (one process) "a" verifies and loads; "b" is absent or verifies
//       and loads; latest names one of them and loads; then a save of "c" removes what the
//       killed save left and keeps them. Prints "b complete" or "b absent".
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "core/checkpoint/checkpointer.h"
#include "core/checkpoint/file_io.h"
#include "core/comm/rendezvous.h"
#include "core/sharding/sharded_engine.h"

namespace {

using namespace hps;
using Clock = std::chrono::steady_clock;

[[noreturn]] void die(const std::string& what, const Status& s) {
  std::fprintf(stderr, "ckpt_probe: %s: %s\n", what.c_str(), s.to_string().c_str());
  std::fflush(stderr);
  std::_Exit(1);
}

// A model of 2 Mi + 1000 float32 parameters: 6 MiB of state with AdamW.
std::unique_ptr<ShardedEngine> make_engine(std::shared_ptr<Communicator> world) {
  EngineOptions o;
  o.optimizer = OptimizerKind::kAdamW;
  auto engine = create_sharded_engine(2, world, nullptr, o);
  if (!engine.ok()) die("engine", engine.status());
  auto& e = **engine;
  if (!e.add_param({"big", {512, 1024}, DType::kFloat32}).ok() ||
      !e.add_param({"small", {1000}, DType::kFloat32}).ok()) {
    die("add_param", internal_error("refused"));
  }
  if (Status s = e.seal(); !s.ok()) die("seal", s);
  for (size_t p = 0; p < 2; ++p) {
    float* v = *e.param(p);
    const uint64_t n = e.plan().params()[p].numel();
    for (uint64_t i = 0; i < n; ++i) v[i] = static_cast<float>(i % 97) * 0.01f;
  }
  if (Status s = e.broadcast_parameters(); !s.ok()) die("broadcast", s);
  return std::move(*engine);
}

void train_step(ShardedEngine& e, int32_t rank, int step) {
  if (Status s = e.gather(0); !s.ok()) die("gather", s);
  for (size_t p = 0; p < 2; ++p) {
    float* g = *e.grad(p);
    const uint64_t n = e.plan().params()[p].numel();
    for (uint64_t i = 0; i < n; ++i)
      g[i] += static_cast<float>((i + static_cast<uint64_t>(rank + step)) % 13) * 0.1f;
    if (Status s = e.grad_ready(p, nullptr); !s.ok()) die("grad_ready", s);
  }
  if (Status s = e.step(); !s.ok()) die("step", s);
}

int save(const std::string& root, int32_t kill_rank, long long kill_after_us) {
  auto info = rendezvous_from_env();
  if (!info.ok()) die("rendezvous", info.status());
  auto store = open_store(info->store_url, info->rank, std::chrono::seconds(30));
  if (!store.ok()) die("store", store.status());
  auto comm = create_communicator(*store, info->rank, info->world_size, Device::cpu());
  if (!comm.ok()) die("communicator", comm.status());
  std::shared_ptr<Communicator> world(std::move(*comm));
  auto engine = make_engine(world);
  auto checkpointer =
      Checkpointer::create(*dynamic_cast<Checkpointable*>(engine.get()), world, root);
  if (!checkpointer.ok()) die("checkpointer", checkpointer.status());
  train_step(*engine, info->rank, 0);
  auto a = (*checkpointer)->save("a", {{"step", "1"}});
  if (!a.ok()) die("save a", a.status());
  if (Status s = (*a)->wait(); !s.ok()) die("save a", s);
  std::printf("a published\n");
  std::fflush(stdout);
  train_step(*engine, info->rank, 1);
  const auto start = Clock::now();
  auto b = (*checkpointer)->save("b", {{"step", "2"}});
  if (!b.ok()) die("save b", b.status());
  const bool killer = info->rank == kill_rank;
  if (killer && kill_after_us >= 0) {
    std::thread([kill_after_us] {
      std::this_thread::sleep_for(std::chrono::microseconds(kill_after_us));
      std::raise(SIGKILL);
    }).detach();
  }
  const Status s = (*b)->wait();
  const long long took =
      std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start).count();
  if (!s.ok()) die("save b", s);
  std::printf("b published after %lld us\n", took);
  std::fflush(stdout);
  if (killer && kill_after_us == -2) std::raise(SIGKILL);
  if (kill_after_us != -1) std::this_thread::sleep_for(std::chrono::seconds(60));  // until killed
  return 0;
}

int check(const std::string& root) {
  auto store = make_in_memory_store();
  auto comm = create_communicator(store, 0, 1, Device::cpu());
  if (!comm.ok()) die("communicator", comm.status());
  std::shared_ptr<Communicator> world(std::move(*comm));
  auto engine = make_engine(world);
  auto checkpointer =
      Checkpointer::create(*dynamic_cast<Checkpointable*>(engine.get()), world, root);
  if (!checkpointer.ok()) die("checkpointer", checkpointer.status());
  if (auto v = verify_checkpoint(root + "/a"); !v.ok()) die("verify a", v.status());
  if (auto l = (*checkpointer)->load("a"); !l.ok()) die("load a", l.status());
  const bool b = ckpt::path_exists(root + "/b");
  if (b) {
    if (auto v = verify_checkpoint(root + "/b"); !v.ok()) die("verify b (published)", v.status());
    auto l = (*checkpointer)->load("b");
    if (!l.ok()) die("load b (published)", l.status());
    if (l->metadata["step"] != "2") die("load b", internal_error("wrong metadata"));
  }
  auto latest = latest_checkpoint(root);
  if (!latest.ok()) die("latest", latest.status());
  if (*latest != "a" && !(b && *latest == "b")) die("latest", internal_error("names " + *latest));
  if (auto l = (*checkpointer)->load(""); !l.ok()) die("load latest", l.status());
  auto names = ckpt::list_directory(root);
  for (const auto& n : *names) {
    if (n != "a" && n != "b" && n != "latest" && n.rfind(".tmp-", 0) != 0 &&
        n.rfind("latest.tmp", 0) != 0) {
      die("root", internal_error("unexpected entry " + n));
    }
  }
  const std::string latest_before = *latest;
  // The next save in the root removes what the killed save left (its temporary directory,
  // a half-replaced latest) and leaves "a" (and "b") as they were.
  auto c = (*checkpointer)->save("c");
  if (!c.ok()) die("save c after the crash", c.status());
  if (Status s = (*c)->wait(); !s.ok()) die("save c after the crash", s);
  names = ckpt::list_directory(root);
  for (const auto& n : *names) {
    if (n != "a" && n != "b" && n != "c" && n != "latest") {
      die("root after save c", internal_error("the crashed save's " + n + " is still there"));
    }
  }
  for (const char* n : {"a", "c"}) {
    if (auto v = verify_checkpoint(root + "/" + n); !v.ok()) die("verify after save c", v.status());
  }
  if (b) {
    if (auto v = verify_checkpoint(root + "/b"); !v.ok()) die("verify b after save c", v.status());
  }
  latest = latest_checkpoint(root);
  if (!latest.ok()) die("latest after save c", latest.status());
  if (*latest != "c") die("latest after save c", internal_error("names " + *latest));
  std::printf("%s; latest %s\n", b ? "b complete" : "b absent", latest_before.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "save" && argc == 5) return save(argv[2], std::atoi(argv[3]), std::atoll(argv[4]));
  if (mode == "check" && argc == 3) return check(argv[2]);
  std::fprintf(stderr,
               "usage: ckpt_probe save ROOT KILL_RANK KILL_AFTER_US | ckpt_probe check ROOT\n");
  return 2;
}
