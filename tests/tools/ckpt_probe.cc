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
//   ckpt_probe save-parts ROOT KILL_RANK   (under hpshard-run, 2 ranks) the ranks are the two
//       mp parts of one model, each its own sharding group saving under ROOT/part<rank>:
//       both save "a"; the other part saves and publishes "b" while part KILL_RANK, which
//       never saves it, kills itself with SIGKILL once it sees that. Each part records its
//       parameters' checksum at each save in ROOT/part<rank>.sums.
//   ckpt_probe resume-parts ROOT   (under hpshard-run, 2 ranks) loads latest on both parts:
//       the newest checkpoint both hold, whose checksum the part recorded.
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "core/checkpoint/checkpointer.h"
#include "core/checkpoint/file_io.h"
#include "core/checkpoint/format.h"
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

// A model of 2 Mi + 1000 float32 parameters: 6 MiB of state with AdamW; `mp`: the part's
// model-parallel group, when it is one of the model's parts.
std::unique_ptr<ShardedEngine> make_engine(std::shared_ptr<Communicator> world,
                                           std::shared_ptr<Communicator> mp = nullptr) {
  EngineOptions o;
  o.optimizer = OptimizerKind::kAdamW;
  auto engine = create_sharded_engine(2, world, nullptr, o);
  if (!engine.ok()) die("engine", engine.status());
  auto& e = **engine;
  if (mp) {
    if (Status s = e.set_model_parallel_groups(mp, nullptr); !s.ok()) die("mp group", s);
  }
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
    if (n != "a" && n != "b" && n != "latest" && n != ".hpshard-save-lock" &&
        n.rfind(".tmp-", 0) != 0 && n.rfind("latest.tmp", 0) != 0) {
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

// One rank of a 2-rank job as a part of the model (see save-parts).
struct Part {
  int32_t rank = 0;
  std::shared_ptr<Communicator> world;
  std::unique_ptr<ShardedEngine> engine;
  std::unique_ptr<Checkpointer> checkpointer;
};

Part make_part(const std::string& root) {
  Part part;
  auto info = rendezvous_from_env();
  if (!info.ok()) die("rendezvous", info.status());
  if (info->world_size != 2) die("parts", invalid_argument("run it with 2 ranks"));
  auto store = open_store(info->store_url, info->rank, std::chrono::seconds(30));
  if (!store.ok()) die("store", store.status());
  auto comm = create_communicator(*store, info->rank, 2, Device::cpu());
  if (!comm.ok()) die("communicator", comm.status());
  part.rank = info->rank;
  part.world = std::shared_ptr<Communicator>(std::move(*comm));
  auto own = create_communicator(make_in_memory_store(), 0, 1, Device::cpu());
  if (!own.ok()) die("the part's group", own.status());
  std::shared_ptr<Communicator> group(std::move(*own));
  part.engine = make_engine(group, part.world);
  auto c = Checkpointer::create(*dynamic_cast<Checkpointable*>(part.engine.get()), group,
                                root + "/part" + std::to_string(part.rank));
  if (!c.ok()) die("checkpointer", c.status());
  part.checkpointer = std::move(*c);
  return part;
}

uint64_t parameters_checksum(ShardedEngine& e) {
  if (Status s = e.synchronize(); !s.ok()) die("synchronize", s);
  uint64_t sum = 0;
  for (size_t p = 0; p < 2; ++p) {
    const uint64_t n = e.plan().params()[p].numel();
    sum = sum * 31 + ckpt::checksum(*e.param(p), n * sizeof(float));
  }
  return sum;
}

void save_and_record(Part& part, const std::string& root, const std::string& name) {
  auto w = part.checkpointer->save(name);
  if (!w.ok()) die("save " + name, w.status());
  if (Status s = (*w)->wait(); !s.ok()) die("save " + name, s);
  const std::string sums = root + "/part" + std::to_string(part.rank) + ".sums";
  FILE* f = std::fopen(sums.c_str(), "a");
  if (f == nullptr) die("sums", internal_error("cannot open " + sums));
  std::fprintf(f, "%s %llu\n", name.c_str(),
               static_cast<unsigned long long>(parameters_checksum(*part.engine)));
  std::fclose(f);
  std::printf("part %d: %s published\n", part.rank, name.c_str());
  std::fflush(stdout);
}

int save_parts(const std::string& root, int32_t kill_rank) {
  Part part = make_part(root);
  train_step(*part.engine, part.rank, 0);
  save_and_record(part, root, "a");
  train_step(*part.engine, part.rank, 1);
  if (part.rank != kill_rank) {
    save_and_record(part, root, "b");
    std::this_thread::sleep_for(std::chrono::seconds(60));  // until the launcher stops it
    return 0;
  }
  const std::string other = root + "/part" + std::to_string(1 - part.rank) + "/latest";
  for (int i = 0; i < 3000; ++i) {
    auto text = ckpt::read_file(other, 64);
    if (text.ok() && *text == "b\n") std::raise(SIGKILL);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  die("save-parts", internal_error("the other part never published b"));
}

int resume_parts(const std::string& root) {
  Part part = make_part(root);
  auto l = part.checkpointer->load("");
  if (!l.ok()) die("load latest", l.status());
  const std::string name = l->directory.substr(l->directory.rfind('/') + 1);
  const uint64_t sum = parameters_checksum(*part.engine);
  auto sums = ckpt::read_file(root + "/part" + std::to_string(part.rank) + ".sums", 4096);
  if (!sums.ok()) die("sums", sums.status());
  const std::string want = name + " " + std::to_string(sum) + "\n";
  if (sums->find(want) == std::string::npos) {
    die("resume-parts",
        internal_error("part " + std::to_string(part.rank) + " loaded " + name + " with checksum " +
                       std::to_string(sum) + ", not the one saved: " + *sums));
  }
  std::printf("part %d loaded %s\n", part.rank, name.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "save" && argc == 5) return save(argv[2], std::atoi(argv[3]), std::atoll(argv[4]));
  if (mode == "check" && argc == 3) return check(argv[2]);
  if (mode == "save-parts" && argc == 4) return save_parts(argv[2], std::atoi(argv[3]));
  if (mode == "resume-parts" && argc == 3) return resume_parts(argv[2]);
  std::fprintf(stderr,
               "usage: ckpt_probe save ROOT KILL_RANK KILL_AFTER_US | ckpt_probe check ROOT | "
               "ckpt_probe save-parts ROOT KILL_RANK | ckpt_probe resume-parts ROOT\n");
  return 2;
}
