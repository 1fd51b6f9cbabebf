// Stage 2's own protocol and both stages' checks of bad input and bad options; the values
// both stages train to are checked against the float64 model in engine_harness_test.cc.
#include "core/sharding/stage2_engine.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>

#include "core/common/config.h"
#include "core/sharding/engine_base.h"
#include "core/sharding/stage3_engine.h"
#include "core/topology/hybrid_group.h"
#include "tests/core/comm/comm_test_util.h"

namespace hps {
namespace {

// An engine of the stage with one parameter: its seal's outcome.
Status seal_one_parameter(bool stage3, std::shared_ptr<Communicator> w, const EngineOptions& o) {
  std::unique_ptr<ShardedEngine> e;
  if (stage3) {
    e = std::move(Stage3Engine::create(std::move(w), nullptr, o)).value();
  } else {
    e = std::move(Stage2Engine::create(std::move(w), nullptr, o)).value();
  }
  HPS_RETURN_IF_ERROR(e->add_param({"w", {40}, DType::kFloat32}).status());
  return e->seal();
}

// Ranks created with different engine options (each of these made the ranks update their
// shards differently or call different collectives) are refused at seal, on every rank.
TEST(Seal, RanksWithDifferentEngineOptionsAreRefused) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  using Change = std::function<void(EngineOptions&, bool&)>;
  const std::vector<std::pair<const char*, Change>> changes = {
      {"stage", [](EngineOptions&, bool& stage3) { stage3 = true; }},
      {"optimizer", [](EngineOptions& o, bool&) { o.optimizer = OptimizerKind::kAdamW; }},
      {"learning rate", [](EngineOptions& o, bool&) { o.sgd.learning_rate = 0.5f; }},
      {"clip", [](EngineOptions& o, bool&) { o.clip_max_norm = 1.0; }},
      {"accumulation", [](EngineOptions& o, bool&) { o.accumulation_steps = 2; }},
      {"loss scaling", [](EngineOptions& o, bool&) { o.dynamic_loss_scaling = true; }},
      {"buckets", [](EngineOptions& o, bool&) { o.bucket_bytes = 64; }},
  };
  for (const auto& [what, change] : changes) {
    testing_util::run_ranks(2, [&, what = what, change = change](int32_t rank, Communicator& comm) {
      std::shared_ptr<Communicator> w(&comm, [](Communicator*) {});
      EngineOptions o;
      bool stage3 = false;
      if (rank == 1) change(o, stage3);
      const Status s = seal_one_parameter(stage3, w, o);
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << what << ": " << s.to_string();
      EXPECT_NE(s.message().find("engine options"), std::string::npos)
          << what << ": " << s.message();
    });
  }
  // Stage 3's prefetch window decides where its all-gathers fall among its reduce-scatters
  // on the sharding group: the group's ranks must agree on it. Stage 2 has none.
  for (const bool stage3 : {true, false}) {
    testing_util::run_ranks(2, [stage3](int32_t rank, Communicator& comm) {
      std::shared_ptr<Communicator> w(&comm, [](Communicator*) {});
      EngineOptions o;
      o.prefetch_window = rank + 1;
      const Status s = seal_one_parameter(stage3, w, o);
      if (!stage3) {
        EXPECT_TRUE(s.ok()) << s.to_string();
        return;
      }
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
      EXPECT_NE(s.message().find("prefetch_window"), std::string::npos) << s.message();
    });
  }
}

// A pipeline stage given no parameters: its seal failed alone ("no parameters registered")
// and its pp peers waited in seal's agreement until the timeout. Every rank is refused at
// once, the empty one naming itself.
TEST(Seal, ARankWithNoParametersIsRefusedWithItsPeers) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  auto topology = *Topology::create({1, 2, 1, 1, 1}, 2);
  for (const bool stage3 : {false, true}) {
    testing_util::run_ranks(2, [&](int32_t rank, Communicator& comm) {
      std::shared_ptr<Communicator> w(&comm, [](Communicator*) {});
      auto hg = std::move(HybridGroup::create(w, topology)).value();
      std::unique_ptr<ShardedEngine> e;
      const auto sharding = hg->group(GroupKind::kSharding);
      if (stage3) {
        e = std::move(Stage3Engine::create(sharding, nullptr, {})).value();
      } else {
        e = std::move(Stage2Engine::create(sharding, nullptr, {})).value();
      }
      ASSERT_TRUE(e->set_model_parallel_groups(nullptr, hg->group(GroupKind::kPp)).ok());
      if (rank == 0) {
        ASSERT_TRUE(e->add_param({"w", {40}, DType::kFloat32}).ok());
      }
      const auto start = std::chrono::steady_clock::now();
      const Status s = e->seal();
      EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
      EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.to_string();
      EXPECT_NE(s.message().find(rank == 1 ? "no parameters registered"
                                           : "a rank registered no parameters"),
                std::string::npos)
          << s.message();
    });
  }
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
    // It names the parameter and what differs, with this rank's value.
    EXPECT_NE(s.message().find("registered other parameters than this rank"), std::string::npos)
        << s.message();
    EXPECT_NE(s.message().find(std::string("its parameter 1 'b' has another shape than this "
                                           "rank's [") +
                               (rank == 0 ? "3" : "4") + "]"),
              std::string::npos)
        << s.message();
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
    EXPECT_EQ(e->release(7).code(), StatusCode::kNotFound);
    EXPECT_EQ(e->grad_ready(9).code(), StatusCode::kOutOfRange);
    ASSERT_TRUE(e->grad_ready(0).ok());
    EXPECT_EQ(e->grad_ready(0).code(), StatusCode::kFailedPrecondition)
        << "a one-parameter bucket checked in twice";
    EXPECT_TRUE(e->step().ok());
    ASSERT_TRUE(e->grad_ready(0).ok());
    ASSERT_TRUE(e->step().ok());
    ASSERT_TRUE(e->synchronize().ok());
  });
  testing_util::run_ranks(2, [](int32_t, Communicator& comm) {
    std::shared_ptr<Communicator> w(&comm, [](Communicator*) {});
    auto e = std::move(Stage2Engine::create(w, nullptr, {})).value();
    ASSERT_TRUE(e->add_param({"a", {4}, DType::kFloat32}).ok());
    ASSERT_TRUE(e->add_param({"b", {4}, DType::kFloat32}).ok());
    ASSERT_TRUE(e->seal().ok());
    ASSERT_TRUE(e->grad_ready(1).ok());
    Status twice = e->grad_ready(1);
    EXPECT_EQ(twice.code(), StatusCode::kFailedPrecondition)
        << "checked in twice in a bucket of two";
    EXPECT_NE(twice.message().find("'b' checked in twice"), std::string::npos) << twice.to_string();
    ASSERT_TRUE(e->grad_ready(0).ok());
    ASSERT_TRUE(e->step().ok());
    ASSERT_TRUE(e->synchronize().ok());
  });
  EXPECT_EQ(Stage2Engine::create(nullptr, nullptr, {}).status().code(),
            StatusCode::kInvalidArgument);
}

// Ranks whose registrations or options differ are told what differs, not only that something
// does (the first parameter, or option, that differs, with this rank's value): the
// disagreements of collectives and splits name both sides; seal named neither.
TEST(Stage2, ASealRefusedForADifferenceNamesIt) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  struct Case {
    std::function<Status(Stage2Engine&, int32_t)> registers;
    EngineOptions options[2];
    std::string says[2];
  };
  EngineOptions lr_a, lr_b;
  lr_a.sgd.learning_rate = 0.5f;
  lr_b.sgd.learning_rate = 0.25f;
  const Case cases[] = {
      {[](Stage2Engine& e, int32_t rank) {
         HPS_RETURN_IF_ERROR(e.add_param({"w", {4}, DType::kFloat32}).status());
         return e.add_param({rank == 0 ? "b" : "bias", {4}, DType::kFloat32}).status();
       },
       {},
       {"its parameter 1 has another name than this rank's 'b'",
        "its parameter 1 has another name than this rank's 'bias'"}},
      {[](Stage2Engine& e, int32_t rank) {
         HPS_RETURN_IF_ERROR(e.add_param({"w", {4}, DType::kFloat32}).status());
         if (rank == 1) return Status::Ok();
         return e.add_param({"b", {4}, DType::kFloat32}).status();
       },
       {},
       {"it registered 1 parameters, this rank 2", "it registered 2 parameters, this rank 1"}},
      {[](Stage2Engine& e, int32_t rank) {
         return e.add_param({"w", {4}, rank == 0 ? DType::kFloat32 : DType::kBFloat16}).status();
       },
       {},
       {"its parameter 0 'w' has another dtype than this rank's float32",
        "its parameter 0 'w' has another dtype than this rank's bfloat16"}},
      {[](Stage2Engine& e, int32_t) {
         return e.add_param({"w", {4}, DType::kFloat32}).status();
       },
       {lr_a, lr_b},
       {"its sgd.learning_rate differs (this rank's: 0.5)",
        "its sgd.learning_rate differs (this rank's: 0.25)"}},
  };
  for (const Case& c : cases) {
    testing_util::run_ranks(2, [&](int32_t rank, Communicator& comm) {
      std::shared_ptr<Communicator> w(&comm, [](Communicator*) {});
      auto e = std::move(Stage2Engine::create(w, nullptr, c.options[rank])).value();
      ASSERT_TRUE(c.registers(*e, rank).ok());
      const Status s = e->seal();
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
      EXPECT_NE(s.message().find(c.says[rank]), std::string::npos) << s.message();
    });
  }
}

// A CPU engine given a CPU stream as its compute stream keeps it alive and nothing more (the
// header): the framework computes on the calling thread, so wait_parameters and step order
// the engine's work by blocking that thread. The stream was used as the compute stream, and
// wait_parameters queued its wait on that stream's worker thread instead: the views held the
// previous step's values while the optimizer was still writing them.
TEST(Engine, ACpuComputeStreamLeavesTheCallingThreadOrderingTheWork) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  constexpr size_t kNumel = size_t{1} << 22;
  for (const int32_t stage : {2, 3}) {
    testing_util::run_ranks(2, [stage](int32_t, Communicator& comm) {
      std::shared_ptr<Communicator> w(&comm, [](Communicator*) {});
      std::shared_ptr<Stream> compute = std::move(create_stream(comm.device())).value();
      EngineOptions o;
      o.sgd = {0.5f, 0.0f, 0.0f, false};
      o.compute_stream = compute.get();
      auto e = std::move(create_sharded_engine(stage, w, nullptr, o)).value();
      ASSERT_TRUE(e->add_param({"w", {static_cast<int64_t>(kNumel)}, DType::kFloat32}).ok());
      ASSERT_TRUE(e->seal().ok());
      std::fill_n(*e->param(0), kNumel, 1.0f);
      ASSERT_TRUE(e->broadcast_parameters().ok());
      for (int step = 1; step <= 3; ++step) {
        ASSERT_TRUE(e->gather(0).ok());
        std::fill_n(*e->grad(0), kNumel, 1.0f);
        ASSERT_TRUE(e->grad_ready(0, nullptr).ok());
        ASSERT_TRUE(e->release(0).ok());
        ASSERT_TRUE(e->step().ok());
        ASSERT_TRUE(e->gather(0).ok());  // stage 2: wait_parameters
        const float want = 1.0f - 0.5f * static_cast<float>(step);
        const float* v = *e->param(0);
        const size_t stale = kNumel - static_cast<size_t>(std::count(v, v + kNumel, want));
        EXPECT_EQ(stale, 0u) << "stage " << stage << " step " << step << ": " << stale
                             << " values differ from " << want << " after gather";
        ASSERT_TRUE(e->release(0).ok());
      }
      ASSERT_TRUE(e->synchronize().ok());
    });
  }
}

// A failure crosses an engine's groups. dp 2 x sharding 2 (ranks as threads), one rank gone
// before a step: its dp peer and its sharding peer see their collectives with it fail, and
// the fourth rank, which shares no group with it, must fail its step too. Without the link
// (Communicator::link_failures), the dp peer's optimizer ran on the shard its failed dp
// all-reduce left and its all-gather sent that to the fourth rank, whose step completed with
// wrong values and reported nothing. Both stages, and over TCP as well as shared memory.
TEST(Engine, ARankSharingNoGroupWithARankThatLeftFailsItsStep) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  auto topology = *Topology::create({2, 1, 2, 1, 1}, 4);
  constexpr int32_t kGone = 3;
  for (const bool shm : {true, false}) {
    for (const int32_t stage : {2, 3}) {
      SCOPED_TRACE(std::string(shm ? "shm" : "tcp") + ", stage " + std::to_string(stage));
      std::barrier first_step_done(4);
      CommOptions options;
      options.shared_memory = shm;
      testing_util::run_ranks(
          4,
          [&](int32_t rank, Communicator& comm) {
            std::shared_ptr<Communicator> w(&comm, [](Communicator*) {});
            auto hg = std::move(HybridGroup::create(w, topology)).value();
            const auto sharding = hg->group(GroupKind::kSharding);
            const auto dp = hg->group(GroupKind::kDp);
            EngineOptions o;
            o.sgd = {0.5f, 0.0f, 0.0f, false};
            o.bucket_bytes = 1024;  // several buckets: collectives on both groups interleave
            auto e = std::move(create_sharded_engine(stage, sharding, dp, o)).value();
            constexpr size_t kNumel = 1000;
            ASSERT_TRUE(e->add_param({"w", {static_cast<int64_t>(kNumel)}, DType::kFloat32}).ok());
            ASSERT_TRUE(e->seal().ok());
            std::fill_n(*e->param(0), kNumel, 1.0f);
            ASSERT_TRUE(e->broadcast_parameters().ok());
            auto train_step = [&]() -> Status {
              HPS_RETURN_IF_ERROR(e->gather(0));
              HPS_ASSIGN_OR_RETURN(float* g, e->grad(0));
              std::fill_n(g, kNumel, static_cast<float>(rank + 1));
              HPS_RETURN_IF_ERROR(e->grad_ready(0, nullptr));
              HPS_RETURN_IF_ERROR(e->release(0));
              HPS_RETURN_IF_ERROR(e->step());
              return e->synchronize();
            };
            ASSERT_TRUE(train_step().ok());
            first_step_done.arrive_and_wait();
            if (rank == kGone) {
              w->abort();  // its connections end, as when its process dies
              return;
            }
            const auto start = std::chrono::steady_clock::now();
            const Status s = train_step();
            const auto took = std::chrono::steady_clock::now() - start;
            EXPECT_FALSE(s.ok()) << "rank " << rank << " completed the step";
            EXPECT_NE(s.code(), StatusCode::kTimeout) << "rank " << rank << ": " << s.to_string();
            EXPECT_LT(took, std::chrono::seconds(10)) << "rank " << rank << ": " << s.to_string();
            // A failed peer's message travels with its failure (shared memory: its control
            // block; TCP: its farewell on the control connections): the rank sharing no
            // group with rank 3 learns what ended it too, quoted.
            EXPECT_NE(s.message().find("aborted the communicator"), std::string::npos)
                << "rank " << rank << ": " << s.to_string();
          },
          options);
    }
  }
}

// Calls that do not fit a parameter are refused naming it, at either stage: views before
// seal(), the gradient of a frozen parameter, a float view of a bfloat16 one.
TEST(Engine, CallsThatDoNotFitAParameterAreRefusedNamingIt) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  for (int32_t stage : {2, 3}) {
    testing_util::run_ranks(2, [&](int32_t, Communicator& comm) {
      std::shared_ptr<Communicator> w(&comm, [](Communicator*) {});
      auto e = std::move(create_sharded_engine(stage, w, nullptr, {})).value();
      ASSERT_TRUE(e->add_param({"w", {6}, DType::kFloat32}).ok());
      ASSERT_TRUE(e->add_param({"frozen", {5}, DType::kFloat32, false}).ok());
      ASSERT_TRUE(e->add_param({"half", {7}, DType::kBFloat16}).ok());
      for (auto code : {e->param(0).status().code(), e->param_data(0).status().code(),
                        e->grad(0).status().code(), e->gather(0).code()}) {
        EXPECT_EQ(code, StatusCode::kFailedPrecondition) << "stage " << stage;
      }
      Status early = e->param(0).status();
      EXPECT_NE(early.message().find("before seal()"), std::string::npos) << early.to_string();
      ASSERT_TRUE(e->seal().ok());
      if (stage == 3) {
        // Before broadcast_parameters() stage 3 holds the initial values (their views are
        // writable) and no gradients.
        EXPECT_TRUE(e->param(0).ok());
        Status s = e->grad_data(0).status();
        EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.to_string();
        EXPECT_NE(s.message().find("broadcast_parameters()"), std::string::npos) << s.to_string();
      }
      ASSERT_TRUE(e->broadcast_parameters().ok());
      ASSERT_TRUE(e->gather(0).ok());
      for (Status s : {e->grad(1).status(), e->grad_data(1).status()}) {
        EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.to_string();
        EXPECT_NE(s.message().find("'frozen' is not trainable"), std::string::npos)
            << s.to_string();
      }
      EXPECT_EQ(e->grad_ready(1, nullptr).code(), StatusCode::kFailedPrecondition);
      for (Status s : {e->param(2).status(), e->grad(2).status()}) {
        EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.to_string();
        EXPECT_NE(s.message().find("'half' is bfloat16: use its data view"), std::string::npos)
            << s.to_string();
      }
      EXPECT_TRUE(e->param_data(2).ok());
      EXPECT_TRUE(e->grad_data(2).ok());
      EXPECT_TRUE(e->param(1).ok()) << "a frozen parameter's values are readable";
      // The step goes on as usual.
      ASSERT_TRUE(e->grad_data(0).ok());
      ASSERT_TRUE(e->grad_ready(0, nullptr).ok());
      ASSERT_TRUE(e->grad_ready(2, nullptr).ok());
      ASSERT_TRUE(e->release(0).ok());
      ASSERT_TRUE(e->step().ok());
      ASSERT_TRUE(e->synchronize().ok());
    });
  }
}

// Every option that would train to garbage or crash is refused with a message naming it
// (issue 10, item 7): NaN or negative learning rates, betas outside [0, 1), a negative
// epsilon, nesterov without momentum, bad loss-scaling factors, alignments that are not a
// power of two up to 2 MiB.
TEST(EngineOptions, BadValuesAreRefusedNamingThem) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  struct Bad {
    const char* name;
    std::function<void(EngineOptions&)> set;
  };
  const std::vector<Bad> bad = {
      {"learning_rate", [](EngineOptions& o) { o.sgd.learning_rate = NAN; }},
      {"learning_rate", [](EngineOptions& o) { o.sgd.learning_rate = -0.1f; }},
      {"momentum", [](EngineOptions& o) { o.sgd.momentum = INFINITY; }},
      {"weight_decay", [](EngineOptions& o) { o.sgd.weight_decay = -1; }},
      {"nesterov", [](EngineOptions& o) { o.sgd.nesterov = true; }},
      {"beta1",
       [](EngineOptions& o) {
         o.optimizer = OptimizerKind::kAdamW;
         o.adamw.beta1 = 1.5f;
       }},
      {"beta2",
       [](EngineOptions& o) {
         o.optimizer = OptimizerKind::kAdamW;
         o.adamw.beta2 = 1.0f;
       }},
      {"epsilon",
       [](EngineOptions& o) {
         o.optimizer = OptimizerKind::kAdamW;
         o.adamw.epsilon = -1;
       }},
      {"learning_rate",
       [](EngineOptions& o) {
         o.optimizer = OptimizerKind::kAdamW;
         o.adamw.learning_rate = NAN;
       }},
      {"weight_decay",
       [](EngineOptions& o) {
         o.optimizer = OptimizerKind::kAdamW;
         o.adamw.weight_decay = NAN;
       }},
      {"optimizer", [](EngineOptions& o) { o.optimizer = static_cast<OptimizerKind>(7); }},
      {"clip_max_norm", [](EngineOptions& o) { o.clip_max_norm = INFINITY; }},
      {"alignment_bytes", [](EngineOptions& o) { o.alignment_bytes = uint64_t{1} << 63; }},
      {"alignment_bytes", [](EngineOptions& o) { o.alignment_bytes = 3; }},
      {"accumulation_steps", [](EngineOptions& o) { o.accumulation_steps = 0; }},
      {"prefetch_window", [](EngineOptions& o) { o.prefetch_window = 0; }},
      {"backoff_factor",
       [](EngineOptions& o) {
         o.dynamic_loss_scaling = true;
         o.backoff_factor = 1.5f;
       }},
      {"initial_loss_scale",
       [](EngineOptions& o) {
         o.dynamic_loss_scaling = true;
         o.initial_loss_scale = 0;
       }},
  };
  EXPECT_EQ(check_engine_arguments(nullptr, nullptr, {}).code(), StatusCode::kInvalidArgument);
  testing_util::run_ranks(1, [&](int32_t, Communicator& comm) {
    std::shared_ptr<Communicator> w(&comm, [](Communicator*) {});
    for (const Bad& b : bad) {
      EngineOptions o;
      b.set(o);
      for (int32_t stage : {2, 3}) {
        auto e = create_sharded_engine(stage, w, nullptr, o);
        ASSERT_EQ(e.status().code(), StatusCode::kInvalidArgument) << b.name;
        EXPECT_NE(e.status().message().find(b.name), std::string::npos) << e.status().message();
      }
    }
    for (int32_t stage : {0, 1, 4}) {
      auto e = create_sharded_engine(stage, w, nullptr, {});
      ASSERT_EQ(e.status().code(), StatusCode::kInvalidArgument) << stage;
      EXPECT_NE(e.status().message().find("stage"), std::string::npos) << e.status().message();
    }
  });
}

// A communicator that counts the reduce-scatters it was asked for.
class CountingCommunicator final : public Communicator {
 public:
  explicit CountingCommunicator(Communicator& inner) : inner_(inner) {}
  ~CountingCommunicator() override { untie(); }
  std::atomic<int> reduce_scatters{0};
  int32_t rank() const override { return inner_.rank(); }
  int32_t size() const override { return inner_.size(); }
  Device device() const override { return inner_.device(); }
  const std::string& name() const override { return inner_.name(); }
  std::string_view transport() const override { return inner_.transport(); }
  Stream& stream() override { return inner_.stream(); }
  Milliseconds timeout() const override { return inner_.timeout(); }
  void set_timeout(Milliseconds t) override { inner_.set_timeout(t); }
  StatusOr<std::shared_ptr<Work>> all_reduce(const void* s, void* r, size_t n, DType d, ReduceOp op,
                                             Stream* ready, uint64_t tag) override {
    return inner_.all_reduce(s, r, n, d, op, ready, tag);
  }
  StatusOr<std::shared_ptr<Work>> reduce(const void* s, void* r, size_t n, DType d, ReduceOp op,
                                         int32_t root, Stream* ready) override {
    return inner_.reduce(s, r, n, d, op, root, ready);
  }
  StatusOr<std::shared_ptr<Work>> broadcast(void* b, size_t n, DType d, int32_t root,
                                            Stream* ready) override {
    return inner_.broadcast(b, n, d, root, ready);
  }
  StatusOr<std::shared_ptr<Work>> all_gather(const void* s, void* r, size_t n, DType d,
                                             Stream* ready, uint64_t tag) override {
    return inner_.all_gather(s, r, n, d, ready, tag);
  }
  StatusOr<std::shared_ptr<Work>> reduce_scatter(const void* s, void* r, size_t n, DType d,
                                                 ReduceOp op, Stream* ready,
                                                 uint64_t tag) override {
    ++reduce_scatters;
    return inner_.reduce_scatter(s, r, n, d, op, ready, tag);
  }
  StatusOr<std::shared_ptr<Work>> send(const void* b, size_t n, DType d, int32_t peer,
                                       Stream* ready) override {
    return inner_.send(b, n, d, peer, ready);
  }
  StatusOr<std::shared_ptr<Work>> recv(void* b, size_t n, DType d, int32_t peer,
                                       Stream* ready) override {
    return inner_.recv(b, n, d, peer, ready);
  }
  StatusOr<std::shared_ptr<Work>> barrier(Stream* ready) override { return inner_.barrier(ready); }

 protected:
  StatusOr<std::unique_ptr<Communicator>> split_group(const std::vector<int32_t>& ranks,
                                                      std::string name,
                                                      std::vector<int32_t>) override {
    return inner_.split(ranks, std::move(name));
  }
  void abort_operations() override { inner_.abort(); }
  void fail_operations(const Status& cause) override { inner_.fail(cause); }

 private:
  Communicator& inner_;
};

// A model registered as one unit still gets several reduce-scatters with a bucket cap, and
// they start while its backward goes on: after the last-registered parameters check in,
// before the first ones do (issue 11, item 2).
TEST(Buckets, ACappedUnitIsReducedInSeveralCollectivesDuringBackward) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  for (int32_t stage : {2, 3}) {
    testing_util::run_ranks(2, [&](int32_t, Communicator& comm) {
      auto counting = std::make_shared<CountingCommunicator>(comm);
      EngineOptions o;
      o.bucket_bytes = 4096;  // 1024 floats
      auto e = std::move(create_sharded_engine(stage, counting, nullptr, o)).value();
      const int params = 8;
      for (int i = 0; i < params; ++i) {
        ASSERT_TRUE(e->add_param({"w" + std::to_string(i), {1000}, DType::kFloat32}).ok());
      }
      ASSERT_TRUE(e->seal().ok());
      EXPECT_EQ(e->plan().buffers().size(), static_cast<size_t>(params));
      ASSERT_TRUE(e->broadcast_parameters().ok());
      ASSERT_TRUE(e->gather(0).ok());
      const int before = counting->reduce_scatters.load();
      for (int i = params; i-- > 0;) {  // backward: last registered first
        float* g = *e->grad(static_cast<size_t>(i));
        for (int k = 0; k < 1000; ++k) g[k] = 1.0f;
        ASSERT_TRUE(e->grad_ready(static_cast<size_t>(i), nullptr).ok());
        if (i == params / 2) {
          EXPECT_EQ(counting->reduce_scatters.load() - before, params / 2)
              << "stage " << stage << ": half the backward checked in, half the buckets reducing";
        }
      }
      EXPECT_EQ(counting->reduce_scatters.load() - before, params) << "stage " << stage;
      ASSERT_TRUE(e->release(0).ok());
      ASSERT_TRUE(e->step().ok());
      ASSERT_TRUE(e->synchronize().ok());
    });
  }
}

// With a clip, each shard is unscaled and its partial sums of squares taken as its
// reduction completes, before step() is called (the step then reads each gradient once, in
// the optimizer); stage 2's full gradients stay readable until step().
TEST(Buckets, TheClipsPartialSumsAreTakenAsEachReductionCompletes) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  const int params = 4;
  const size_t n = 777;
  auto value = [](int32_t rank, int i, size_t k) {
    return static_cast<float>(rank + 1) * 0.01f * static_cast<float>((k + 3 * i) % 11 + 1);
  };
  for (int32_t stage : {2, 3}) {
    double partials[2] = {0, 0};  // per rank, before step()
    testing_util::run_ranks(2, [&](int32_t rank, Communicator& comm) {
      EngineOptions o;
      o.bucket_bytes = 4096;
      o.clip_max_norm = 1e6;  // a norm, no clipping
      auto shared = std::shared_ptr<Communicator>(&comm, [](Communicator*) {});
      auto created = create_sharded_engine(stage, shared, nullptr, o);
      ASSERT_TRUE(created.ok()) << created.status().to_string();
      auto e = std::move(*created);
      for (int i = 0; i < params; ++i) {
        ASSERT_TRUE(e->add_param({"w" + std::to_string(i), {n}, DType::kFloat32}).ok());
      }
      ASSERT_TRUE(e->seal().ok());
      ASSERT_TRUE(e->broadcast_parameters().ok());
      ASSERT_TRUE(e->gather(0).ok());
      for (int i = params; i-- > 0;) {
        float* g = *e->grad(static_cast<size_t>(i));
        for (size_t k = 0; k < n; ++k) g[k] = value(rank, i, k);
        ASSERT_TRUE(e->grad_ready(static_cast<size_t>(i), nullptr).ok());
      }
      ASSERT_TRUE(e->release(0).ok());
      ASSERT_TRUE(e->synchronize().ok());  // the reductions and what follows them, no step
      const auto* base = dynamic_cast<const EngineBase*>(e.get());
      ASSERT_NE(base, nullptr);
      const ClipState* clip = base->optimizer()->clip()->state().get();
      partials[rank] = clip->partials[0] + clip->partials[1];
      if (stage == 2) {
        for (int i = 0; i < params; ++i) {
          const float* g = *e->grad(static_cast<size_t>(i));
          for (size_t k = 0; k < n; k += 97) {
            ASSERT_EQ(g[k], value(rank, i, k)) << "stage 2 zeroed a gradient before step()";
          }
        }
      }
      ASSERT_TRUE(e->step().ok());
      ASSERT_TRUE(e->synchronize().ok());
    });
    double expected = 0;  // the mean over 2 ranks, squared, summed over the whole model
    for (int i = 0; i < params; ++i) {
      for (size_t k = 0; k < n; ++k) {
        const double mean = (static_cast<double>(value(0, i, k)) + value(1, i, k)) / 2;
        expected += mean * mean;
      }
    }
    EXPECT_GT(partials[0], 0) << "stage " << stage;
    EXPECT_GT(partials[1], 0) << "stage " << stage;
    EXPECT_NEAR(partials[0] + partials[1], expected, expected * 1e-6) << "stage " << stage;
  }
}

}  // namespace
}  // namespace hps
