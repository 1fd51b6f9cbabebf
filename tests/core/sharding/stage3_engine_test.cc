// Stage 3's own promises, driven as a framework would (gather/release around each unit's
// forward and backward): prefetch, the pool, the resident-memory bound (shards + the live
// window), views only of gathered units (and the checked mode), bad input. The values both
// stages train to are checked against the float64 model in engine_harness_test.cc.
#include "core/sharding/stage3_engine.h"

#include <gtest/gtest.h>

#include <cmath>
#include <csignal>

#include "core/common/config.h"
#include "core/device/host_sync.h"
#include "core/topology/hybrid_group.h"
#include "tests/core/comm/comm_test_util.h"

namespace hps {
namespace {

struct TestParam {
  const char* name;
  std::vector<int64_t> shape;
  int32_t unit;
};
const std::vector<TestParam> kModel = {
    {"l0.w", {64, 33}, 0}, {"l0.b", {33}, 0}, {"l1.w", {33, 40}, 1}, {"l1.b", {40}, 1},
    {"l2.w", {40, 17}, 2}, {"l2.b", {17}, 2}, {"l3.w", {17, 9}, 3},  {"l3.b", {9}, 3},
};
constexpr int32_t kUnits = 4;

size_t numel(const TestParam& p) {
  size_t n = 1;
  for (int64_t d : p.shape) n *= static_cast<size_t>(d);
  return n;
}
float initial(size_t p, size_t i) { return std::cos(static_cast<float>(p * 17 + i) * 0.1f); }
// The gradient depends on the parameters the rank sees, so stale gathers would show.
float gradient(int32_t rank, int step, int micro, size_t p, size_t i, float param) {
  return 0.3f * param +
         std::sin(0.1f * static_cast<float>((i + 1) * (p + 1)) + 0.7f * static_cast<float>(rank) +
                  0.3f * static_cast<float>(step) + 0.11f * static_cast<float>(micro));
}

struct TrainingSetup {
  int32_t sharding = 2;
  int32_t dp = 1;
  EngineOptions options;
  int steps = 3;
};

// Trains as a framework would and checks what stage 3 promises beyond the values (which
// the engine harness checks): prefetch in the recorded order, buffers reused from the pool,
// no host sync in a step, and the resident memory bound.
void train_and_check_memory(const TrainingSetup& s) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  const int32_t world = s.sharding * s.dp;
  auto topology = *Topology::create({s.dp, 1, s.sharding, 1, 1}, world);
  testing_util::run_ranks(world, [&](int32_t rank, Communicator& comm) {
    std::shared_ptr<Communicator> w(&comm, [](Communicator*) {});
    auto hg_or = HybridGroup::create(w, topology);
    ASSERT_TRUE(hg_or.ok()) << hg_or.status().to_string();
    auto hg = std::move(hg_or).value();
    auto engine = Stage3Engine::create(hg->group(GroupKind::kSharding),
                                       s.dp > 1 ? hg->group(GroupKind::kDp) : nullptr, s.options);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    auto& e = **engine;
    for (const auto& p : kModel) {
      ParamSpec spec{p.name, p.shape, DType::kFloat32};
      spec.unit = p.unit;
      ASSERT_TRUE(e.add_param(spec).ok());
    }
    ASSERT_TRUE(e.seal().ok());
    for (size_t p = 0; p < kModel.size(); ++p) {
      float* v = *e.param(p);
      for (size_t i = 0; i < numel(kModel[p]); ++i) v[i] = rank == 0 ? initial(p, i) : -5.0f;
    }
    ASSERT_TRUE(e.broadcast_parameters().ok());
    EXPECT_EQ(e.gather_all().status().code(), StatusCode::kOk);
    uint64_t fresh_before = 0, taken_before = 0;
    for (int step = 0; step < s.steps; ++step) {
      if (step == 2) {
        fresh_before = e.fresh_full_buffers();
        taken_before = e.full_buffers_taken();
      }
      host_sync_reset();
      for (int m = 0; m < s.options.accumulation_steps; ++m) {
        for (int32_t u = 0; u < kUnits; ++u) {  // forward
          ASSERT_TRUE(e.gather(u).ok());
          ASSERT_TRUE(e.release(u).ok());
        }
        for (int32_t u = kUnits; u-- > 0;) {  // backward
          ASSERT_TRUE(e.gather(u).ok());
          for (size_t p = 0; p < kModel.size(); ++p) {
            if (kModel[p].unit != u) continue;
            const float* v = *e.param(p);
            float* g = *e.grad(p);
            for (size_t i = 0; i < numel(kModel[p]); ++i)
              g[i] += gradient(rank, step, m, p, i, v[i]);
            ASSERT_TRUE(e.grad_ready(p, nullptr).ok());
          }
          ASSERT_TRUE(e.release(u).ok());
        }
      }
      const uint64_t prefetched_before = e.prefetched_gathers();
      ASSERT_TRUE(e.step().ok());
      EXPECT_EQ(host_sync_count_thread(), 0u) << "step " << step << " blocked the host";
      if (kUnits > 1) {
        // The next step's first units start gathering at step(), after their updates.
        EXPECT_GT(e.prefetched_gathers(), prefetched_before) << "step " << step;
      }
    }
    if (s.steps > 1 && kUnits > 1) {
      // From the second step on, gathers ahead of use start in the recorded order, and the
      // framework's gather() finds its unit already in flight.
      EXPECT_GT(e.prefetched_gathers(), 0u);
      EXPECT_GT(e.gathers_found_in_flight(), 0u);
      // The last unit of the forward is gathered again at once for its backward: its
      // release keeps it live instead of gathering the same values twice.
      EXPECT_GE(e.releases_kept_live(), static_cast<uint64_t>(s.steps - 1));
    }
    if (s.steps > 2) {
      // Steady steps reuse full buffers freed before (no allocation, no page faults) as far
      // as the memory budget lets the pool keep this model's four unit sizes: most of them
      // here (without the pool every one would be fresh).
      const uint64_t taken = e.full_buffers_taken() - taken_before;
      const uint64_t fresh = e.fresh_full_buffers() - fresh_before;
      EXPECT_GT(taken, 0u);
      EXPECT_LE(2 * fresh, taken) << fresh << " of " << taken << " full buffers fresh";
    }
    ASSERT_TRUE(e.gather_all().ok());
    // Memory: the shards (params, grads, optimizer state) plus at most the live window of
    // full units (parameters and gradients).
    uint64_t total = 0, largest_unit = 0;
    std::map<int32_t, uint64_t> unit_bytes;
    const int states =
        s.options.optimizer == OptimizerKind::kAdamW ? 2 : (s.options.sgd.momentum != 0 ? 1 : 0);
    for (const auto& b : e.plan().buffers()) {
      total += b.numel * sizeof(float) * static_cast<uint64_t>(2 + states);
      unit_bytes[b.unit] += b.numel * sizeof(float) * 2;  // full params + full grads
    }
    for (const auto& [u, bytes] : unit_bytes) largest_unit = std::max(largest_unit, bytes);
    const double bound =
        1.05 * static_cast<double>(total) / s.sharding +
        static_cast<double>(s.options.prefetch_window * largest_unit) +
        (s.options.accumulation_steps > 1 ? static_cast<double>(total) / s.sharding : 0);
    EXPECT_LE(static_cast<double>(e.peak_resident_bytes()), bound)
        << "peak " << e.peak_resident_bytes() << " total/ranks " << total / s.sharding;
  });
}

class Stage3Test : public ::testing::TestWithParam<int32_t> {};

TEST_P(Stage3Test, SgdPrefetchesReusesAndStaysWithinMemory) {
  TrainingSetup s;
  s.sharding = GetParam();
  s.options.sgd = {0.1f, 0.9f, 0.01f, false};
  train_and_check_memory(s);
}

TEST_P(Stage3Test, AdamWPrefetchesReusesAndStaysWithinMemory) {
  TrainingSetup s;
  s.sharding = GetParam();
  s.options.optimizer = OptimizerKind::kAdamW;
  s.options.adamw = {1e-2f, 0.9f, 0.99f, 1e-8f, 0.05f};
  train_and_check_memory(s);
}

INSTANTIATE_TEST_SUITE_P(Sharding, Stage3Test, ::testing::Values(1, 2, 3, 4),
                         [](const auto& p) { return "sharding" + std::to_string(p.param); });

TEST(Stage3, DpAboveShardingAndAccumulationWithinMemory) {
  TrainingSetup s;
  s.sharding = 2;
  s.dp = 2;
  s.options.accumulation_steps = 2;
  s.options.sgd = {0.05f, 0.5f, 0.0f, true};
  train_and_check_memory(s);
}

// Trains `steps` steps at sharding 2 x dp 2 with every parameter in `units` units; with
// `eval_first`, a forward-only pass (gather and release of every unit) comes before the
// first step, so the order recorded then differs from the later steps'. Rank 0's parameters.
// `hold_first`: unit 0 is never released inside a step (a forward whose backward never came),
// so it is in use across every step.
std::vector<std::vector<float>> train_with_pattern(int32_t units, bool eval_first, int steps,
                                                   bool hold_first = false) {
  std::vector<std::vector<float>> result;
  if (!HPS_HAVE_GLOO) return result;
  auto topology = *Topology::create({2, 1, 2, 1, 1}, 4);
  testing_util::run_ranks(4, [&](int32_t rank, Communicator& comm) {
    std::shared_ptr<Communicator> w(&comm, [](Communicator*) {});
    auto hg = std::move(HybridGroup::create(w, topology)).value();
    EngineOptions options;
    options.sgd = {0.05f, 0.5f, 0.0f, false};
    auto engine =
        Stage3Engine::create(hg->group(GroupKind::kSharding), hg->group(GroupKind::kDp), options);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    auto& e = **engine;
    for (const auto& p : kModel) {
      ParamSpec spec{p.name, p.shape, DType::kFloat32};
      spec.unit = p.unit % units;
      ASSERT_TRUE(e.add_param(spec).ok());
    }
    ASSERT_TRUE(e.seal().ok());
    for (size_t p = 0; p < kModel.size(); ++p) {
      float* v = *e.param(p);
      for (size_t i = 0; i < numel(kModel[p]); ++i) v[i] = initial(p, i);
    }
    ASSERT_TRUE(e.broadcast_parameters().ok());
    if (eval_first) {
      for (int32_t u = 0; u < units; ++u) ASSERT_TRUE(e.gather(u).ok());
      for (int32_t u = units; u-- > 0;) ASSERT_TRUE(e.release(u).ok());
    }
    for (int step = 0; step < steps; ++step) {
      for (int32_t u = 0; u < units; ++u) ASSERT_TRUE(e.gather(u).ok());
      for (size_t p = kModel.size(); p-- > 0;) {
        const float* v = *e.param(p);
        float* g = *e.grad(p);
        for (size_t i = 0; i < numel(kModel[p]); ++i) g[i] += gradient(rank, step, 0, p, i, v[i]);
        ASSERT_TRUE(e.grad_ready(p, nullptr).ok());
      }
      for (int32_t u = units; u-- > (hold_first ? 1 : 0);) ASSERT_TRUE(e.release(u).ok());
      ASSERT_TRUE(e.step().ok());
    }
    if (hold_first) {
      EXPECT_EQ(e.regathered_in_use(), static_cast<uint64_t>(steps));
      ASSERT_TRUE(e.release(0).ok());
    }
    auto all = e.gather_all();
    ASSERT_TRUE(all.ok());
    if (rank == 0) result = *all;
  });
  return result;
}

// A step whose gather pattern differs from the first step's (here: the first step had an
// extra forward-only pass) once kept a unit's full parameters live across step(), because
// the recorded order said it is gathered next: the next step then trained on parameters
// from before the update. Whatever the pattern, training is the same.
TEST(Stage3, APatternUnlikeTheFirstStepsStillTrainsOnUpdatedParameters) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  for (int32_t units : {1, 2}) {
    const auto plain = train_with_pattern(units, false, 4);
    for (int run = 0; run < 3; ++run) {
      EXPECT_EQ(train_with_pattern(units, true, 4), plain) << units << " units, run " << run;
    }
  }
}

// A unit in use across the step (gathered, not released) kept the parameters from before
// the update, and the next gather of it returned them: it is gathered again after the step.
TEST(Stage3, AUnitInUseAcrossTheStepIsGatheredAgainAfterTheUpdate) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  for (int32_t units : {1, 2}) {
    EXPECT_EQ(train_with_pattern(units, false, 4, true), train_with_pattern(units, false, 4))
        << units << " units";
  }
}

// A step whose order differs from the recorded one gathers a unit the prefetch did not
// expect: the units prefetched (or kept live) for the old order are dropped rather than held
// on top of it, so at most prefetch_window units are ever live (it was window + 1 at the
// first gather of the changed step, and up to every unit after it).
TEST(Stage3, AChangedOrderKeepsAtMostTheWindowLive) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  for (int32_t window : {1, 2, 3}) {
    SCOPED_TRACE("prefetch_window " + std::to_string(window));
    testing_util::run_ranks(2, [&](int32_t, Communicator& comm) {
      std::shared_ptr<Communicator> w(&comm, [](Communicator*) {});
      EngineOptions options;
      options.prefetch_window = window;
      auto e = std::move(Stage3Engine::create(w, nullptr, options)).value();
      for (int32_t u = 0; u < kUnits; ++u) {
        ParamSpec p{"p" + std::to_string(u), {static_cast<int64_t>(128) << u}, DType::kFloat32};
        p.unit = u;
        ASSERT_TRUE(e->add_param(p).ok());
      }
      ASSERT_TRUE(e->seal().ok());
      ASSERT_TRUE(e->broadcast_parameters().ok());
      auto pass = [&](const std::vector<int32_t>& forward) {
        for (int32_t u : forward) {
          ASSERT_TRUE(e->gather(u).ok());
          EXPECT_LE(e->live_units(), window) << "forward at unit " << u;
          ASSERT_TRUE(e->release(u).ok());
        }
        for (auto it = forward.rbegin(); it != forward.rend(); ++it) {
          ASSERT_TRUE(e->gather(*it).ok());
          EXPECT_LE(e->live_units(), window) << "backward at unit " << *it;
          float* g = *e->grad(static_cast<size_t>(*it));
          g[0] = 1.0f;
          ASSERT_TRUE(e->grad_ready(static_cast<size_t>(*it), nullptr).ok());
          ASSERT_TRUE(e->release(*it).ok());
        }
        ASSERT_TRUE(e->step().ok());
        EXPECT_LE(e->live_units(), window) << "after step";
      };
      pass({0, 1, 2, 3});
      pass({0, 1, 2, 3});
      pass({3, 2, 1, 0});  // the order changed
      pass({0, 1, 2, 3});
      ASSERT_TRUE(e->synchronize().ok());
      EXPECT_LE(e->peak_live_units(), window);
      EXPECT_GT(e->units_dropped(), 0u);
    });
  }
}

TEST(Stage3, BadInputIsRefused) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  testing_util::run_ranks(2, [](int32_t, Communicator& comm) {
    std::shared_ptr<Communicator> w(&comm, [](Communicator*) {});
    auto e = std::move(Stage3Engine::create(w, nullptr, {})).value();
    ASSERT_TRUE(e->add_param({"w", {4}, DType::kFloat32}).ok());
    ASSERT_TRUE(e->seal().ok());
    EXPECT_EQ(e->gather(0).code(), StatusCode::kFailedPrecondition) << "before broadcast";
    ASSERT_TRUE(e->broadcast_parameters().ok());
    EXPECT_EQ(e->gather(5).code(), StatusCode::kNotFound) << "unknown unit";
    EXPECT_EQ(e->param(0).status().code(), StatusCode::kFailedPrecondition) << "not gathered";
    EXPECT_EQ(e->step().code(), StatusCode::kFailedPrecondition) << "step before backward";
    ASSERT_TRUE(e->gather(0).ok());
    float* g = *e->grad(0);
    g[0] = 1;
    EXPECT_EQ(e->release(0).code(), StatusCode::kFailedPrecondition) << "gradients pending";
    ASSERT_TRUE(e->grad_ready(0, nullptr).ok());
    EXPECT_EQ(e->grad_ready(0, nullptr).code(), StatusCode::kFailedPrecondition)
        << "checked in twice";
    ASSERT_TRUE(e->release(0).ok());
    ASSERT_TRUE(e->step().ok());
    ASSERT_TRUE(e->synchronize().ok());
  });
}

// Two units of one 64-float parameter each ("a" in unit 0, "b" in unit 1), sealed and
// broadcast; null (and a failure) when a step of that fails.
std::unique_ptr<Stage3Engine> two_equal_units(Communicator& comm) {
  std::shared_ptr<Communicator> w(&comm, [](Communicator*) {});
  auto e = std::move(Stage3Engine::create(w, nullptr, {})).value();
  ParamSpec a{"a", {64}, DType::kFloat32};
  ParamSpec b{"b", {64}, DType::kFloat32};
  b.unit = 1;
  const Status s = [&]() -> Status {
    HPS_RETURN_IF_ERROR(e->add_param(a).status());
    HPS_RETURN_IF_ERROR(e->add_param(b).status());
    HPS_RETURN_IF_ERROR(e->seal());
    return e->broadcast_parameters();
  }();
  if (!s.ok()) {
    ADD_FAILURE() << s.to_string();
    return nullptr;
  }
  return e;
}

// Ranks that wait for two units of equal size in opposite orders pair one unit's
// all-gather with the other's: the collectives carry their bucket, so every rank's wait
// is refused naming both, instead of handing rank 1 unit 0's values as unit 1's.
TEST(Stage3, RanksWaitingForUnitsInDifferentOrdersAreRefused) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  testing_util::run_ranks(2, [](int32_t rank, Communicator& comm) {
    auto e = two_equal_units(comm);
    ASSERT_TRUE(e);
    const int32_t first = rank == 0 ? 0 : 1;
    const Status s = e->gather(first);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
    EXPECT_NE(s.message().find("tag 1"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("tag 2"), std::string::npos) << s.message();
    (void)e->synchronize();
  });
}

// Both ranks wait for the units in one order, but rank 1 checks unit 1's gradient in
// after its wait for unit 0 (rank 0 before it): its reduce-scatter falls on the other side
// of unit 0's all-gather. Refused (the calls' tags differ), never paired.
TEST(Stage3, ACheckInOnTheOtherSideOfAWaitIsRefused) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  testing_util::run_ranks(2, [](int32_t rank, Communicator& comm) {
    auto e = two_equal_units(comm);
    ASSERT_TRUE(e);
    Status s = [&]() -> Status {
      for (int32_t u : {0, 1}) {
        HPS_RETURN_IF_ERROR(e->gather(u));
        HPS_RETURN_IF_ERROR(e->release(u));
      }
      HPS_RETURN_IF_ERROR(e->gather(1));
      HPS_RETURN_IF_ERROR(e->grad(1).status());
      if (rank == 0) HPS_RETURN_IF_ERROR(e->grad_ready(1, nullptr));
      HPS_RETURN_IF_ERROR(e->gather(0));
      if (rank == 1) HPS_RETURN_IF_ERROR(e->grad_ready(1, nullptr));
      HPS_RETURN_IF_ERROR(e->grad(0).status());
      HPS_RETURN_IF_ERROR(e->grad_ready(0, nullptr));
      HPS_RETURN_IF_ERROR(e->release(1));
      HPS_RETURN_IF_ERROR(e->release(0));
      HPS_RETURN_IF_ERROR(e->step());
      return e->synchronize();
    }();
    EXPECT_FALSE(s.ok()) << "rank " << rank;
    EXPECT_NE(s.message().find("ranks disagree on the call"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("tag 2"), std::string::npos) << s.message();
    (void)e->synchronize();
  });
}

// Issue 10, item 4: a view kept past release(u) must never reach the full buffer handed to
// another unit. In the checked mode (HPS_DEBUG_VIEWS=1) the write faults at once.
TEST(Stage3DeathTest, AStaleViewFaultsInTheCheckedMode) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto write_through_stale_view = [] {
    ::setenv("HPS_DEBUG_VIEWS", "1", 1);
    testing_util::run_ranks(1, [](int32_t, Communicator& comm) {
      std::shared_ptr<Communicator> w(&comm, [](Communicator*) {});
      auto e = std::move(Stage3Engine::create(w, nullptr, {})).value();
      ParamSpec a{"a", {4096}, DType::kFloat32};
      ParamSpec b{"b", {4096}, DType::kFloat32};
      b.unit = 1;
      if (!e->add_param(a).ok() || !e->add_param(b).ok() || !e->seal().ok() ||
          !e->broadcast_parameters().ok() || !e->gather(0).ok()) {
        std::abort();
      }
      volatile float* stale = *e->param(0);
      if (!e->release(0).ok() || !e->gather(1).ok()) std::abort();
      float* other = *e->param(1);
      if (other == stale) std::abort();
      stale[7] = 42.0f;  // must fault
      std::exit(0);
    });
    std::exit(0);
  };
  // A segmentation fault (AddressSanitizer builds report it and exit 1); not an abort.
  EXPECT_EXIT(write_through_stale_view(), testing_util::faulted_on_access, "");
}

// Without the checked mode the pool reuses buffers (no allocation in steady steps), and a
// released unit's view is refused from then on.
TEST(Stage3, AReleasedUnitsViewIsRefused) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  testing_util::run_ranks(1, [](int32_t, Communicator& comm) {
    std::shared_ptr<Communicator> w(&comm, [](Communicator*) {});
    auto e = std::move(Stage3Engine::create(w, nullptr, {})).value();
    ASSERT_TRUE(e->add_param({"a", {64}, DType::kFloat32}).ok());
    ASSERT_TRUE(e->seal().ok());
    ASSERT_TRUE(e->broadcast_parameters().ok());
    ASSERT_TRUE(e->gather(0).ok());
    EXPECT_TRUE(e->param(0).ok());
    ASSERT_TRUE(e->release(0).ok());
    EXPECT_EQ(e->param(0).status().code(), StatusCode::kFailedPrecondition);
  });
}

}  // namespace
}  // namespace hps
