// Stage 2 against unsharded training computed in the test: the same model, the same
// per-rank gradients, step for step — at 1..4 sharding ranks and dp2 × sharding2, with
// SGD and AdamW, gradient accumulation and clipping; zero host syncs per steady step.
#include "core/sharding/stage2_engine.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

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
  bool trainable;
};
const std::vector<TestParam> kModel = {
    {"layer0.weight", {7, 13}, 0, true}, {"layer0.bias", {13}, 0, true},
    {"layer1.weight", {13, 5}, 1, true}, {"layer1.bias", {5}, 1, true},
    {"embedding", {3, 4}, 1, false},     {"layer2.weight", {301}, 2, true},
};

size_t numel(const TestParam& p) {
  size_t n = 1;
  for (int64_t d : p.shape) n *= static_cast<size_t>(d);
  return n;
}

float initial(size_t p, size_t i) { return std::cos(static_cast<float>(p * 17 + i) * 0.1f); }
float gradient(int32_t rank, int step, int micro, size_t p, size_t i) {
  return std::sin(0.1f * static_cast<float>((i + 1) * (p + 1)) + 0.7f * static_cast<float>(rank) +
                  0.3f * static_cast<float>(step) + 0.11f * static_cast<float>(micro));
}

struct TrainingSetup {
  int32_t sharding = 1;
  int32_t dp = 1;
  EngineOptions options;
  int steps = 3;
};

// The unsharded reference: full parameters, the mean gradient over every rank and
// micro-batch, the same optimizer and clip.
std::vector<std::vector<float>> reference(const TrainingSetup& s) {
  const int32_t world = s.sharding * s.dp;
  const int micro = s.options.accumulation_steps;
  std::vector<std::vector<float>> params(kModel.size()), a(kModel.size()), b(kModel.size());
  for (size_t p = 0; p < kModel.size(); ++p) {
    for (size_t i = 0; i < numel(kModel[p]); ++i) params[p].push_back(initial(p, i));
    a[p].assign(numel(kModel[p]), 0.0f);
    b[p].assign(numel(kModel[p]), 0.0f);
  }
  for (int step = 0; step < s.steps; ++step) {
    std::vector<std::vector<float>> g(kModel.size());
    double squares = 0;
    for (size_t p = 0; p < kModel.size(); ++p) {
      if (!kModel[p].trainable) continue;
      for (size_t i = 0; i < numel(kModel[p]); ++i) {
        double sum = 0;
        for (int32_t r = 0; r < world; ++r) {
          for (int m = 0; m < micro; ++m) sum += gradient(r, step, m, p, i);
        }
        g[p].push_back(static_cast<float>(sum / (world * micro)));
        squares += static_cast<double>(g[p].back()) * g[p].back();
      }
    }
    float coef = 1.0f;
    if (s.options.clip_max_norm > 0) {
      const double norm = std::sqrt(squares), max = s.options.clip_max_norm;
      coef = static_cast<float>(max / (std::max(norm, max) + 1e-6));
    }
    for (size_t p = 0; p < kModel.size(); ++p) {
      if (!kModel[p].trainable) continue;
      if (s.options.optimizer == OptimizerKind::kAdamW) {
        cpu::adamw(params[p].data(), g[p].data(), a[p].data(), b[p].data(), g[p].size(),
                   s.options.adamw, step + 1, &coef, 1.0f);
      } else {
        cpu::sgd(params[p].data(), g[p].data(), a[p].data(), g[p].size(), s.options.sgd, &coef,
                 1.0f, step == 0);
      }
    }
  }
  return params;
}

void train_and_compare(const TrainingSetup& s) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  const int32_t world = s.sharding * s.dp;
  const auto expected = reference(s);
  auto topology = *Topology::create({s.dp, 1, s.sharding, 1, 1}, world);
  testing_util::run_ranks(world, [&](int32_t rank, Communicator& comm) {
    std::shared_ptr<Communicator> w(&comm, [](Communicator*) {});
    auto hg_or = HybridGroup::create(w, topology);
    ASSERT_TRUE(hg_or.ok()) << hg_or.status().to_string();
    auto hg = std::move(hg_or).value();
    auto engine = Stage2Engine::create(hg->group(GroupKind::kSharding),
                                       s.dp > 1 ? hg->group(GroupKind::kDp) : nullptr, s.options);
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    auto& e = **engine;
    for (const auto& p : kModel) {
      ParamSpec spec{p.name, p.shape, DType::kFloat32, p.trainable};
      spec.unit = p.unit;
      ASSERT_TRUE(e.add_param(spec).ok());
    }
    ASSERT_TRUE(e.seal().ok());
    // Only the source rank's initial values count: broadcast makes the others equal.
    for (size_t p = 0; p < kModel.size(); ++p) {
      float* v = *e.param(p);
      for (size_t i = 0; i < numel(kModel[p]); ++i) v[i] = rank == 0 ? initial(p, i) : 999.0f;
    }
    ASSERT_TRUE(e.broadcast_parameters().ok());
    const int32_t units = 3;
    for (int step = 0; step < s.steps; ++step) {
      host_sync_reset();
      for (int m = 0; m < s.options.accumulation_steps; ++m) {
        for (int32_t u = 0; u < units; ++u) ASSERT_TRUE(e.wait_parameters(u).ok());
        // "Backward", last layer first: add each gradient, then check it in.
        for (size_t p = kModel.size(); p-- > 0;) {
          if (!kModel[p].trainable) continue;
          float* g = *e.grad(p);
          for (size_t i = 0; i < numel(kModel[p]); ++i) g[i] += gradient(rank, step, m, p, i);
          ASSERT_TRUE(e.grad_ready(p).ok());
        }
      }
      ASSERT_TRUE(e.step().ok());
      EXPECT_EQ(host_sync_count_thread(), 0u) << "step " << step << " blocked the host";
    }
    ASSERT_TRUE(e.synchronize().ok());
    for (size_t p = 0; p < kModel.size(); ++p) {
      const float* v = *e.param(p);
      for (size_t i = 0; i < numel(kModel[p]); ++i) {
        ASSERT_NEAR(v[i], expected[p][i], 1e-6f * std::max(1.0f, std::fabs(expected[p][i])))
            << kModel[p].name << "[" << i << "] rank " << rank;
      }
    }
    // Resident bytes: full params and grads, a shard of grads and of optimizer state.
    EXPECT_GT(e.resident_bytes(), 0u);
  });
}

class Stage2Test : public ::testing::TestWithParam<int32_t> {};

TEST_P(Stage2Test, SgdMatchesUnshardedTraining) {
  TrainingSetup s;
  s.sharding = GetParam();
  s.options.sgd = {0.1f, 0.9f, 0.01f, false};
  train_and_compare(s);
}

TEST_P(Stage2Test, AdamWMatchesUnshardedTraining) {
  TrainingSetup s;
  s.sharding = GetParam();
  s.options.optimizer = OptimizerKind::kAdamW;
  s.options.adamw = {1e-2f, 0.9f, 0.99f, 1e-8f, 0.05f};
  train_and_compare(s);
}

INSTANTIATE_TEST_SUITE_P(Sharding, Stage2Test, ::testing::Values(1, 2, 3, 4),
                         [](const auto& p) { return "sharding" + std::to_string(p.param); });

TEST(Stage2, DpAboveSharding) {
  TrainingSetup s;
  s.sharding = 2;
  s.dp = 2;
  s.options.sgd = {0.05f, 0.5f, 0.0f, true};
  train_and_compare(s);
}

TEST(Stage2, AccumulationEqualsTheLargeBatch) {
  TrainingSetup s;
  s.sharding = 2;
  s.options.accumulation_steps = 3;
  s.options.sgd = {0.1f, 0.0f, 0.0f, false};
  train_and_compare(s);
}

TEST(Stage2, ClippingFoldedIntoAdamW) {
  TrainingSetup s;
  s.sharding = 3;
  s.options.optimizer = OptimizerKind::kAdamW;
  s.options.clip_max_norm = 0.5;
  train_and_compare(s);
}

TEST(Stage2, BadInputIsRefusedAndChangesNothing) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  testing_util::run_ranks(2, [](int32_t rank, Communicator& comm) {
    std::shared_ptr<Communicator> w(&comm, [](Communicator*) {});
    auto e = std::move(Stage2Engine::create(w, nullptr, {})).value();
    ASSERT_TRUE(e->add_param({"w", {4}, DType::kFloat32}).ok());
    EXPECT_EQ(e->add_param({"w", {4}, DType::kFloat32}).status().code(),
              StatusCode::kAlreadyExists);
    EXPECT_EQ(e->add_param({"h", {4}, DType::kFloat64}).status().code(),
              StatusCode::kUnimplemented);
    // Rank 1 registers a different shape: every rank's seal fails.
    ASSERT_TRUE(e->add_param({"b", {rank == 0 ? 3 : 4}, DType::kFloat32}).ok());
    Status s = e->seal();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
    EXPECT_NE(s.message().find("registered different parameters"), std::string::npos);
    EXPECT_EQ(e->step().code(), StatusCode::kFailedPrecondition);
    EXPECT_EQ(e->param(0).status().code(), StatusCode::kFailedPrecondition);
  });
  testing_util::run_ranks(2, [](int32_t, Communicator& comm) {
    std::shared_ptr<Communicator> w(&comm, [](Communicator*) {});
    auto e = std::move(Stage2Engine::create(w, nullptr, {})).value();
    ASSERT_TRUE(e->add_param({"w", {4}, DType::kFloat32}).ok());
    ASSERT_TRUE(e->seal().ok());
    EXPECT_EQ(e->add_param({"late", {4}, DType::kFloat32}).status().code(),
              StatusCode::kFailedPrecondition);
    EXPECT_EQ(e->step().code(), StatusCode::kFailedPrecondition) << "step before backward";
    EXPECT_EQ(e->wait_parameters(7).code(), StatusCode::kNotFound);
    EXPECT_EQ(e->grad_ready(9).code(), StatusCode::kOutOfRange);
    ASSERT_TRUE(e->grad_ready(0).ok());
    EXPECT_EQ(e->grad_ready(0).code(), StatusCode::kFailedPrecondition)
        << "a one-parameter bucket checked in twice";
    EXPECT_TRUE(e->step().ok());
    ASSERT_TRUE(e->grad_ready(0).ok());
    ASSERT_TRUE(e->step().ok());
    ASSERT_TRUE(e->synchronize().ok());
  });
  EXPECT_EQ(Stage2Engine::create(nullptr, nullptr, {}).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hps

namespace hps {
namespace {

// Dynamic loss scaling, stage 2 and 3: the framework scales its gradients by the current
// loss scale; a non-finite gradient on one rank makes every rank skip that step and halve
// the scale; growth_interval good steps double it. No host reads of the flag or scale.
template <typename MakeEngine>
void loss_scaling_case(int32_t stage, MakeEngine make_engine) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  const size_t n = 300;
  const int steps = 5, bad_step = 1;
  EngineOptions o;
  o.sgd = {0.1f, 0.9f, 0.0f, false};
  o.dynamic_loss_scaling = true;
  o.initial_loss_scale = 1024.0f;
  o.growth_interval = 2;
  auto grad = [](int32_t rank, int step, size_t i) {
    return std::sin(0.3f * static_cast<float>(i) + static_cast<float>(rank + 3 * step));
  };
  // Reference: steps other than the bad one, plain fp32, the mean over 2 ranks.
  std::vector<float> ref(n), buf(n, 0.0f);
  for (size_t i = 0; i < n; ++i) ref[i] = 0.01f * static_cast<float>(i);
  int applied = 0;
  for (int step = 0; step < steps; ++step) {
    if (step == bad_step) continue;
    std::vector<float> g(n);
    for (size_t i = 0; i < n; ++i) g[i] = (grad(0, step, i) + grad(1, step, i)) / 2;
    cpu::sgd(ref.data(), g.data(), buf.data(), n, o.sgd, nullptr, 1.0f, applied++ == 0);
  }
  testing_util::run_ranks(2, [&](int32_t rank, Communicator& comm) {
    std::shared_ptr<Communicator> w(&comm, [](Communicator*) {});
    auto e = make_engine(w, o);
    ParamSpec spec{"w", {static_cast<int64_t>(n)}, DType::kFloat32};
    ASSERT_TRUE(e->add_param(spec).ok());
    ASSERT_TRUE(e->seal().ok());
    float* init = *e->param(0);
    for (size_t i = 0; i < n; ++i) init[i] = 0.01f * static_cast<float>(i);
    ASSERT_TRUE(e->broadcast_parameters().ok());
    std::vector<float> scales;
    for (int step = 0; step < steps; ++step) {
      host_sync_reset();
      ASSERT_TRUE(e->gather(0).ok());
      const float scale = *e->loss_scale();  // the previous update has landed
      scales.push_back(scale);
      float* g = *e->grad(0);
      for (size_t i = 0; i < n; ++i) g[i] += grad(rank, step, i) * scale;
      if (step == bad_step && rank == 1) g[7] = INFINITY;
      ASSERT_TRUE(e->grad_ready(0, nullptr).ok());
      ASSERT_TRUE(e->release(0).ok());
      ASSERT_TRUE(e->step().ok());
      EXPECT_EQ(host_sync_count_thread(), 0u) << "stage " << stage;
    }
    ASSERT_TRUE(e->synchronize().ok());
    // 1024 → (good) → skip: 512 → good → good: 1024 (interval 2).
    EXPECT_EQ(scales, (std::vector<float>{1024, 1024, 512, 512, 1024})) << "stage " << stage;
    EXPECT_EQ(*e->skipped_steps(), 1);
    ASSERT_TRUE(e->gather(0).ok());
    const float* v = *e->param(0);
    for (size_t i = 0; i < n; ++i) {
      ASSERT_NEAR(v[i], ref[i], 1e-6f * std::max(1.0f, std::fabs(ref[i])))
          << "stage " << stage << " [" << i << "]";
    }
    ASSERT_TRUE(e->release(0).ok());
  });
}

TEST(LossScaling, SkipsANonFiniteStepOnEveryRankAndAdjustsTheScale) {
  loss_scaling_case(2, [](std::shared_ptr<Communicator> w, const EngineOptions& o) {
    return std::move(create_sharded_engine(2, w, nullptr, o)).value();
  });
  loss_scaling_case(3, [](std::shared_ptr<Communicator> w, const EngineOptions& o) {
    return std::move(create_sharded_engine(3, w, nullptr, o)).value();
  });
}

TEST(LossScaling, BadOptionsAreRefused) {
  EngineOptions o;
  o.dynamic_loss_scaling = true;
  o.backoff_factor = 1.5f;
  auto store = make_in_memory_store();
  EXPECT_EQ(check_engine_arguments(nullptr, nullptr, o).code(), StatusCode::kInvalidArgument);
  testing_util::run_ranks(1, [&](int32_t, Communicator& comm) {
    std::shared_ptr<Communicator> w(&comm, [](Communicator*) {});
    EXPECT_EQ(create_sharded_engine(2, w, nullptr, o).status().code(),
              StatusCode::kInvalidArgument);
    o.backoff_factor = 0.5f;
    o.initial_loss_scale = 0.0f;
    EXPECT_EQ(create_sharded_engine(3, w, nullptr, o).status().code(),
              StatusCode::kInvalidArgument);
  });
}

}  // namespace
}  // namespace hps

namespace hps {
namespace {

// fp16 / bf16 parameters: the framework's views and gradients in that dtype, fp32 master
// weights and optimizer state inside, reductions adding in fp32. Against an fp32 run on
// the dtype-rounded gradients, within the tolerance the README states: 2e-2 relative for
// bf16 and 4e-3 for fp16 (plus 1e-3 absolute), after 4 SGD steps.
void half_precision_case(int32_t stage, DType dtype, float relative) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  const size_t n = 777;
  const int steps = 4;
  const int32_t ranks = 3;
  SgdHyper sgd{0.05f, 0.9f, 0.0f, false};
  auto grad = [](int32_t rank, int step, size_t i) {
    return std::sin(0.37f * static_cast<float>(i) + 1.1f * static_cast<float>(rank + 2 * step));
  };
  auto rounded = [dtype](float v) {
    testing_util::Buffer b(dtype, 1);
    b.set(0, v);
    return static_cast<float>(b.at(0));
  };
  std::vector<float> master(n), momentum(n, 0.0f);
  for (size_t i = 0; i < n; ++i) master[i] = rounded(std::cos(0.01f * static_cast<float>(i)));
  for (int step = 0; step < steps; ++step) {
    std::vector<float> g(n);
    for (size_t i = 0; i < n; ++i) {
      float sum = 0;
      for (int32_t r = 0; r < ranks; ++r) sum += rounded(grad(r, step, i));
      g[i] = sum / ranks;
    }
    cpu::sgd(master.data(), g.data(), momentum.data(), n, sgd, nullptr, 1.0f, step == 0);
  }
  testing_util::run_ranks(ranks, [&](int32_t rank, Communicator& comm) {
    std::shared_ptr<Communicator> w(&comm, [](Communicator*) {});
    EngineOptions o;
    o.sgd = sgd;
    auto e = std::move(create_sharded_engine(stage, w, nullptr, o)).value();
    ASSERT_TRUE(e->add_param({"w", {static_cast<int64_t>(n)}, dtype}).ok());
    ASSERT_TRUE(e->seal().ok());
    EXPECT_EQ(e->param(0).status().code(), StatusCode::kFailedPrecondition) << "not float32";
    testing_util::Buffer init(dtype, n);
    for (size_t i = 0; i < n; ++i) init.set(i, std::cos(0.01f * static_cast<float>(i)));
    std::memcpy(*e->param_data(0), init.data(), n * dtype_size(dtype));
    ASSERT_TRUE(e->broadcast_parameters().ok());
    for (int step = 0; step < steps; ++step) {
      ASSERT_TRUE(e->gather(0).ok());
      void* g = *e->grad_data(0);
      testing_util::Buffer local(dtype, n);
      for (size_t i = 0; i < n; ++i) local.set(i, grad(rank, step, i));
      std::memcpy(g, local.data(), n * dtype_size(dtype));
      ASSERT_TRUE(e->grad_ready(0, nullptr).ok());
      ASSERT_TRUE(e->release(0).ok());
      ASSERT_TRUE(e->step().ok());
    }
    ASSERT_TRUE(e->gather(0).ok());
    testing_util::Buffer got(dtype, n);
    std::memcpy(got.data(), *e->param_data(0), n * dtype_size(dtype));
    for (size_t i = 0; i < n; ++i) {
      ASSERT_NEAR(got.at(i), master[i], relative * std::fabs(master[i]) + 1e-3)
          << dtype_name(dtype) << " [" << i << "] rank " << rank;
    }
  });
}

TEST(HalfPrecision, BFloat16WithFp32MastersStage2) {
  half_precision_case(2, DType::kBFloat16, 2e-2f);
}
TEST(HalfPrecision, Float16WithFp32MastersStage2) {
  half_precision_case(2, DType::kFloat16, 4e-3f);
}
TEST(HalfPrecision, BFloat16WithFp32MastersStage3) {
  half_precision_case(3, DType::kBFloat16, 2e-2f);
}
TEST(HalfPrecision, Float16WithFp32MastersStage3) {
  half_precision_case(3, DType::kFloat16, 4e-3f);
}

}  // namespace
}  // namespace hps
