// Checkpoints of real engines (ranks as threads): resuming is bitwise equal in the same
// topology; loads into other topologies (more or fewer ranks, stage 2 <-> 3, dp x sharding,
// another bucket alignment, fp32 <-> bf16 parameters) continue like the unsharded
// reference; bad data, a mismatching model and loads in the wrong phase change no engine;
// saving is asynchronous (no host sync in the steps it overlaps, and they do not change
// what is saved); keep-last and latest; safetensors export and import.
#include "core/checkpoint/checkpointer.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <iterator>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "core/checkpoint/file_io.h"
#include "core/checkpoint/format.h"
#include "core/checkpoint/manifest.h"
#include "core/checkpoint/safetensors.h"
#include "core/comm/self/communicator.h"
#include "core/common/config.h"
#include "core/device/cpu/stream.h"
#include "core/topology/hybrid_group.h"
#include "tests/core/checkpoint/temp_dir.h"
#include "tests/core/checkpoint/training.h"
#include "tests/support/seeds.h"

// File systems without hard links (and without renameat2), played by this program: its own
// link() and renameat2() take the place of libc's in the statically linked core, failing
// as such a file system's would while these are set.
namespace {
std::atomic<int> g_link_errno{0};
std::atomic<int> g_renameat2_errno{0};
std::atomic<int> g_link_calls{0};
std::atomic<int> g_renameat2_calls{0};
}  // namespace

extern "C" int link(const char* from, const char* to) {
  ++g_link_calls;
  if (const int err = g_link_errno.load()) {
    errno = err;
    return -1;
  }
  return static_cast<int>(::syscall(SYS_link, from, to));
}

extern "C" int renameat2(int from_dir, const char* from, int to_dir, const char* to,
                         unsigned int flags) {
  ++g_renameat2_calls;
  if (const int err = g_renameat2_errno.load()) {
    errno = err;
    return -1;
  }
  return static_cast<int>(::syscall(SYS_renameat2, from_dir, from, to_dir, to, flags));
}

// flock(2) as a file system without it answers, when set.
std::atomic<int> g_flock_errno{0};

extern "C" int flock(int fd, int operation) {
  if (const int err = g_flock_errno.load()) {
    errno = err;
    return -1;
  }
  return static_cast<int>(::syscall(SYS_flock, fd, operation));
}

namespace hps::ckpt_test {
namespace {

namespace fs = std::filesystem;

using testing_util::TempDir;

CheckpointOptions small_chunks() {
  CheckpointOptions o;
  o.chunk_bytes = 96;  // many chunks per range, chunk boundaries inside shards
  o.timeout = Milliseconds(30'000);
  return o;
}

// Trains `steps` steps from `first` on every rank of `layout` after `before` (which may load
// or save), then runs `after`.
using RankFn = std::function<void(Rank&)>;
void run(const Layout& layout, const EngineOptions& options, const std::string& root,
         const RankFn& body, CheckpointOptions checkpoint_options = small_chunks(),
         const std::vector<TestParam>& model = kModel) {
  testing_util::run_ranks(layout.world(), [&](int32_t rank, Communicator& comm) {
    Rank r;
    make_rank(r, rank, comm, layout, options, root, checkpoint_options, model);
    if (::testing::Test::HasFatalFailure()) return;
    body(r);
  });
}

// A Checkpointable of one tensor of `rows` x 8 floats whose state stream the test drives.
class FakeState final : public Checkpointable {
 public:
  explicit FakeState(int64_t rows = 8) : w(static_cast<size_t>(rows) * 8, 0.0f), rows_(rows) {}
  std::vector<float> w;
  cpu::CpuStream stream;
  EngineOptions options;
  int loads = 0;
  int64_t steps = 0;
  CheckpointTopology topology{2, 1, 0, 1, 0, 256};
  bool writer = true;  // a dp replica other than the first writes nothing
  StatusOr<std::vector<StateTensor>> state_tensors() override {
    return std::vector<StateTensor>{{"param/w",
                                     {rows_, 8},
                                     DType::kFloat32,
                                     0,
                                     static_cast<uint64_t>(w.size()),
                                     w.data(),
                                     writer}};
  }
  Stream& state_stream() override { return stream; }
  CheckpointTopology checkpoint_topology() const override { return topology; }
  const EngineOptions& checkpoint_options() const override { return options; }
  int64_t steps_taken() const override { return steps; }
  Status begin_state_load() override { return stream.synchronize(); }
  Status end_state_load() override {
    ++loads;
    return Status::Ok();
  }

 private:
  int64_t rows_;
};

// A part of a model (mp 2) claims its root with `.hpshard-part`: by a hard link, else by a
// rename that replaces nothing, else by an exclusive create, each leaving the claim whole;
// the other part is then refused there, whichever way the claim was made.
class PartState final : public Checkpointable {
 public:
  explicit PartState(int32_t mp_rank, int32_t pp = 1, int32_t pp_rank = 0, int32_t mp = 2)
      : mp_rank_(mp_rank), pp_(pp), pp_rank_(pp_rank), mp_(mp) {}
  std::vector<Communicator*> groups;  // the mp and pp groups, when the test gives them
  std::vector<float> w = std::vector<float>(16, 1.0f);
  cpu::CpuStream stream;
  EngineOptions options;
  StatusOr<std::vector<StateTensor>> state_tensors() override {
    return std::vector<StateTensor>{{"param/w", {16}, DType::kFloat32, 0, 16, w.data(), true}};
  }
  Stream& state_stream() override { return stream; }
  CheckpointTopology checkpoint_topology() const override {
    CheckpointTopology t{2, 1, 0, 1, 0, 256};
    t.mp = mp_;
    t.mp_rank = mp_rank_;
    t.pp = pp_;
    t.pp_rank = pp_rank_;
    return t;
  }
  const EngineOptions& checkpoint_options() const override { return options; }
  int64_t steps_taken() const override { return 0; }
  Status begin_state_load() override { return stream.synchronize(); }
  Status end_state_load() override { return Status::Ok(); }
  std::vector<Communicator*> model_parallel_groups() const override { return groups; }

 private:
  int32_t mp_rank_, pp_, pp_rank_, mp_;
};

TEST(Checkpoint, APartClaimsItsRootWithoutHardLinks) {
  struct Way {
    const char* what;
    int link_errno;
    int renameat2_errno;
  };
  for (const Way& way : {Way{"hard link", 0, 0}, Way{"rename without replacing", EPERM, 0},
                         Way{"exclusive create", EPERM, ENOSYS}}) {
    SCOPED_TRACE(way.what);
    TempDir dir;
    g_link_errno = way.link_errno;
    g_renameat2_errno = way.renameat2_errno;
    auto group = [] {
      auto c = self_backend::SelfCommunicator::create({});
      return std::shared_ptr<Communicator>(std::move(*c));
    };
    PartState first(0), second(1);
    g_link_calls = 0;
    g_renameat2_calls = 0;
    auto claimed = Checkpointer::create(first, group(), dir.path(), small_chunks());
    ASSERT_TRUE(claimed.ok()) << claimed.status().to_string();
    // The claim went the way this round plays.
    EXPECT_EQ(g_link_calls.load(), 1);
    EXPECT_EQ(g_renameat2_calls.load(), way.link_errno != 0 ? 1 : 0);
    std::ifstream marker(dir / ".hpshard-part");
    std::string text((std::istreambuf_iterator<char>(marker)), std::istreambuf_iterator<char>());
    EXPECT_EQ(text, "the model's part at mp rank 0 of 2, pp rank 0 of 1\n");
    for (const auto& e : fs::directory_iterator(dir.path())) {
      EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos)
          << "left " << e.path();
    }
    auto refused = Checkpointer::create(second, group(), dir.path(), small_chunks());
    ASSERT_FALSE(refused.ok()) << "two parts share a root";
    EXPECT_NE(refused.status().message().find("holds the checkpoints of the model's part at mp "
                                              "rank 0"),
              std::string::npos)
        << refused.status().to_string();
    // The claim stands for the part that made it.
    auto again = Checkpointer::create(first, group(), dir.path(), small_chunks());
    EXPECT_TRUE(again.ok()) << again.status().to_string();
  }
  g_link_errno = 0;
  g_renameat2_errno = 0;
}

// A root holding a checkpoint whose manifest cannot be read (not JSON; or a newer hpshard's,
// of a format version this one does not read) may hold any part's checkpoints: a part does not
// claim it (it took the root and moved its 'latest'); a whole model still saves there.
TEST(Checkpoint, APartRefusesARootHoldingACheckpointItCannotRead) {
  for (const char* manifest : {"{not json", R"({"format_version": 3})"}) {
    SCOPED_TRACE(manifest);
    TempDir dir;
    fs::create_directory(dir / "x");
    std::ofstream(fs::path(dir / "x") / "manifest.json") << manifest;
    auto group = [] {
      auto c = self_backend::SelfCommunicator::create({});
      return std::shared_ptr<Communicator>(std::move(*c));
    };
    PartState part(0);
    auto refused = Checkpointer::create(part, group(), dir.path(), small_chunks());
    ASSERT_FALSE(refused.ok()) << "a part took a root it cannot read";
    EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(refused.status().message().find("checkpoint 'x' whose manifest cannot be read"),
              std::string::npos)
        << refused.status().to_string();
    EXPECT_FALSE(fs::exists(dir / ".hpshard-part"));
    EXPECT_FALSE(fs::exists(dir / "latest"));
    PartState whole(0, 1, 0, 1);
    auto taken = Checkpointer::create(whole, group(), dir.path(), small_chunks());
    EXPECT_TRUE(taken.ok()) << taken.status().to_string();
  }
}

// A model cut into four parts (mp 2 x pp 2, one rank each), whose saves did not complete on
// every part: `latest` loads the newest checkpoint every part holds (each part's own order
// of publication, folded over the mp group and then the pp group); with none in common every
// part refuses and none changes.
TEST(Checkpoint, LatestOfPartsIsTheNewestCheckpointEveryPartHolds) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  TempDir dir;
  testing_util::run_ranks(4, [&](int32_t rank, Communicator& comm) {
    auto world = std::shared_ptr<Communicator>(&comm, [](Communicator*) {});
    auto topology = Topology::create({1, 2, 1, 1, 2}, 4);
    ASSERT_TRUE(topology.ok()) << topology.status().to_string();
    auto coordinates = topology->coordinates(rank);
    ASSERT_TRUE(coordinates.ok());
    auto hg = HybridGroup::create(world, *topology);
    ASSERT_TRUE(hg.ok()) << hg.status().to_string();
    const int32_t mp_rank = (*coordinates)[static_cast<int>(Axis::kMp)];
    const int32_t pp_rank = (*coordinates)[static_cast<int>(Axis::kPp)];
    PartState part(mp_rank, 2, pp_rank);
    part.groups = {(*hg)->group(GroupKind::kMp).get(), (*hg)->group(GroupKind::kPp).get()};
    auto self = self_backend::SelfCommunicator::create({});
    ASSERT_TRUE(self.ok());
    CheckpointOptions options = small_chunks();
    options.keep_last = rank == 2 ? 1 : 0;  // a part keeps two all the same
    auto made = Checkpointer::create(part, std::shared_ptr<Communicator>(std::move(*self)),
                                     dir / ("part" + std::to_string(rank)), options);
    ASSERT_TRUE(made.ok()) << made.status().to_string();
    Checkpointer& ckpt = **made;
    auto save = [&](const std::string& name, float value) {
      std::fill(part.w.begin(), part.w.end(), value);
      auto s = ckpt.save(name, {{"step", name}});
      ASSERT_TRUE(s.ok()) << s.status().to_string();
      ASSERT_TRUE((*s)->wait().ok());
    };
    save("s1", 1.0f);
    save("s2", 2.0f);
    // One latest everywhere: that one.
    auto same = ckpt.load("");
    ASSERT_TRUE(same.ok()) << same.status().to_string();
    EXPECT_EQ(same->metadata.at("step"), "s2");
    // s3 on parts 0, 2 and 3, s4 on part 0 alone: their latest are s4, s2, s3 and s3, and
    // s2 is the newest on all four. Part 2 (keep_last 1) keeps two as a part of a model: s1
    // goes, s2 stays.
    if (rank != 1) save("s3", 3.0f);
    if (rank == 0) save("s4", 4.0f);
    if (rank == 2) {
      EXPECT_FALSE(fs::exists(dir / "part2/s1"));
      EXPECT_TRUE(fs::exists(dir / "part2/s2"));
    }
    std::fill(part.w.begin(), part.w.end(), 7.0f);
    auto common = ckpt.load("");
    ASSERT_TRUE(common.ok()) << "rank " << rank << ": " << common.status().to_string();
    EXPECT_EQ(common->metadata.at("step"), "s2");
    EXPECT_EQ(fs::path(common->directory).filename(), "s2");
    EXPECT_EQ(part.w, std::vector<float>(16, 2.0f));
    // s5 on part 1 alone, and part 3 loses s1 and s2: part 3's s3 is on every part but 1,
    // and nothing is on all four.
    if (rank == 1) save("s5", 5.0f);
    if (rank == 3) {
      fs::remove_all(dir / "part3/s1");
      fs::remove_all(dir / "part3/s2");
    }
    std::fill(part.w.begin(), part.w.end(), 7.0f);
    auto none = ckpt.load("");
    ASSERT_FALSE(none.ok()) << "rank " << rank << " loaded " << none->directory;
    EXPECT_EQ(none.status().code(), StatusCode::kInvalidArgument) << none.status().to_string();
    EXPECT_NE(none.status().message().find("hold no checkpoint in common"), std::string::npos)
        << none.status().to_string();
    EXPECT_EQ(part.w, std::vector<float>(16, 7.0f)) << "a refused load changed the part";
  });
}

// Seeded random grids of parts (mp 1-3 x pp 1-2, one rank each), each part taking part in
// a random subset of six saves (the first in all) with a random keep_last: `latest` loads
// what a model of the rotation (a part keeps max(keep_last, 2)) says is the newest
// checkpoint every part holds, or every part refuses when there is none.
// HPS_PARTS_CASES=N or HPS_PARTS_SEED=a,b for more or chosen ones.
TEST(Checkpoint, LatestOfPartsFollowsAModelOfTheirRotations) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  constexpr int kSaves = 6;
  for (uint64_t seed : testing_util::seeds_from_env("HPS_PARTS", 10)) {
    std::mt19937_64 rng(seed);
    int32_t mp = 0, pp = 0;
    do {
      mp = 1 + static_cast<int32_t>(rng() % 3);
      pp = 1 + static_cast<int32_t>(rng() % 2);
    } while (mp * pp < 2);
    const int32_t parts = mp * pp;
    const int32_t keep_last = static_cast<int32_t>(rng() % 4);
    std::vector<std::vector<bool>> saves(parts, std::vector<bool>(kSaves, true));
    for (auto& part : saves) {
      for (int i = 1; i < kSaves; ++i) part[i] = rng() % 5 != 0;
    }
    // The model: what each part keeps, and the newest save all keep (-1: none).
    int expected = -1;
    {
      std::vector<std::vector<int>> kept(parts);
      for (int32_t p = 0; p < parts; ++p) {
        for (int i = 0; i < kSaves; ++i) {
          if (!saves[p][i]) continue;
          kept[p].push_back(i);
          const size_t keep = static_cast<size_t>(std::max(keep_last, 2));
          if (keep_last > 0 && kept[p].size() > keep) kept[p].erase(kept[p].begin());
        }
      }
      for (int i = kSaves - 1; i >= 0 && expected < 0; --i) {
        bool everywhere = true;
        for (const auto& k : kept) everywhere &= std::find(k.begin(), k.end(), i) != k.end();
        if (everywhere) expected = i;
      }
    }
    SCOPED_TRACE("seed " + std::to_string(seed) + ": mp " + std::to_string(mp) + " x pp " +
                 std::to_string(pp) + ", keep_last " + std::to_string(keep_last) + ", expected s" +
                 std::to_string(expected));
    TempDir dir;
    testing_util::run_ranks(parts, [&](int32_t rank, Communicator& comm) {
      auto world = std::shared_ptr<Communicator>(&comm, [](Communicator*) {});
      auto topology = Topology::create({1, pp, 1, 1, mp}, parts);
      ASSERT_TRUE(topology.ok()) << topology.status().to_string();
      auto hg = HybridGroup::create(world, *topology);
      ASSERT_TRUE(hg.ok()) << hg.status().to_string();
      const auto c = *topology->coordinates(rank);
      PartState part(c[static_cast<int>(Axis::kMp)], pp, c[static_cast<int>(Axis::kPp)], mp);
      for (GroupKind kind : {GroupKind::kMp, GroupKind::kPp}) {
        if ((*hg)->group(kind)->size() > 1) part.groups.push_back((*hg)->group(kind).get());
      }
      auto self = self_backend::SelfCommunicator::create({});
      ASSERT_TRUE(self.ok());
      CheckpointOptions options = small_chunks();
      options.keep_last = keep_last;
      auto made = Checkpointer::create(part, std::shared_ptr<Communicator>(std::move(*self)),
                                       dir / ("part" + std::to_string(rank)), options);
      ASSERT_TRUE(made.ok()) << made.status().to_string();
      for (int i = 0; i < kSaves; ++i) {
        if (!saves[rank][i]) continue;
        std::fill(part.w.begin(), part.w.end(), static_cast<float>(i));
        auto w = (*made)->save("s" + std::to_string(i));
        ASSERT_TRUE(w.ok()) << w.status().to_string();
        ASSERT_TRUE((*w)->wait().ok());
      }
      std::fill(part.w.begin(), part.w.end(), -1.0f);
      auto loaded = (*made)->load("");
      if (expected < 0) {
        ASSERT_FALSE(loaded.ok()) << "part " << rank << " loaded " << loaded->directory;
        EXPECT_EQ(loaded.status().code(), StatusCode::kInvalidArgument)
            << loaded.status().to_string();
        EXPECT_EQ(part.w, std::vector<float>(16, -1.0f));
      } else {
        ASSERT_TRUE(loaded.ok()) << "part " << rank << ": " << loaded.status().to_string();
        EXPECT_EQ(fs::path(loaded->directory).filename(), "s" + std::to_string(expected));
        EXPECT_EQ(part.w, std::vector<float>(16, static_cast<float>(expected)));
      }
    });
  }
}

// The snapshot holds what the work enqueued before save() produced, not what was done when
// save() was called nor what the work enqueued after it does.
TEST(Checkpoint, SnapshotIsTakenInStreamOrder) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  TempDir dir;
  testing_util::run_ranks(1, [&](int32_t, Communicator& comm) {
    std::shared_ptr<Communicator> world(&comm, [](Communicator*) {});
    FakeState state;
    auto c = Checkpointer::create(state, world, dir.path(), small_chunks());
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    std::promise<void> release;
    std::shared_future<void> gate = release.get_future().share();
    state.stream.enqueue([gate] { gate.wait(); });  // a step still running...
    state.stream.enqueue(
        [&state] { std::fill(state.w.begin(), state.w.end(), 1.0f); });  // ...its update
    host_sync_reset();
    auto work = (*c)->save("a");
    ASSERT_TRUE(work.ok()) << work.status().to_string();
    EXPECT_EQ(host_sync_count_thread(), 0u);
    state.stream.enqueue(
        [&state] { std::fill(state.w.begin(), state.w.end(), 2.0f); });  // the next step
    auto done = (*work)->test();
    ASSERT_TRUE(done.ok());
    EXPECT_FALSE(*done) << "the save finished before the state it saves was produced";
    // The writer starts as soon as the snapshot's first copies complete, and not before:
    // while the step holds the snapshot back, no byte of the data file is written.
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    for (const auto& entry : fs::recursive_directory_iterator(dir.path())) {
      if (entry.is_regular_file() && entry.path().filename() != ".hpshard-save-lock") {
        EXPECT_EQ(entry.file_size(), 0u) << entry.path() << " written before the snapshot";
      }
    }
    release.set_value();
    ASSERT_TRUE((*work)->wait().ok()) << (*work)->status().to_string();
    ASSERT_TRUE(state.stream.synchronize().ok());
    EXPECT_EQ(state.w[0], 2.0f);
    FakeState fresh;
    auto c2 = Checkpointer::create(fresh, world, dir.path(), small_chunks());
    ASSERT_TRUE(c2.ok());
    ASSERT_TRUE((*c2)->load("a").ok());
    EXPECT_EQ(fresh.loads, 1);
    EXPECT_EQ(fresh.w, std::vector<float>(64, 1.0f));
  });
}

struct ResumeCase {
  const char* name;
  Layout layout;
  bool adamw;
  bool loss_scaling;
  friend void PrintTo(const ResumeCase& c, std::ostream* os) { *os << c.name; }
};

class ResumeTest : public ::testing::TestWithParam<ResumeCase> {};

// Train 3 steps, save, train 3 more (the save in flight: no host sync in those steps);
// in fresh engines load and train the same 3: every state tensor is bitwise equal.
TEST_P(ResumeTest, ResumingIsBitwiseEqual) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  const ResumeCase c = GetParam();
  EngineOptions options = c.adamw ? adamw_options() : sgd_options();
  if (c.loss_scaling) {
    options.dynamic_loss_scaling = true;
    options.initial_loss_scale = 1024.0f;
    options.growth_interval = 2;
  }
  TempDir dir;
  const int n = 3, m = 3;
  std::mutex mutex;
  std::map<int32_t, std::map<std::string, std::vector<uint8_t>>> uninterrupted, resumed;
  std::map<int32_t, std::vector<std::vector<float>>> full_a, full_b;
  run(c.layout, options, dir.path(), [&](Rank& r) {
    r.inf_step = c.loss_scaling ? 1 : -1;  // a skipped step before the save...
    for (int s = 0; s < n; ++s) r.train_step(s);
    host_sync_reset();
    auto work = r.checkpointer->save("step-3", {{"step", "3"}, {"loader", "epoch 0 batch 3"}});
    ASSERT_TRUE(work.ok()) << work.status().to_string();
    EXPECT_EQ(host_sync_count_thread(), 0u) << "save() blocked the host";
    if (c.loss_scaling) r.inf_step = 4;  // ...and one after it
    for (int s = n; s < n + m; ++s) {
      EXPECT_EQ(r.train_step(s), 0u) << "step " << s << " with a save in flight synced";
    }
    ASSERT_TRUE((*work)->wait().ok()) << (*work)->status().to_string();
    auto bytes = r.state_bytes();
    auto full = r.engine->gather_all();
    ASSERT_TRUE(full.ok());
    std::lock_guard lock(mutex);
    uninterrupted[r.rank] = std::move(bytes);
    full_a[r.rank] = std::move(*full);
  });
  ASSERT_TRUE(ckpt::path_exists(dir / "step-3/manifest.json"));
  run(c.layout, options, dir.path(), [&](Rank& r) {
    auto report = r.checkpointer->load("");
    ASSERT_TRUE(report.ok()) << report.status().to_string();
    EXPECT_EQ(report->metadata.at("step"), "3");
    EXPECT_EQ(report->metadata.at("loader"), "epoch 0 batch 3");
    EXPECT_TRUE(report->unchanged.empty());
    if (c.loss_scaling) r.inf_step = 4;
    for (int s = n; s < n + m; ++s) r.train_step(s);
    auto bytes = r.state_bytes();
    auto full = r.engine->gather_all();
    ASSERT_TRUE(full.ok());
    std::lock_guard lock(mutex);
    resumed[r.rank] = std::move(bytes);
    full_b[r.rank] = std::move(*full);
  });
  ASSERT_EQ(uninterrupted.size(), resumed.size());
  for (const auto& [rank, tensors] : uninterrupted) {
    ASSERT_EQ(tensors.size(), resumed[rank].size());
    for (const auto& [name, bytes] : tensors) {
      EXPECT_EQ(bytes, resumed[rank][name]) << name << " differs on rank " << rank;
    }
    for (size_t p = 0; p < full_a[rank].size(); ++p) {
      EXPECT_EQ(0, std::memcmp(full_a[rank][p].data(), full_b[rank][p].data(),
                               full_a[rank][p].size() * sizeof(float)))
          << kModel[p].name;
    }
  }
  if (c.loss_scaling) {
    // The step scalars came back: one skip before the save, one after.
    int64_t skipped = 0;
    std::memcpy(&skipped, resumed[0]["step/skipped_steps"].data(), sizeof skipped);
    EXPECT_EQ(skipped, 2);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, ResumeTest,
    ::testing::Values(
        ResumeCase{"stage2_sgd_fp32", {2, 2, 1, DType::kFloat32}, false, false},
        ResumeCase{"stage3_adamw_fp32", {3, 2, 1, DType::kFloat32}, true, false},
        ResumeCase{"stage2_adamw_bf16_scaling", {2, 2, 1, DType::kBFloat16}, true, true},
        ResumeCase{"stage3_sgd_fp16_scaling", {3, 2, 1, DType::kFloat16}, false, true},
        ResumeCase{"stage2_dp2_sharding2", {2, 2, 2, DType::kFloat32}, true, false}),
    [](const auto& p) { return std::string(p.param.name); });

// One rank over the communicator of a group of one (core/comm/self, what a build without
// Gloo gives a single process): train, save with steps in flight, train; a fresh engine
// loads and trains the same steps bitwise equal, and both follow the unsharded reference.
TEST(Checkpoint, AGroupOfOneSavesAndResumesWithoutGloo) {
  for (const int32_t stage : {2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    const Layout layout{stage, 1, 1, DType::kFloat32};
    const EngineOptions options = adamw_options();
    TempDir dir;
    const int n = 3, m = 3;
    auto one_rank = [&](const RankFn& body) {
      auto comm = self_backend::SelfCommunicator::create({});
      ASSERT_TRUE(comm.ok()) << comm.status().to_string();
      Rank r;
      make_rank(r, 0, **comm, layout, options, dir.path(), small_chunks());
      if (::testing::Test::HasFatalFailure()) return;
      body(r);
    };
    std::map<std::string, std::vector<uint8_t>> uninterrupted, resumed;
    std::vector<std::vector<float>> full_a, full_b;
    one_rank([&](Rank& r) {
      for (int s = 0; s < n; ++s) r.train_step(s);
      auto work = r.checkpointer->save("one");
      ASSERT_TRUE(work.ok()) << work.status().to_string();
      for (int s = n; s < n + m; ++s) EXPECT_EQ(r.train_step(s), 0u) << "step " << s;
      ASSERT_TRUE((*work)->wait().ok()) << (*work)->status().to_string();
      uninterrupted = r.state_bytes();
      full_a = *r.engine->gather_all();
    });
    ASSERT_TRUE(verify_checkpoint(dir / "one").ok());
    one_rank([&](Rank& r) {
      auto report = r.checkpointer->load("one");
      ASSERT_TRUE(report.ok()) << report.status().to_string();
      for (int s = n; s < n + m; ++s) r.train_step(s);
      resumed = r.state_bytes();
      full_b = *r.engine->gather_all();
    });
    ASSERT_FALSE(uninterrupted.empty());
    EXPECT_EQ(uninterrupted, resumed);
    expect_near_reference(full_b, reference(options, {{1, n + m}}), "resumed");
    expect_near_reference(full_a, reference(options, {{1, n + m}}), "uninterrupted");
  }
}

struct ReshardCase {
  const char* name;
  Layout from, to;
  friend void PrintTo(const ReshardCase& c, std::ostream* os) { *os << c.name; }
};

class ReshardTest : public ::testing::TestWithParam<ReshardCase> {};

// Trains `before` steps at `from`, saves, runs `between` (when given), then loads at `to`
// and trains `after` more: every rank's parameters equal the unsharded reference that
// switched world size at the same step. `label` names the case in failures.
void expect_reshard_continues(const Layout& from, const Layout& to, const EngineOptions& options,
                              const CheckpointOptions& checkpoint, int before, int after,
                              const std::string& label,
                              const std::function<void(const fs::path&)>& between = {}) {
  TempDir dir;
  run(
      from, options, dir.path(),
      [&](Rank& r) {
        for (int s = 0; s < before; ++s) r.train_step(s);
        auto work = r.checkpointer->save("a");
        ASSERT_TRUE(work.ok()) << work.status().to_string();
        ASSERT_TRUE((*work)->wait().ok()) << (*work)->status().to_string();
      },
      checkpoint);
  if (between) between(dir / "a");
  const auto expected = reference(options, {{from.world(), before}, {to.world(), after}});
  run(
      to, options, dir.path(),
      [&](Rank& r) {
        auto report = r.checkpointer->load("a");
        ASSERT_TRUE(report.ok()) << report.status().to_string();
        for (int s = before; s < before + after; ++s) r.train_step(s);
        auto full = r.engine->gather_all();
        ASSERT_TRUE(full.ok()) << full.status().to_string();
        expect_near_reference(*full, expected, label + " rank " + std::to_string(r.rank));
      },
      checkpoint);
}

// Written by one topology, loaded by another: the run continues like the unsharded
// reference that switched world size at the same step.
TEST_P(ReshardTest, ContinuesLikeTheUnshardedReference) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  const ReshardCase c = GetParam();
  expect_reshard_continues(c.from, c.to, adamw_options(), small_chunks(), 3, 3, c.name);
}

INSTANTIATE_TEST_SUITE_P(
    Topologies, ReshardTest,
    ::testing::Values(ReshardCase{"sharding2_to_4", {2, 2, 1}, {2, 4, 1}},
                      ReshardCase{"sharding4_to_2", {2, 4, 1}, {2, 2, 1}},
                      ReshardCase{"stage2_to_stage3", {2, 2, 1}, {3, 2, 1}},
                      ReshardCase{"stage3_4_to_stage2_1", {3, 4, 1}, {2, 1, 1}},
                      ReshardCase{"dp2_sharding2_to_sharding4", {2, 2, 2}, {2, 4, 1}},
                      ReshardCase{"sharding2_to_dp2_sharding2", {3, 2, 1}, {2, 2, 2}},
                      ReshardCase{"another_alignment",
                                  {2, 2, 1, DType::kFloat32, 256},
                                  {3, 3, 1, DType::kFloat32, 16}}),
    [](const auto& p) { return std::string(p.param.name); });

// Random pairs of topologies, seeded: stage 2 or 3, 1-4 sharding ranks, dp 1 or 2 (at most
// 4 ranks), bucket alignments from 16 to 1024 bytes, chunks from 64 bytes to the default,
// AdamW or SGD, 1-3 steps before the save and 1-2 after the load. Each continues like the
// unsharded reference. HPS_RESHARD_SEED=a,b,... runs those seeds; HPS_RESHARD_CASES=N runs
// N seeds from HPS_RESHARD_FIRST_SEED (default 12 from 1).
struct RandomReshard {
  Layout from, to;
  EngineOptions options;
  CheckpointOptions checkpoint;
  int before = 1, after = 1;
  std::string text;
};

RandomReshard random_reshard(uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto pick = [&](int lo, int hi) {
    return lo + static_cast<int>(rng() % static_cast<uint64_t>(hi - lo + 1));
  };
  auto layout = [&] {
    Layout l;
    l.stage = pick(2, 3);
    l.dp = pick(1, 2);
    l.sharding = pick(1, l.dp == 1 ? 4 : 2);
    const uint64_t alignments[] = {16, 32, 64, 256, 1024};
    l.alignment_bytes = alignments[pick(0, 4)];
    return l;
  };
  RandomReshard c;
  c.from = layout();
  c.to = layout();
  c.options = pick(0, 1) ? adamw_options() : sgd_options();
  c.checkpoint = small_chunks();
  const uint64_t chunks[] = {64, 96, 200, 4096, ckpt::kDefaultChunkBytes};
  c.checkpoint.chunk_bytes = chunks[pick(0, 4)];
  c.before = pick(1, 3);
  c.after = pick(1, 2);
  auto describe = [](const Layout& l) {
    return "stage " + std::to_string(l.stage) + " sharding " + std::to_string(l.sharding) + " dp " +
           std::to_string(l.dp) + " alignment " + std::to_string(l.alignment_bytes);
  };
  c.text = "seed " + std::to_string(seed) + ": " + describe(c.from) + " -> " + describe(c.to) +
           (c.options.optimizer == OptimizerKind::kAdamW ? ", AdamW" : ", SGD") + ", chunks of " +
           std::to_string(c.checkpoint.chunk_bytes) + " bytes, " + std::to_string(c.before) +
           " + " + std::to_string(c.after) + " steps";
  return c;
}

class RandomReshardTest : public ::testing::TestWithParam<uint64_t> {};

TEST_P(RandomReshardTest, ContinuesLikeTheUnshardedReference) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  const RandomReshard c = random_reshard(GetParam());
  SCOPED_TRACE(c.text);
  expect_reshard_continues(
      c.from, c.to, c.options, c.checkpoint, c.before, c.after, c.text + ",",
      [](const fs::path& saved) { ASSERT_TRUE(verify_checkpoint(saved).ok()); });
}

INSTANTIATE_TEST_SUITE_P(Seeds, RandomReshardTest,
                         ::testing::ValuesIn(testing_util::seeds_from_env("HPS_RESHARD", 12)));

// fp32 parameters load into bf16 ones with the fp32 values kept as masters (the
// parameters rounded once), and bf16 ones with masters load into fp32 from the masters.
TEST(Checkpoint, ParameterDtypeChangesKeepTheMasters) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  TempDir dir;
  const EngineOptions options = adamw_options();
  std::vector<std::vector<float>> saved;
  run({2, 2, 1, DType::kFloat32}, options, dir.path(), [&](Rank& r) {
    for (int s = 0; s < 2; ++s) r.train_step(s);
    ASSERT_TRUE((*r.checkpointer->save("fp32"))->wait().ok());
    auto full = r.engine->gather_all();
    if (r.rank == 0) saved = *full;
  });
  std::vector<std::vector<float>> masters;
  run({3, 2, 1, DType::kBFloat16}, options, dir.path(), [&](Rank& r) {
    auto report = r.checkpointer->load("fp32");
    ASSERT_TRUE(report.ok()) << report.status().to_string();
    auto full = r.engine->gather_all();  // the fp32 masters
    ASSERT_TRUE(full.ok());
    for (size_t p = 0; p < saved.size(); ++p) {
      if (!kModel[p].trainable) continue;
      EXPECT_EQ(0, std::memcmp((*full)[p].data(), saved[p].data(), saved[p].size() * 4))
          << kModel[p].name << ": the masters are not the fp32 values";
    }
    // The bf16 parameters are the masters rounded once.
    for (int32_t u = 0; u < kUnits; ++u) ASSERT_TRUE(r.engine->gather(u).ok());
    for (size_t p = 0; p < saved.size(); ++p) {
      const auto* v = static_cast<const uint16_t*>(*r.engine->param_data(p));
      for (size_t i = 0; i < saved[p].size(); ++i) {
        ASSERT_EQ(v[i], float_to_bf16_bits(saved[p][i])) << kModel[p].name << "[" << i << "]";
      }
    }
    for (int32_t u = 0; u < kUnits; ++u) ASSERT_TRUE(r.engine->release(u).ok());
    r.train_step(2);
    ASSERT_TRUE((*r.checkpointer->save("bf16"))->wait().ok());
    full = r.engine->gather_all();
    if (r.rank == 0) masters = *full;
  });
  {  // export --fp32 reads the masters: one whose shape is not its parameter's is refused
     // (its bytes would land under the next tensor's offsets).
    fs::copy(dir / "bf16", dir / "odd-master", fs::copy_options::recursive);
    auto m = ckpt::read_manifest(dir / "odd-master");
    ASSERT_TRUE(m.ok());
    bool edited = false;
    for (auto& t : m->tensors) {
      if (t.name == "master/layer0.weight") {
        std::swap(t.shape[0], t.shape[1]);  // the same elements, so its chunks still hold
        edited = true;
      }
    }
    ASSERT_TRUE(edited);
    std::ofstream(dir / "odd-master/manifest.json", std::ios::trunc) << ckpt::manifest_to_json(*m);
    auto refused = export_safetensors(dir / "odd-master", dir / "odd.safetensors", true);
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.message().find("'master/layer0.weight' has shape [13, 7]"), std::string::npos)
        << refused.message();
    EXPECT_FALSE(fs::exists(dir / "odd.safetensors"));
    EXPECT_TRUE(export_safetensors(dir / "bf16", dir / "bf16.safetensors", true).ok());
  }
  run({2, 4, 1, DType::kFloat32}, options, dir.path(), [&](Rank& r) {
    ASSERT_TRUE(r.checkpointer->load("bf16").ok());
    auto full = r.engine->gather_all();
    for (size_t p = 0; p < masters.size(); ++p) {
      if (!kModel[p].trainable) continue;
      EXPECT_EQ(0, std::memcmp((*full)[p].data(), masters[p].data(), masters[p].size() * 4))
          << kModel[p].name << ": fp32 parameters are not the saved masters";
    }
  });
}

// Every rank's state must be what it was before a load that failed. The engine has taken
// three steps, so its state differs from every saved one (saved after one and two steps):
// a value a read wrote and nothing put back shows.
void expect_failed_load_changes_nothing(const Layout& layout, const std::string& root,
                                        const std::string& name,
                                        const std::vector<std::string>& expect_in_message,
                                        StatusCode code = StatusCode::kInvalidArgument,
                                        const std::vector<TestParam>& model = kModel) {
  run(
      layout, adamw_options(), root,
      [&](Rank& r) {
        for (int step = 0; step < 3; ++step) r.train_step(step);
        const auto before = r.state_bytes();
        auto report = r.checkpointer->load(name);
        ASSERT_FALSE(report.ok()) << "a bad checkpoint loaded";
        const std::string message = report.status().message();
        for (const auto& part : expect_in_message) {
          // "a|b|c": any of them.
          bool found = false;
          size_t start = 0;
          while (start <= part.size()) {
            const size_t bar = std::min(part.find('|', start), part.size());
            found = found || message.find(part.substr(start, bar - start)) != std::string::npos;
            start = bar + 1;
          }
          EXPECT_TRUE(found) << "rank " << r.rank << ": '" << part << "' not in: " << message;
        }
        if (r.rank == 0) {
          EXPECT_EQ(report.status().code(), code) << message;
        }
        EXPECT_EQ(before, r.state_bytes()) << "a failed load changed rank " << r.rank;
      },
      small_chunks(), model);
}

// The tensors with a chunk in `file`.
std::vector<std::string> tensors_in(const std::string& directory, const std::string& file) {
  auto m = ckpt::read_manifest(directory);
  std::vector<std::string> names;
  for (const auto& t : m->tensors) {
    for (const auto& c : t.chunks) {
      if (m->files[c.file].name == file) {
        names.push_back(t.name);
        break;
      }
    }
  }
  return names;
}

// "tensor 'a'|tensor 'b'|...": the message names one of them.
std::string any_tensor_of(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : "|") + std::string("tensor '") + n + "'";
  return out;
}

TEST(Checkpoint, BadDataIsRefusedNamingFileAndTensorAndChangesNothing) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  TempDir dir;
  const Layout layout{2, 2, 1};
  run(layout, adamw_options(), dir.path(), [&](Rank& r) {
    r.train_step(0);
    ASSERT_TRUE((*r.checkpointer->save("good"))->wait().ok());
    r.train_step(1);
    ASSERT_TRUE((*r.checkpointer->save("other"))->wait().ok());
  });
  auto copy = [&](const std::string& to) {
    fs::copy(dir / "good", dir / to, fs::copy_options::recursive);
    return dir / to;
  };
  {  // A flipped byte in the middle of rank 1's data, in a chunk that is not its range's
     // first (the load reads several whole chunks at once and must still name the bad one).
    const std::string d = copy("flipped");
    const std::string file = d + "/rank-00001.bin";
    auto m = ckpt::read_manifest(d);
    std::string holder, elements;
    uint64_t at = 0;
    for (const auto& tensor : m->tensors) {
      for (size_t k = 1; k < tensor.chunks.size() && holder.empty(); ++k) {
        const auto& ch = tensor.chunks[k];
        const auto& before = tensor.chunks[k - 1];
        if (m->files[ch.file].rank != 1 || before.file != ch.file) continue;
        holder = tensor.name;
        elements = "elements [" + std::to_string(ch.begin) + ", " + std::to_string(ch.end) + ")";
        at = ch.offset + (ch.end - ch.begin) * dtype_size(tensor.dtype) / 2;
      }
    }
    ASSERT_FALSE(holder.empty());
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(at));
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x10);
    f.seekp(static_cast<std::streamoff>(at));
    f.write(&c, 1);
    f.close();
    expect_failed_load_changes_nothing(
        layout, dir.path(), "flipped",
        {"rank-00001.bin", "'" + holder + "'", elements, "checksum"});
    auto verified = verify_checkpoint(d);
    ASSERT_FALSE(verified.ok());
    EXPECT_NE(verified.status().message().find(holder), std::string::npos);
  }
  {  // A truncated file.
    const std::string d = copy("truncated");
    fs::resize_file(d + "/rank-00000.bin", fs::file_size(d + "/rank-00000.bin") - 100);
    expect_failed_load_changes_nothing(
        layout, dir.path(), "truncated",
        {"rank-00000.bin", "truncated", any_tensor_of(tensors_in(d, "rank-00000.bin"))});
  }
  {  // A missing file.
    const std::string d = copy("missing");
    fs::remove(d + "/rank-00001.bin");
    expect_failed_load_changes_nothing(
        layout, dir.path(), "missing",
        {"rank-00001.bin", any_tensor_of(tensors_in(d, "rank-00001.bin"))}, StatusCode::kNotFound);
  }
  {  // A FIFO in place of a data file and of the manifest: refused, never waited on.
    const std::string d = copy("fifo");
    fs::remove(d + "/rank-00001.bin");
    ASSERT_EQ(::mkfifo((d + "/rank-00001.bin").c_str(), 0600), 0);
    expect_failed_load_changes_nothing(layout, dir.path(), "fifo",
                                       {"rank-00001.bin", "not a regular file"});
    const std::string e = copy("fifo-manifest");
    fs::remove(e + "/manifest.json");
    ASSERT_EQ(::mkfifo((e + "/manifest.json").c_str(), 0600), 0);
    expect_failed_load_changes_nothing(layout, dir.path(), "fifo-manifest",
                                       {"manifest.json", "not a regular file"});
    EXPECT_FALSE(verify_checkpoint(d).ok());
  }
  {  // The manifest of another checkpoint.
    const std::string d = copy("mixed");
    fs::copy_file(dir / "other/manifest.json", d + "/manifest.json",
                  fs::copy_options::overwrite_existing);
    expect_failed_load_changes_nothing(
        layout, dir.path(), "mixed", {"rank-0000", "belongs to checkpoint", "another checkpoint"});
  }
  {  // A hand edit that leaves the manifest well formed: its own checksum refuses it.
    const std::string d = copy("edited");
    std::ifstream in(d + "/manifest.json");
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const std::string key = "\"created_unix_ns\": ";
    const size_t at = text.find(key);
    ASSERT_NE(at, std::string::npos) << text;
    text.insert(at + key.size(), "1");
    std::ofstream(d + "/manifest.json", std::ios::trunc) << text;
    expect_failed_load_changes_nothing(layout, dir.path(), "edited",
                                       {"edited/manifest.json: the manifest's checksum"});
    EXPECT_FALSE(verify_checkpoint(d).ok());
    auto good = verify_checkpoint(dir / "good");
    ASSERT_TRUE(good.ok()) << good.status().to_string();
    EXPECT_TRUE(good->manifest_checksummed);
  }
  {  // A truncated manifest.
    const std::string d = copy("torn");
    fs::resize_file(d + "/manifest.json", fs::file_size(d + "/manifest.json") / 2);
    expect_failed_load_changes_nothing(layout, dir.path(), "torn", {"torn/manifest.json"});
  }
  {  // No such checkpoint.
    expect_failed_load_changes_nothing(layout, dir.path(), "absent", {"absent"},
                                       StatusCode::kNotFound);
  }
  {  // A checkpoint of another model: a renamed and a reshaped parameter.
    std::vector<TestParam> model = kModel;
    model[1].name = "layer0.offset";
    model[4].shape = {300};
    expect_failed_load_changes_nothing(layout, dir.path(), "good", {"layer0.offset", "layer0.bias"},
                                       StatusCode::kInvalidArgument, model);
    model = kModel;
    model[4].shape = {7, 43};
    expect_failed_load_changes_nothing(layout, dir.path(), "good",
                                       {"layer2.weight", "[7, 43]", "[301]"},
                                       StatusCode::kInvalidArgument, model);
  }
  // The good one still loads.
  run(layout, adamw_options(), dir.path(),
      [&](Rank& r) { EXPECT_TRUE(r.checkpointer->load("good").ok()); });
}

TEST(Checkpoint, PartialLoadsNameWhatTheyLeaveAndSkip) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  TempDir dir;
  const Layout layout{2, 2, 1};
  std::vector<std::vector<float>> saved;
  run(layout, sgd_options(), dir.path(), [&](Rank& r) {
    r.train_step(0);
    ASSERT_TRUE((*r.checkpointer->save("sgd"))->wait().ok());
    auto full = r.engine->gather_all();
    if (r.rank == 0) saved = *full;
  });
  run(layout, adamw_options(), dir.path(), [&](Rank& r) {
    auto refused = r.checkpointer->load("sgd");
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.status().message().find("exp_avg/layer0.weight"), std::string::npos)
        << refused.status().message();
    EXPECT_NE(refused.status().message().find("momentum/layer0.weight"), std::string::npos)
        << refused.status().message();
    auto report = r.checkpointer->load("sgd", {.allow_partial = true});
    ASSERT_TRUE(report.ok()) << report.status().to_string();
    EXPECT_NE(
        std::find(report->unchanged.begin(), report->unchanged.end(), "exp_avg/layer0.weight"),
        report->unchanged.end());
    EXPECT_NE(std::find(report->unused.begin(), report->unused.end(), "momentum/layer1.weight"),
              report->unused.end());
    auto full = r.engine->gather_all();
    for (size_t p = 0; p < saved.size(); ++p) EXPECT_EQ((*full)[p], saved[p]);
  });
}

TEST(Checkpoint, LoadBetweenStepsOnly) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  TempDir dir;
  run({3, 2, 1}, adamw_options(), dir.path(), [&](Rank& r) {
    r.train_step(0);
    ASSERT_TRUE((*r.checkpointer->save("a"))->wait().ok());
    ASSERT_TRUE(r.engine->gather(0).ok());  // a unit gathered
    auto refused = r.checkpointer->load("a");
    EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition)
        << refused.status().to_string();
    ASSERT_TRUE(r.engine->release(0).ok());
    EXPECT_TRUE(r.checkpointer->load("a").ok());
    r.train_step(1);
  });
  // Stage 3 before broadcast_parameters() has no shards to load into: refused, then taken
  // once broadcast_parameters() made them.
  testing_util::run_ranks(2, [&](int32_t, Communicator& comm) {
    std::shared_ptr<Communicator> world(&comm, [](Communicator*) {});
    auto engine = create_sharded_engine(3, world, nullptr, adamw_options());
    ASSERT_TRUE(engine.ok());
    for (const auto& p : kModel) {
      ParamSpec spec{p.name, p.shape, DType::kFloat32, p.trainable};
      spec.unit = p.unit;
      ASSERT_TRUE((*engine)->add_param(spec).ok());
    }
    ASSERT_TRUE((*engine)->seal().ok());
    auto c = Checkpointer::create(*dynamic_cast<Checkpointable*>(engine->get()), world, dir.path(),
                                  small_chunks());
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    auto early = (*c)->load("a");
    EXPECT_EQ(early.status().code(), StatusCode::kFailedPrecondition) << early.status().to_string();
    EXPECT_NE(early.status().message().find("broadcast_parameters()"), std::string::npos)
        << early.status().to_string();
    ASSERT_TRUE((*engine)->broadcast_parameters().ok());
    auto loaded = (*c)->load("a");
    EXPECT_TRUE(loaded.ok()) << loaded.status().to_string();
  });
  // Once a unit of the step is gathered (waited for and not released: stage 2 too, whose
  // parameters stay resident, since the framework may have read the loss scale and scaled
  // its loss), or a gradient of the step has checked in, a load is refused and changes
  // nothing; a save there keeps the state the last step left; the step then finishes as
  // usual, and a load after it is taken. A unit waited for and released (an evaluation's
  // forward) leaves a load possible.
  for (const int32_t stage : {2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    TempDir dir2;
    run({stage, 2, 1}, adamw_options(), dir2.path(), [&](Rank& r) {
      r.train_step(0);
      ASSERT_TRUE((*r.checkpointer->save("a"))->wait().ok());
      r.train_step(1);
      const auto before = r.state_bytes();
      bool refused_once = false;
      for (int32_t u = kUnits; u-- > 0;) {
        ASSERT_TRUE(r.engine->gather(u).ok());
        if (u == kUnits - 1) {  // the step's first wait, no gradient yet
          auto refused = r.checkpointer->load("a");
          EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition)
              << refused.status().to_string();
          EXPECT_NE(refused.status().message().find("unit " + std::to_string(u) + " is gathered"),
                    std::string::npos)
              << refused.status().to_string();
          EXPECT_EQ(r.state_bytes(), before) << "a refused load changed the state";
        }
        for (size_t p = kModel.size(); p-- > 0;) {
          if (kModel[p].unit != u || !kModel[p].trainable) continue;
          auto g = r.engine->grad_data(p);
          ASSERT_TRUE(g.ok());
          const DType d = r.engine->plan().params()[p].dtype;
          for (size_t i = 0; i < numel(kModel[p]); ++i) testing_util::store_element(d, *g, i, 0.5f);
          ASSERT_TRUE(r.engine->grad_ready(p, nullptr).ok());
          if (!refused_once) {
            auto refused = r.checkpointer->load("a");
            EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition)
                << refused.status().to_string();
            // Said first: the unit is gathered.
            EXPECT_NE(refused.status().message().find("is gathered"), std::string::npos)
                << refused.status().to_string();
            EXPECT_EQ(r.state_bytes(), before) << "a refused load changed the state";
            refused_once = true;
            // A save in the middle of the step keeps the state the last step left.
            auto mid = r.checkpointer->save("mid");
            ASSERT_TRUE(mid.ok()) << mid.status().to_string();
            ASSERT_TRUE((*mid)->wait().ok());
          }
        }
        ASSERT_TRUE(r.engine->release(u).ok());
      }
      ASSERT_TRUE(r.engine->step().ok());
      EXPECT_NE(r.state_bytes(), before);
      // An evaluation's forward: every unit waited for and released, no gradient.
      for (int32_t u = 0; u < kUnits; ++u) {
        ASSERT_TRUE(r.engine->gather(u).ok());
        ASSERT_TRUE(r.engine->release(u).ok());
      }
      auto mid = r.checkpointer->load("mid");
      ASSERT_TRUE(mid.ok()) << mid.status().to_string();
      EXPECT_EQ(r.state_bytes(), before) << "the save mid-step did not keep the last step's state";
      auto loaded = r.checkpointer->load("a");
      ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
      r.train_step(1);
      if (stage == 2) {  // the step ends the use of units a framework never released
        r.train_step(2, /*release=*/false);
        auto after = r.checkpointer->load("a");
        EXPECT_TRUE(after.ok()) << after.status().to_string();
      }
    });
  }
}

// Arguments a checkpointer cannot work with are refused naming what is wrong, before
// anything is written.
TEST(Checkpoint, BadArgumentsAreRefusedNamingThem) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  TempDir dir;
  run({2, 2, 1}, sgd_options(), dir.path(), [&](Rank& r) {
    auto expect_refused = [&](std::shared_ptr<Communicator> group, const std::string& root,
                              CheckpointOptions o, const std::string& message) {
      auto c = Checkpointer::create(*r.state, std::move(group), root, o);
      ASSERT_FALSE(c.ok()) << message;
      EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << c.status().to_string();
      EXPECT_NE(c.status().message().find(message), std::string::npos) << c.status().to_string();
    };
    auto alone = self_backend::SelfCommunicator::create({});
    ASSERT_TRUE(alone.ok());
    std::shared_ptr<Communicator> one(std::move(*alone));
    expect_refused(one, dir.path(), {},
                   "the group has 1 ranks but the engine's state is held by 2");
    expect_refused(nullptr, dir.path(), {}, "null");
    expect_refused(r.world, "", {}, "root directory is empty");
    CheckpointOptions o;
    o.keep_last = -1;
    expect_refused(r.world, dir.path(), o, "keep_last");
    for (uint64_t chunk : {uint64_t{0}, (uint64_t{1} << 34) + 1}) {
      o = {};
      o.chunk_bytes = chunk;
      expect_refused(r.world, dir.path(), o, "chunk_bytes must be in [1, 2^34]");
    }
    o = {};
    o.timeout = Milliseconds(0);
    expect_refused(r.world, dir.path(), o, "timeout");
    // Nothing saved yet: the latest checkpoint is missing, named as such.
    auto none = r.checkpointer->load("");
    EXPECT_EQ(none.status().code(), StatusCode::kNotFound) << none.status().to_string();
    EXPECT_NE(none.status().message().find("no checkpoint under"), std::string::npos)
        << none.status().to_string();
    // Names and metadata a save cannot store.
    r.train_step(0);
    for (const std::map<std::string, std::string>& metadata :
         {std::map<std::string, std::string>{{"", "v"}},
          std::map<std::string, std::string>{{std::string(4097, 'k'), "v"}},
          std::map<std::string, std::string>{{"k", std::string((1 << 20) + 1, 'v')}}}) {
      auto refused = r.checkpointer->save("m", metadata);
      EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
      EXPECT_NE(refused.status().message().find("metadata keys need 1 to 4096 bytes"),
                std::string::npos)
          << refused.status().to_string();
    }
    {  // More entries than a reader keeps.
      std::map<std::string, std::string> many;
      for (int i = 0; i <= 65'536; ++i) many.emplace_hint(many.end(), "k" + std::to_string(i), "");
      ASSERT_EQ(many.size(), 65'537u);
      auto refused = r.checkpointer->save("m", many);
      EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
      EXPECT_NE(refused.status().message().find("65537 entries, more than the 65536"),
                std::string::npos)
          << refused.status().to_string();
    }
    for (const char* name : {"", "latest", "../up", ".tmp-x"}) {
      EXPECT_EQ(r.checkpointer->save(name).status().code(), StatusCode::kInvalidArgument) << name;
    }
    auto fine = r.checkpointer->save("m", {{std::string(4096, 'k'), std::string(1 << 20, 'v')}});
    ASSERT_TRUE(fine.ok()) << fine.status().to_string();
    ASSERT_TRUE((*fine)->wait().ok());
  });
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path())) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"latest", "m"})) << "a refused save wrote something";
  // A hostile latest pointer: read up to its limit only.
  { std::ofstream(dir / "latest") << std::string(5000, 'm'); }
  auto latest = latest_checkpoint(dir.path());
  EXPECT_EQ(latest.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(latest.status().message().find("more than the 4096 allowed"), std::string::npos)
      << latest.status().to_string();
}

// The ranks of a group name different checkpoints: a load changes no engine and says so on
// every rank; a save publishes nothing and fails on every rank (also where a rank's files
// would have landed in the other name's directory).
TEST(Checkpoint, RanksNamingDifferentCheckpointsChangeNothing) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  TempDir dir;
  run({2, 2, 1}, adamw_options(), dir.path(), [&](Rank& r) {
    r.train_step(0);
    ASSERT_TRUE((*r.checkpointer->save("a", {{"step", "0"}}))->wait().ok());
    r.train_step(1);
    ASSERT_TRUE((*r.checkpointer->save("b", {{"step", "1"}}))->wait().ok());
    r.train_step(2);
    auto before = r.engine->gather_all();
    ASSERT_TRUE(before.ok());
    auto mixed = r.checkpointer->load(r.rank == 0 ? "a" : "b");
    ASSERT_FALSE(mixed.ok()) << "rank " << r.rank << " loaded a mix of a and b";
    EXPECT_EQ(mixed.status().code(), StatusCode::kInvalidArgument) << mixed.status().to_string();
    EXPECT_NE(mixed.status().message().find("different sources"), std::string::npos)
        << mixed.status().to_string();
    auto after = r.engine->gather_all();
    ASSERT_TRUE(after.ok());
    EXPECT_EQ(*after, *before) << "a refused load changed the engine";
    // One latest for both: the same checkpoint everywhere.
    auto latest = r.checkpointer->load("");
    ASSERT_TRUE(latest.ok()) << latest.status().to_string();
    EXPECT_EQ(latest->metadata.at("step"), "1");

    auto save = r.checkpointer->save(r.rank == 0 ? "c" : "d");
    ASSERT_TRUE(save.ok()) << save.status().to_string();
    const Status s = (*save)->wait();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
    EXPECT_NE(s.message().find("different names"), std::string::npos) << s.to_string();
  });
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path())) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"a", "b", "latest"}));
  EXPECT_EQ(*latest_checkpoint(dir.path()), "b");
}

// Ranks that save one name after different numbers of steps (a "catch Ctrl-C, save" handler
// that one rank reached before its step() and another after it) published a checkpoint
// mixing the two steps, which verified (red team). Every rank is refused; nothing published.
TEST(Checkpoint, RanksThatTookDifferentStepsAreRefused) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  TempDir dir;
  testing_util::run_ranks(3, [&](int32_t rank, Communicator& comm) {
    std::shared_ptr<Communicator> world(&comm, [](Communicator*) {});
    FakeState state;
    state.topology = {2, 1, 0, 3, rank, 256};  // three dp replicas
    state.writer = rank == 0;
    auto c = Checkpointer::create(state, world, dir.path(), CheckpointOptions{});
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    state.steps = 6;
    ASSERT_TRUE((*(*c)->save("same"))->wait().ok());
    state.steps = rank == 2 ? 5 : 6;
    auto save = (*c)->save("interrupted");
    ASSERT_TRUE(save.ok()) << save.status().to_string();
    const Status s = (*save)->wait();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
    if (rank == 2) {
      EXPECT_NE(s.message().find("rank 0 after 6 steps, rank 2 after 5"), std::string::npos)
          << s.to_string();
    }
  });
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path())) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"latest", "same"}));
}

// A manifest is JSON: names and metadata that are not UTF-8 are refused before anything is
// written (they used to publish a checkpoint whose manifest named other tensors).
TEST(Checkpoint, TextThatIsNotUtf8IsRefused) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  TempDir dir;
  run({2, 2, 1}, sgd_options(), dir.path(), [&](Rank& r) {
    r.train_step(0);
    for (const auto& metadata : {std::map<std::string, std::string>{{"k\xff", "v"}},
                                 std::map<std::string, std::string>{{"k", "v\xc0\xaf"}},
                                 std::map<std::string, std::string>{{"k", "\xed\xa0\x80"}}}) {
      auto refused = r.checkpointer->save("m", metadata);
      EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
      EXPECT_NE(refused.status().message().find("not valid UTF-8"), std::string::npos)
          << refused.status().to_string();
    }
    auto fine = r.checkpointer->save("m", {{"\xc3\xa9t\xc3\xa9", "\xf0\x9f\x98\x80"}});
    ASSERT_TRUE(fine.ok()) << fine.status().to_string();
    ASSERT_TRUE((*fine)->wait().ok());
    auto loaded = r.checkpointer->load("m");
    ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
    EXPECT_EQ(loaded->metadata.at("\xc3\xa9t\xc3\xa9"), "\xf0\x9f\x98\x80");
  });
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path())) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"latest", "m"}));
}

// A save that fails because a rank left (here: it never saves, and its checkpointer and
// communicators go away) leaves nothing under the root but what was there: rank 0 removes
// the temporary directory it made, the previous checkpoint stays the latest.
TEST(Checkpoint, ASaveThatLosesARankRemovesItsTemporaryDirectory) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  TempDir dir;
  CheckpointOptions options = small_chunks();
  options.timeout = Milliseconds(10'000);
  run(
      {2, 2, 1}, adamw_options(), dir.path(),
      [&](Rank& r) {
        r.train_step(0);
        ASSERT_TRUE((*r.checkpointer->save("a"))->wait().ok());
        if (r.rank != 0) return;  // rank 1 leaves
        auto b = r.checkpointer->save("b");
        ASSERT_TRUE(b.ok()) << b.status().to_string();
        const Status s = (*b)->wait();
        EXPECT_FALSE(s.ok()) << "saved without rank 1";
      },
      options);
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir.path())) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"a", "latest"}));
  EXPECT_EQ(*latest_checkpoint(dir.path()), "a");
  EXPECT_TRUE(verify_checkpoint(dir / "a").ok());
}

// A save in flight whose peer is alive but never joins (hung): aborting the group the
// checkpointer was made from ends the save at once (its own communicator, split from the
// group, is tied to it), instead of after the checkpoint's timeout.
TEST(Checkpoint, AbortingTheGroupEndsASaveInFlight) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  TempDir dir;
  CheckpointOptions options = small_chunks();
  options.timeout = Milliseconds(120'000);
  std::promise<void> rank0_done;
  std::shared_future<void> done = rank0_done.get_future().share();
  run(
      {2, 2, 1}, sgd_options(), dir.path(),
      [&](Rank& r) {
        r.train_step(0);
        if (r.rank != 0) {  // alive, its communicators open, never saving
          done.wait();
          return;
        }
        auto save = r.checkpointer->save("hung");
        ASSERT_TRUE(save.ok()) << save.status().to_string();
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        const auto start = std::chrono::steady_clock::now();
        r.world->abort();
        const Status s = (*save)->wait();
        const auto took = std::chrono::steady_clock::now() - start;
        rank0_done.set_value();
        EXPECT_EQ(s.code(), StatusCode::kAborted) << s.to_string();
        EXPECT_LT(took, std::chrono::seconds(10)) << s.to_string();
      },
      options);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path())) names.push_back(e.path().filename());
  EXPECT_TRUE(names.empty()) << "an aborted save left " << names.size() << " entries";
}

// Bytes this process has read (`rchar`) or written (`wchar`) through system calls so far,
// from /proc/self/io.
uint64_t process_io(const std::string& which) {
  std::ifstream io("/proc/self/io");
  std::string key;
  uint64_t value = 0;
  while (io >> key >> value) {
    if (key == which + ":") return value;
  }
  ADD_FAILURE() << "no " << which << " in /proc/self/io";
  return 0;
}

// A load over an aborted group read the whole checkpoint before its agreement refused it
// (minutes for a large model after a job was told to stop). It now stops before its first
// read of tensor data: ABORTED, and the state unchanged.
TEST(Checkpoint, ALoadOverAnAbortedGroupReadsNoTensorData) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  TempDir dir;
  testing_util::run_ranks(1, [&](int32_t, Communicator& comm) {
    std::shared_ptr<Communicator> world(&comm, [](Communicator*) {});
    constexpr int64_t kRows = int64_t{1} << 19;  // 16 MiB of float32
    FakeState state(kRows);
    std::fill(state.w.begin(), state.w.end(), 1.0f);
    auto c = Checkpointer::create(state, world, dir.path(), CheckpointOptions{});
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    auto save = (*c)->save("big");
    ASSERT_TRUE(save.ok()) << save.status().to_string();
    ASSERT_TRUE((*save)->wait().ok()) << (*save)->status().to_string();
    std::fill(state.w.begin(), state.w.end(), 7.0f);
    EXPECT_FALSE(comm.was_aborted());
    comm.abort();
    EXPECT_TRUE(comm.was_aborted());
    const uint64_t before = process_io("rchar");
    auto loaded = (*c)->load("big");
    const uint64_t read = process_io("rchar") - before;
    ASSERT_FALSE(loaded.ok());
    EXPECT_EQ(loaded.status().code(), StatusCode::kAborted) << loaded.status().to_string();
    EXPECT_LT(read, uint64_t{1} << 20) << "read " << read << " bytes of a 16 MiB checkpoint";
    EXPECT_EQ(state.loads, 0);
    EXPECT_EQ(std::count(state.w.begin(), state.w.end(), 7.0f),
              static_cast<ptrdiff_t>(state.w.size()));
  });
}

// The same for a save: aborted while its writer waits for the snapshot (here held back by a
// step still running), it wrote the whole data file before its reports' gathering failed.
// It now stops writing: ABORTED, nothing left under the root.
TEST(Checkpoint, AnAbortDuringASaveEndsItsWriting) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  TempDir dir;
  testing_util::run_ranks(1, [&](int32_t, Communicator& comm) {
    std::shared_ptr<Communicator> world(&comm, [](Communicator*) {});
    FakeState state(int64_t{1} << 19);  // 16 MiB of float32
    auto c = Checkpointer::create(state, world, dir.path(), CheckpointOptions{});
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    std::promise<void> release;
    std::shared_future<void> gate = release.get_future().share();
    state.stream.enqueue([gate] { gate.wait(); });
    auto save = (*c)->save("big");
    ASSERT_TRUE(save.ok()) << save.status().to_string();
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the writer waits
    comm.abort();
    const uint64_t before = process_io("wchar");
    release.set_value();
    const Status s = (*save)->wait();
    const uint64_t written = process_io("wchar") - before;
    EXPECT_EQ(s.code(), StatusCode::kAborted) << s.to_string();
    EXPECT_LT(written, uint64_t{1} << 20) << "wrote " << written << " bytes after the abort";
  });
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path())) names.push_back(e.path().filename());
  EXPECT_TRUE(names.empty()) << "an aborted save left " << names.size() << " entries";
}

// Two jobs that share a root save one after the other (the root's save lock,
// ".hpshard-save-lock"): the second's removal of what crashed saves left removed the first's
// save in flight, which then failed. A save that cannot have the lock within half its
// timeout fails naming the holder, leaving nothing; the holder's save is unharmed.
TEST(Checkpoint, TwoJobsSavingIntoOneRootTakeTurns) {
  TempDir dir;
  auto group = [] {
    auto c = self_backend::SelfCommunicator::create({});
    return std::shared_ptr<Communicator>(std::move(*c));
  };
  FakeState first(64), second(64);
  std::fill(first.w.begin(), first.w.end(), 1.0f);
  std::fill(second.w.begin(), second.w.end(), 2.0f);
  auto a = Checkpointer::create(first, group(), dir.path(), small_chunks());
  // The longest timeout waits too: "now + half of it" overflowed, and the save failed at
  // once, saying the lock had been held for 2^62 ms.
  CheckpointOptions patient = small_chunks();
  patient.timeout = Milliseconds(std::numeric_limits<int64_t>::max());
  auto b = Checkpointer::create(second, group(), dir.path(), patient);
  CheckpointOptions quick = small_chunks();
  quick.timeout = Milliseconds(600);
  auto c = Checkpointer::create(second, group(), dir.path(), quick);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  // The first job's save stays in flight: its snapshot waits behind a step still running.
  std::promise<void> release;
  std::shared_future<void> gate = release.get_future().share();
  first.stream.enqueue([gate] { gate.wait(); });
  auto saving_a = (*a)->save("a");
  ASSERT_TRUE(saving_a.ok()) << saving_a.status().to_string();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // its writer holds the lock
  EXPECT_TRUE(fs::exists(dir / ".hpshard-save-lock"));
  auto saving_c = (*c)->save("c");
  ASSERT_TRUE(saving_c.ok());
  const Status refused = (*saving_c)->wait();
  EXPECT_EQ(refused.code(), StatusCode::kTimeout) << refused.to_string();
  EXPECT_NE(
      refused.message().find(".hpshard-save-lock': pid " + std::to_string(::getpid()) + " on "),
      std::string::npos)
      << refused.message();
  EXPECT_FALSE(fs::exists(dir / "c"));
  auto saving_b = (*b)->save("b");
  ASSERT_TRUE(saving_b.ok());
  std::thread releaser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    release.set_value();
  });
  const Status saved_a = (*saving_a)->wait();
  const Status saved_b = (*saving_b)->wait();
  releaser.join();
  EXPECT_TRUE(saved_a.ok()) << saved_a.to_string();
  EXPECT_TRUE(saved_b.ok()) << saved_b.to_string();
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path())) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"a", "b", "latest"}));
  EXPECT_EQ(*latest_checkpoint(dir.path()), "b");
  for (const char* n : {"a", "b"}) EXPECT_TRUE(verify_checkpoint(dir / n).ok()) << n;
  std::fill(first.w.begin(), first.w.end(), 0.0f);
  ASSERT_TRUE((*a)->load("a").ok());
  EXPECT_EQ(first.w[5], 1.0f);
  ASSERT_TRUE((*a)->load("b").ok());
  EXPECT_EQ(first.w[5], 2.0f);
  // Where the file system has no flock, saves go on unlocked (as before the lock); any
  // other failure to lock fails the save, naming the lock's file.
  for (const int err : {ENOLCK, EOPNOTSUPP, EIO}) {
    g_flock_errno = err;
    auto saving = (*b)->save("nolock-" + std::to_string(err));
    ASSERT_TRUE(saving.ok());
    const Status s = (*saving)->wait();
    g_flock_errno = 0;
    if (err == EIO) {
      EXPECT_EQ(s.code(), StatusCode::kBackendError) << s.to_string();
      EXPECT_NE(s.message().find("cannot lock '" + dir / ".hpshard-save-lock'"), std::string::npos)
          << s.message();
    } else {
      EXPECT_TRUE(s.ok()) << s.to_string();
      EXPECT_FALSE(fs::exists(dir / ".hpshard-save-lock"));
    }
  }
  EXPECT_FALSE(fs::exists(dir / "nolock-5"));
}

// A checkpointer is used from one thread at a time; two threads that save and load on one
// anyway take turns. They ended the process ("terminate called without an active
// exception": a second writer thread assigned over a running one).
TEST(Checkpoint, CallsFromTwoThreadsTakeTurns) {
  TempDir dir;
  auto group = self_backend::SelfCommunicator::create({});
  ASSERT_TRUE(group.ok());
  FakeState state(64);
  std::fill(state.w.begin(), state.w.end(), 3.0f);
  auto ckpt = Checkpointer::create(state, std::move(*group), dir.path(), small_chunks());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().to_string();
  std::vector<std::thread> threads;
  std::vector<std::string> failures;
  std::mutex failures_mutex;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 8; ++i) {
        const std::string name = "t" + std::to_string(t) + "-" + std::to_string(i);
        auto saving = (*ckpt)->save(name);
        Status s = saving.ok() ? (*saving)->wait() : saving.status();
        if (s.ok()) s = (*ckpt)->wait();
        if (s.ok() && i % 3 == 0) s = (*ckpt)->load(name).status();
        if (!s.ok()) {
          std::lock_guard lock(failures_mutex);
          failures.push_back(name + ": " + s.to_string());
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_TRUE(failures.empty()) << failures.front();
  for (int t = 0; t < 2; ++t) {
    for (int i = 0; i < 8; ++i) {
      const std::string name = "t" + std::to_string(t) + "-" + std::to_string(i);
      EXPECT_TRUE(verify_checkpoint(dir / name).ok()) << name;
    }
  }
  EXPECT_EQ(state.w[7], 3.0f);
}

TEST(Checkpoint, KeepLastDeletesOlderOnesAfterPublishing) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  TempDir dir;
  CheckpointOptions o = small_chunks();
  o.keep_last = 2;
  run(
      {2, 2, 1}, sgd_options(), dir.path(),
      [&](Rank& r) {
        for (int s = 0; s < 4; ++s) {
          r.train_step(s);
          auto work = r.checkpointer->save("s" + std::to_string(s));
          ASSERT_TRUE(work.ok());
          // The second save waits for the first: never two in flight.
        }
        ASSERT_TRUE(r.checkpointer->wait().ok());
        auto again = r.checkpointer->save("s3");
        EXPECT_EQ(again.status().code(), StatusCode::kAlreadyExists);
      },
      o);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path())) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"latest", "s2", "s3"}));
  EXPECT_EQ(*latest_checkpoint(dir.path()), "s3");
  EXPECT_TRUE(verify_checkpoint(dir / "s2").ok());
  EXPECT_EQ(*resolve_checkpoint(dir.path()), dir / "s3");
  // A folder with neither is NOT_FOUND; one that cannot be searched says why (it used to be
  // "holds neither" too, for a folder without permission to search it).
  fs::create_directories(dir / "empty");
  EXPECT_EQ(resolve_checkpoint(dir / "empty").status().code(), StatusCode::kNotFound);
  std::ofstream(dir / "a-file") << "x";
  const auto refused = resolve_checkpoint(dir / "a-file");
  EXPECT_EQ(refused.status().code(), StatusCode::kBackendError) << refused.status().to_string();
  EXPECT_NE(refused.status().message().find("Not a directory"), std::string::npos)
      << refused.status().message();
}

// Rotation goes by the order of publication (the manifests' sequence), not by the clock: a
// checkpoint whose time is ahead (a clock stepped back since, or another host's) and one
// written without a sequence are older than the saves after them. By time, keep_last 2 kept
// those two and deleted each new save's predecessor.
TEST(Checkpoint, RotationFollowsTheOrderOfPublicationNotTheClock) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  TempDir dir;
  run({2, 2, 1}, sgd_options(), dir.path(), [&](Rank& r) {
    r.train_step(0);
    ASSERT_TRUE((*r.checkpointer->save("legacy"))->wait().ok());
    ASSERT_TRUE((*r.checkpointer->save("ahead"))->wait().ok());
  });
  constexpr int64_t kHour = int64_t{3600} * 1'000'000'000;
  for (const auto& [name, hours, sequence] :
       {std::tuple{"legacy", 2, uint64_t{0}}, std::tuple{"ahead", 1, uint64_t{2}}}) {
    auto m = ckpt::read_manifest(dir / name);
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    EXPECT_EQ(m->sequence, std::string(name) == "legacy" ? 1u : 2u);
    m->created_unix_ns += hours * kHour;
    m->sequence = sequence;
    std::ofstream(dir / name + "/manifest.json", std::ios::trunc) << ckpt::manifest_to_json(*m);
    ASSERT_TRUE(verify_checkpoint(dir / name).ok());
  }
  CheckpointOptions o = small_chunks();
  o.keep_last = 2;
  run(
      {2, 2, 1}, sgd_options(), dir.path(),
      [&](Rank& r) {
        for (int s = 0; s < 3; ++s) {
          r.train_step(s);
          ASSERT_TRUE((*r.checkpointer->save("s" + std::to_string(s)))->wait().ok());
        }
      },
      o);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path())) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"latest", "s1", "s2"}));
  auto s2 = ckpt::read_manifest(dir / "s2");
  ASSERT_TRUE(s2.ok());
  EXPECT_EQ(s2->sequence, 5u);
}

// Two models' checkpointers under one root (a GAN's two networks in one job): each one's
// keep_last rotated every checkpoint there, so B's only checkpoint went at A's next save
// and B could not resume. Only a checkpointer's own model rotates now.
TEST(Checkpoint, KeepLastRotatesOnlyItsOwnModelsCheckpoints) {
  TempDir dir;
  testing_util::run_ranks(1, [&](int32_t, Communicator& comm) {
    std::shared_ptr<Communicator> world(&comm, [](Communicator*) {});
    FakeState a(8), b(4);  // param/w of 8 x 8 and of 4 x 8: two models
    CheckpointOptions o;
    o.keep_last = 1;
    auto ca = Checkpointer::create(a, world, dir.path(), o);
    auto cb = Checkpointer::create(b, world, dir.path(), o);
    ASSERT_TRUE(ca.ok() && cb.ok());
    std::fill(b.w.begin(), b.w.end(), 7.0f);
    for (const auto& [c, name] :
         {std::pair{cb->get(), "b1"}, std::pair{ca->get(), "a1"}, std::pair{ca->get(), "a2"}}) {
      auto work = c->save(name);
      ASSERT_TRUE(work.ok()) << work.status().to_string();
      ASSERT_TRUE((*work)->wait().ok()) << (*work)->status().to_string();
    }
    EXPECT_FALSE(fs::exists(dir / "a1")) << "A's own older checkpoint rotates";
    EXPECT_TRUE(fs::exists(dir / "a2"));
    ASSERT_TRUE(fs::exists(dir / "b1")) << "A's keep_last deleted B's checkpoint";
    std::fill(b.w.begin(), b.w.end(), 0.0f);
    auto report = (*cb)->load("b1");
    ASSERT_TRUE(report.ok()) << report.status().to_string();
    EXPECT_EQ(b.w, std::vector<float>(b.w.size(), 7.0f));
    // B's next save rotates B's own and leaves A's.
    auto work = (*cb)->save("b2");
    ASSERT_TRUE(work.ok() && (*work)->wait().ok());
    EXPECT_FALSE(fs::exists(dir / "b1"));
    EXPECT_TRUE(fs::exists(dir / "b2") && fs::exists(dir / "a2"));
  });
}

// Each save lists the root's checkpoints (for its sequence, and with keep_last for the
// rotation): it read and parsed every manifest there, so the k-th save of a run that keeps
// all read k manifests, and a broken one at every save. A manifest is now read once while
// its file stays as it is: from the second save on, each save reads the one manifest
// published since the save before it, however many are under the root.
TEST(Checkpoint, ASaveReadsOnlyTheManifestsPublishedSinceTheSaveBefore) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  TempDir dir;
  // A manifest that fails to parse, after 256 KiB (skipped by the listings, as before).
  fs::create_directories(dir / "broken");
  std::ofstream(dir / "broken/manifest.json") << "{\"a\": \"" << std::string(256 << 10, 'x');
  testing_util::run_ranks(1, [&](int32_t, Communicator& comm) {
    std::shared_ptr<Communicator> world(&comm, [](Communicator*) {});
    FakeState state;
    auto c = Checkpointer::create(state, world, dir.path(), CheckpointOptions{});
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    uint64_t manifest_bytes = 0;
    for (int s = 0; s < 40; ++s) {
      const uint64_t before = process_io("rchar");
      auto work = (*c)->save("s" + std::to_string(s));
      ASSERT_TRUE(work.ok()) << work.status().to_string();
      ASSERT_TRUE((*work)->wait().ok()) << (*work)->status().to_string();
      const uint64_t read = process_io("rchar") - before;
      if (s == 0) {
        manifest_bytes = fs::file_size(dir / "s0/manifest.json");
        continue;
      }
      // The manifest of the save before (of about manifest_bytes), and /proc/self/io.
      ASSERT_LT(read, manifest_bytes + 1024)
          << "save " << s << " read " << read << " bytes; a manifest has " << manifest_bytes;
    }
    auto m = ckpt::read_manifest(dir / "s39");
    ASSERT_TRUE(m.ok());
    EXPECT_EQ(m->sequence, 40u);
  });
}

// A manifest is known by its file (device, inode, size, times): one that another job
// replaced under the same name, rewrote in place, or that appeared or went since the last
// save is read again, so the next save's sequence follows it and rotation counts it.
TEST(Checkpoint, ASaveSeesManifestsChangedSinceItsLastListing) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  TempDir dir;
  // A checkpoint's manifest with `sequence`, published as `name` (a new directory, as
  // another job's save makes one) or written over the manifest there (the same file).
  auto republish = [&](const std::string& from, const std::string& name, uint64_t sequence,
                       bool in_place) {
    auto m = ckpt::read_manifest(dir / from);
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    m->name = name;
    m->sequence = sequence;
    if (!in_place) {
      const std::string aside = dir / ".other-job";
      fs::remove_all(aside);
      fs::copy(dir / from, aside, fs::copy_options::recursive);
      fs::remove(aside + "/manifest.json");
      std::ofstream(aside + "/manifest.json") << ckpt::manifest_to_json(*m);
      fs::remove_all(dir / name);
      fs::rename(aside, dir / name);
    } else {
      std::ofstream(dir / name + "/manifest.json", std::ios::trunc) << ckpt::manifest_to_json(*m);
    }
    auto verified = verify_checkpoint(dir / name);
    ASSERT_TRUE(verified.ok()) << verified.status().to_string();
  };
  auto sequence_of = [&](const std::string& name) {
    auto m = ckpt::read_manifest(dir / name);
    return m.ok() ? m->sequence : 0;
  };
  auto names = [&] {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir.path())) out.push_back(e.path().filename());
    std::sort(out.begin(), out.end());
    return out;
  };
  testing_util::run_ranks(1, [&](int32_t, Communicator& comm) {
    std::shared_ptr<Communicator> world(&comm, [](Communicator*) {});
    FakeState state;
    CheckpointOptions o = small_chunks();
    o.keep_last = 2;
    auto c = Checkpointer::create(state, world, dir.path(), o);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    auto save = [&](const std::string& name) {
      auto work = (*c)->save(name);
      ASSERT_TRUE(work.ok()) << work.status().to_string();
      ASSERT_TRUE((*work)->wait().ok()) << (*work)->status().to_string();
      ASSERT_TRUE((*c)->wait().ok());
    };
    save("a");
    save("b");
    ASSERT_EQ(sequence_of("b"), 2u);
    // Another job published `a` anew after these saves read it: it is now the newest, so
    // the next save follows it and the rotation keeps it, deleting `b`.
    republish("b", "a", 7, false);
    save("c");
    EXPECT_EQ(sequence_of("c"), 8u);
    EXPECT_EQ(names(), (std::vector<std::string>{"a", "c", "latest"}));
    // `a` rewritten in place (the same file) with a later sequence.
    republish("a", "a", 100, true);
    save("d");
    EXPECT_EQ(sequence_of("d"), 101u);
    EXPECT_EQ(names(), (std::vector<std::string>{"a", "d", "latest"}));
    // A manifest broken in place is skipped (and `a` no longer counts: the rotation keeps
    // `d` and `e`, and leaves the directory it does not list); mended, it counts again.
    auto mended = ckpt::read_manifest(dir / "a");
    ASSERT_TRUE(mended.ok());
    std::ofstream(dir / "a/manifest.json", std::ios::trunc) << "{";
    save("e");
    EXPECT_EQ(sequence_of("e"), 102u);
    EXPECT_EQ(names(), (std::vector<std::string>{"a", "d", "e", "latest"}));
    mended->sequence = 500;
    std::ofstream(dir / "a/manifest.json", std::ios::trunc) << ckpt::manifest_to_json(*mended);
    save("f");
    EXPECT_EQ(sequence_of("f"), 501u);
    EXPECT_EQ(names(), (std::vector<std::string>{"a", "f", "latest"}));
    // A checkpoint that appeared (copied in) counts; one that went no longer does.
    republish("f", "g", 900, false);
    fs::remove_all(dir / "a");
    save("h");
    EXPECT_EQ(sequence_of("h"), 901u);
    EXPECT_EQ(names(), (std::vector<std::string>{"g", "h", "latest"}));
  });
}

// A save whose `latest` pointer cannot be replaced (here a directory stands there; a disk
// too full for the pointer's file is the case disk_full_test.sh covers) fails with nothing
// published, and the same name saves once the way is clear (the checkpoint was renamed into
// place first and stayed: a failed save published, and its retry was ALREADY_EXISTS).
TEST(Checkpoint, ASaveThatCannotReplaceLatestPublishesNothing) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  TempDir dir;
  fs::create_directories(dir / "latest/in-the-way");
  run(
      {2, 2, 1}, sgd_options(), dir.path(),
      [&](Rank& r) {
        r.train_step(0);
        const Status failed = (*r.checkpointer->save("a"))->wait();
        EXPECT_EQ(failed.code(), StatusCode::kBackendError) << failed.to_string();
        EXPECT_NE(failed.message().find(dir / "latest"), std::string::npos) << failed.message();
        EXPECT_FALSE(fs::exists(dir / "a"));
        ASSERT_TRUE(r.world->barrier().value()->wait().ok());
        if (r.rank == 0) fs::remove_all(dir / "latest");
        ASSERT_TRUE(r.world->barrier().value()->wait().ok());
        const Status retried = (*r.checkpointer->save("a"))->wait();
        EXPECT_TRUE(retried.ok()) << retried.to_string();
      },
      small_chunks());
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path())) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"a", "latest"}));
  EXPECT_EQ(*latest_checkpoint(dir.path()), "a");
  EXPECT_TRUE(verify_checkpoint(dir / "a").ok());
}

// What a save killed part-way leaves in the root (its temporary directory, a half-written
// replacement of the latest pointer, a directory being deleted) is removed by the next save;
// a checkpoint and other files stay.
TEST(Checkpoint, ASaveRemovesWhatAKilledSaveLeft) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  TempDir dir;
  fs::create_directories(dir / ".tmp-old-0123/rank-00000.bin");
  fs::create_directories(dir / ".trash-old");
  std::ofstream(dir / "latest.tmp-0a1b2c3d4e5f") << "ol";
  std::ofstream(dir / "notes.txt") << "kept";
  run(
      {2, 2, 1}, sgd_options(), dir.path(),
      [&](Rank& r) {
        r.train_step(0);
        ASSERT_TRUE((*r.checkpointer->save("a"))->wait().ok());
      },
      small_chunks());
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path())) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"a", "latest", "notes.txt"}));
  EXPECT_EQ(*latest_checkpoint(dir.path()), "a");
}

TEST(Checkpoint, SafetensorsExportAndImport) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  TempDir dir;
  const EngineOptions options = adamw_options();
  std::vector<std::vector<float>> saved;
  run({2, 2, 1}, options, dir.path(), [&](Rank& r) {
    for (int s = 0; s < 2; ++s) r.train_step(s);
    // A user key "format" yields to the "pt" the export promises; "hpshard_mp", a part's
    // key, is left out of a whole model's export (an import would take it for a part's).
    ASSERT_TRUE(
        (*r.checkpointer->save("a", {{"epoch", "1"}, {"format", "mine"}, {"hpshard_mp", "7"}}))
            ->wait()
            .ok());
    auto full = r.engine->gather_all();
    if (r.rank == 0) saved = *full;
  });
  const std::string model = dir / "model.safetensors";
  // Whatever lies beside the output is not the export's: a directory of the name a fixed
  // temporary name would take stays as it is.
  fs::create_directories(model + ".tmp/keep");
  std::ofstream(model + ".tmp/keep/data") << "precious";
  ::testing::internal::CaptureStderr();
  const Status exported = export_safetensors(dir / "a", model, false);
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(exported.ok()) << exported.to_string();
  EXPECT_NE(log.find("its metadata 'format', 'hpshard_mp' not exported"), std::string::npos) << log;
  EXPECT_TRUE(fs::exists(model + ".tmp/keep/data"));
  for (const auto& entry : fs::directory_iterator(dir.path())) {
    EXPECT_EQ(entry.path().filename().string().find("model.safetensors.tmp-"), std::string::npos)
        << "a temporary file was left: " << entry.path();
  }
  {  // Never into the checkpoint it reads (the rename would replace one of its files).
    auto refused = export_safetensors(dir / "a", dir / "a/rank-00000.bin", false);
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.message().find("lies in the checkpoint"), std::string::npos)
        << refused.message();
    EXPECT_TRUE(verify_checkpoint(dir / "a").ok());
    // Nor into another checkpoint (it replaced that one's data file, which then failed to load).
    fs::copy(dir / "a", dir / "other", fs::copy_options::recursive);
    for (const char* file : {"rank-00000.bin", "manifest.json", "new.safetensors"}) {
      auto into_other = export_safetensors(dir / "a", dir / (std::string("other/") + file), false);
      ASSERT_FALSE(into_other.ok()) << file;
      EXPECT_NE(into_other.message().find("lies in the checkpoint"), std::string::npos)
          << into_other.message();
    }
    EXPECT_TRUE(verify_checkpoint(dir / "other").ok());
    fs::remove_all(dir / "other");
  }
  {  // A path that is not a regular file is refused, untouched (the rename replaced a FIFO
     // or a device node with the file: as root, `export ... /dev/full` replaced the device).
    const std::string fifo = dir / "fifo";
    ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
    fs::create_directories(dir / "outdir");
    for (const std::string& bad : std::vector<std::string>{fifo, dir / "outdir"}) {
      auto refused = export_safetensors(dir / "a", bad, false);
      ASSERT_FALSE(refused.ok()) << bad;
      EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
      EXPECT_NE(refused.message().find("not a regular file"), std::string::npos)
          << refused.message();
    }
    EXPECT_TRUE(fs::is_fifo(fifo));
    EXPECT_TRUE(fs::is_directory(dir / "outdir"));
    // An empty path, or one ending in '/', is refused before anything is written (the export
    // was written whole into the working directory, then the rename failed: NOT_FOUND).
    for (const std::string& bad : std::vector<std::string>{"", dir / "nothing/"}) {
      const uint64_t before = process_io("wchar");
      auto refused = export_safetensors(dir / "a", bad, false);
      EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused.to_string();
      EXPECT_LT(process_io("wchar") - before, uint64_t{4096}) << "'" << bad << "'";
    }
    EXPECT_FALSE(fs::exists(dir / "nothing"));
    // A symbolic link is followed: the file it points to is replaced, the link stays.
    const std::string file = dir / "outdir/model.st", link = dir / "link.st";
    std::ofstream(file) << "old";
    fs::create_symlink(file, link);
    ASSERT_TRUE(export_safetensors(dir / "a", link, false).ok());
    EXPECT_TRUE(fs::is_symlink(link));
    EXPECT_EQ(fs::file_size(file), fs::file_size(model));
    // One pointing at nothing is refused.
    fs::create_symlink(dir / "nowhere/x.st", dir / "dangling.st");
    auto dangling = export_safetensors(dir / "a", dir / "dangling.st", false);
    ASSERT_FALSE(dangling.ok());
    EXPECT_NE(dangling.message().find("symbolic link to nothing"), std::string::npos)
        << dangling.message();
    EXPECT_TRUE(fs::is_symlink(dir / "dangling.st"));
    for (const auto& e : fs::directory_iterator(dir.path())) {
      EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << e.path();
    }
  }
  {  // Nor over the root's pointer to its latest checkpoint.
    auto refused = export_safetensors(dir / "a", dir / "latest", false);
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.message().find("pointer to the latest"), std::string::npos)
        << refused.message();
    EXPECT_EQ(*latest_checkpoint(dir.path()), "a");
    // With the pointer gone (removed by hand) the folder is still a root; so is another
    // folder holding a checkpoint and no pointer.
    fs::rename(dir / "latest", dir / "latest.aside");
    auto gone = export_safetensors(dir / "a", dir / "latest", false);
    EXPECT_NE(gone.message().find("pointer to the latest"), std::string::npos) << gone.message();
    EXPECT_FALSE(fs::exists(dir / "latest"));
    fs::rename(dir / "latest.aside", dir / "latest");
    TempDir other;
    fs::copy(dir / "a", other / "b", fs::copy_options::recursive);
    auto elsewhere = export_safetensors(dir / "a", other / "latest", false);
    EXPECT_NE(elsewhere.message().find("pointer to the latest"), std::string::npos)
        << elsewhere.message();
    EXPECT_FALSE(fs::exists(other / "latest"));
  }
  {  // The file as any safetensors reader sees it.
    std::ifstream in(model, std::ios::binary);
    uint64_t n = 0;
    in.read(reinterpret_cast<char*>(&n), 8);
    std::string header(n, '\0');
    in.read(header.data(), static_cast<std::streamsize>(n));
    auto j = nlohmann::json::parse(header);
    EXPECT_EQ(j["__metadata__"]["epoch"], "1");
    EXPECT_EQ(j["__metadata__"]["format"], "pt");
    EXPECT_FALSE(j["__metadata__"].contains("hpshard_mp"));
    for (size_t p = 0; p < kModel.size(); ++p) {
      const auto& e = j[kModel[p].name];
      EXPECT_EQ(e["dtype"], "F32");
      EXPECT_EQ(e["shape"].get<std::vector<int64_t>>(), kModel[p].shape);
      const uint64_t begin = e["data_offsets"][0];
      std::vector<float> values(saved[p].size());
      in.seekg(static_cast<std::streamoff>(8 + n + begin));
      in.read(reinterpret_cast<char*>(values.data()),
              static_cast<std::streamsize>(values.size() * 4));
      EXPECT_EQ(values, saved[p]) << kModel[p].name;
    }
    EXPECT_EQ(j.size(), kModel.size() + 1);  // no optimizer state, no step scalars
  }
  // Into other topologies and dtypes: the parameters (fp32 masters) are the exported ones.
  for (const Layout& layout : {Layout{3, 4, 1}, Layout{2, 2, 1, DType::kBFloat16}}) {
    run(layout, options, dir.path(), [&](Rank& r) {
      auto report = r.checkpointer->import_safetensors(model);
      ASSERT_TRUE(report.ok()) << report.status().to_string();
      EXPECT_EQ(report->metadata.at("epoch"), "1");
      auto full = r.engine->gather_all();
      for (size_t p = 0; p < saved.size(); ++p) {
        if (layout.dtype == DType::kFloat32 || kModel[p].trainable) {
          EXPECT_EQ((*full)[p], saved[p]) << kModel[p].name;
        }
      }
      r.train_step(2);
    });
  }
  // A model file with a tensor the engine lacks is refused unless partial.
  std::vector<TestParam> smaller(kModel.begin(), kModel.end() - 1);
  run(
      {2, 2, 1}, options, dir.path(),
      [&](Rank& r) {
        auto refused = r.checkpointer->import_safetensors(model);
        ASSERT_FALSE(refused.ok());
        EXPECT_NE(refused.status().message().find("layer2.scale"), std::string::npos);
        EXPECT_TRUE(r.checkpointer->import_safetensors(model, {.allow_partial = true}).ok());
      },
      small_chunks(), smaller);
}

// The ranks of one host that import one path while it is replaced (an export over it) read
// two files with one header. They used to load one file's shards on one rank and the other's
// on the next, silently; now every rank refuses, naming two ranks, and no engine changes.
// The ranks of one host must read one file: links to it are that file, a copy is not.
TEST(Checkpoint, RanksOfOneHostImportingDifferentFilesChangeNothing) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  TempDir dir;
  const EngineOptions options = adamw_options();
  run({2, 2, 1}, options, dir.path(), [&](Rank& r) {
    r.train_step(0);
    ASSERT_TRUE((*r.checkpointer->save("a"))->wait().ok());
  });
  const std::string first = dir / "first.safetensors";
  const std::string second = dir / "second.safetensors";
  ASSERT_TRUE(export_safetensors(dir / "a", first, false).ok());
  {  // The same header, other values: every float of the data doubled.
    std::ifstream in(first, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    uint64_t n = 0;
    std::memcpy(&n, bytes.data(), 8);
    for (size_t at = 8 + n; at + 4 <= bytes.size(); at += 4) {
      float v = 0;
      std::memcpy(&v, bytes.data() + at, 4);
      v = 2 * v + 1;
      std::memcpy(bytes.data() + at, &v, 4);
    }
    std::ofstream(second, std::ios::binary) << bytes;
  }
  fs::create_symlink(first, dir / "link.safetensors");
  run({2, 2, 1}, options, dir.path(), [&](Rank& r) {
    r.train_step(0);
    const auto before = r.engine->gather_all();
    ASSERT_TRUE(before.ok());
    auto refused = r.checkpointer->import_safetensors(r.rank == 0 ? first : second);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument)
        << refused.status().to_string();
    EXPECT_NE(refused.status().message().find("ranks 0 and 1 of one host"), std::string::npos)
        << refused.status().message();
    EXPECT_EQ(*r.engine->gather_all(), *before);
    // A link to the file is the file.
    auto linked =
        r.checkpointer->import_safetensors(r.rank == 0 ? first : dir / "link.safetensors");
    EXPECT_TRUE(linked.ok()) << linked.status().to_string();
    r.train_step(1);
  });
}

}  // namespace
}  // namespace hps::ckpt_test
