// A small model trained by real engines (ranks as threads over an in-memory store) for the
// checkpoint tests, and its unsharded reference: the gradients depend on the rank, the
// step and the element only, so a run can change its world size between steps and the
// reference follows it.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/checkpoint/checkpointer.h"
#include "core/common/half.h"
#include "core/device/host_sync.h"
#include "core/kernels/cast.h"
#include "core/kernels/optimizer.h"
#include "core/sharding/sharded_engine.h"
#include "core/topology/hybrid_group.h"
#include "tests/core/comm/comm_test_util.h"

namespace hps::ckpt_test {

struct TestParam {
  const char* name;
  std::vector<int64_t> shape;
  int32_t unit;
  bool trainable;
};
inline const std::vector<TestParam> kModel = {
    {"layer0.weight", {7, 13}, 0, true}, {"layer0.bias", {13}, 0, true},
    {"layer1.weight", {13, 5}, 1, true}, {"embedding", {3, 4}, 1, false},
    {"layer2.weight", {301}, 2, true},   {"layer2.scale", {1}, 2, true},
};
inline constexpr int32_t kUnits = 3;

inline size_t numel(const TestParam& p) {
  size_t n = 1;
  for (int64_t d : p.shape) n *= static_cast<size_t>(d);
  return n;
}
inline float initial(size_t p, size_t i) { return std::cos(static_cast<float>(p * 17 + i) * 0.1f); }
inline float gradient(int32_t rank, int step, size_t p, size_t i) {
  return std::sin(0.1f * static_cast<float>((i + 1) * (p + 1)) + 0.7f * static_cast<float>(rank) +
                  0.3f * static_cast<float>(step));
}

struct Layout {
  int32_t stage = 2;
  int32_t sharding = 2;
  int32_t dp = 1;
  DType dtype = DType::kFloat32;  // of every parameter
  uint64_t alignment_bytes = 256;
  int32_t world() const { return sharding * dp; }
};

inline EngineOptions adamw_options() {
  EngineOptions o;
  o.optimizer = OptimizerKind::kAdamW;
  o.adamw = {1e-2f, 0.9f, 0.99f, 1e-8f, 0.05f};
  return o;
}
inline EngineOptions sgd_options() {
  EngineOptions o;
  o.sgd = {0.1f, 0.9f, 0.01f, false};
  return o;
}

// One rank's engine, its checkpointer and the calls of a training step.
struct Rank {
  int32_t rank = 0;
  std::shared_ptr<Communicator> world;
  std::unique_ptr<HybridGroup> group;
  std::unique_ptr<ShardedEngine> engine;
  Checkpointable* state = nullptr;
  std::unique_ptr<Checkpointer> checkpointer;
  int32_t inf_step = -1;  // this step's gradients get an Inf on rank 0 (loss scaling tests)

  // A step as a framework drives it: gather each unit, add the gradients (scaled by the
  // loss scale), check them in, release (unless `release` is false: stage 2 needs none);
  // then step(). Returns the host syncs it counted.
  uint64_t train_step(int step, bool release = true) {
    host_sync_reset();
    const uint64_t before = host_sync_count_thread();
    for (int32_t u = 0; u < kUnits; ++u) {
      EXPECT_TRUE(engine->gather(u).ok());
      if (release) {
        EXPECT_TRUE(engine->release(u).ok());
      }
    }
    const float scale = *engine->loss_scale();
    for (int32_t u = kUnits; u-- > 0;) {
      EXPECT_TRUE(engine->gather(u).ok());
      for (size_t p = kModel.size(); p-- > 0;) {
        if (kModel[p].unit != u || !kModel[p].trainable) continue;
        auto g = engine->grad_data(p);
        EXPECT_TRUE(g.ok()) << g.status().to_string();
        const DType d = engine->plan().params()[p].dtype;
        for (size_t i = 0; i < numel(kModel[p]); ++i) {
          float v = gradient(rank, step, p, i) * scale;
          if (step == inf_step && rank == 0 && p == 0 && i == 0) v = INFINITY;
          testing_util::store_element(d, *g, i, v);
        }
        EXPECT_TRUE(engine->grad_ready(p, nullptr).ok());
      }
      if (release) {
        EXPECT_TRUE(engine->release(u).ok());
      }
    }
    EXPECT_TRUE(engine->step().ok());
    return host_sync_count_thread() - before;
  }

  // Every state tensor's bytes on this rank, by name (after synchronize()).
  std::map<std::string, std::vector<uint8_t>> state_bytes() {
    EXPECT_TRUE(engine->synchronize().ok());
    std::map<std::string, std::vector<uint8_t>> out;
    auto tensors = state->state_tensors();
    EXPECT_TRUE(tensors.ok());
    for (const auto& t : *tensors) {
      const auto* p = static_cast<const uint8_t*>(t.data);
      out[t.name].assign(p, p + (t.end - t.begin) * dtype_size(t.dtype));
    }
    return out;
  }
};

// Creates rank `rank`'s engine over `world` with `layout`, the model registered and its
// initial values broadcast, and a Checkpointer under `root` (none when root is empty).
inline void make_rank(Rank& r, int32_t rank, Communicator& comm, const Layout& layout,
                      EngineOptions options, const std::string& root,
                      CheckpointOptions checkpoint_options = {},
                      const std::vector<TestParam>& model = kModel) {
  r.rank = rank;
  r.world = std::shared_ptr<Communicator>(&comm, [](Communicator*) {});
  auto topology = Topology::create({layout.dp, 1, layout.sharding, 1, 1}, layout.world());
  ASSERT_TRUE(topology.ok()) << topology.status().to_string();
  auto hg = HybridGroup::create(r.world, *topology);
  ASSERT_TRUE(hg.ok()) << hg.status().to_string();
  r.group = std::move(*hg);
  options.alignment_bytes = layout.alignment_bytes;
  auto engine =
      create_sharded_engine(layout.stage, r.group->group(GroupKind::kSharding),
                            layout.dp > 1 ? r.group->group(GroupKind::kDp) : nullptr, options);
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  r.engine = std::move(*engine);
  for (const auto& p : model) {
    ParamSpec spec{p.name, p.shape, layout.dtype, p.trainable};
    spec.unit = p.unit;
    ASSERT_TRUE(r.engine->add_param(spec).ok());
  }
  ASSERT_TRUE(r.engine->seal().ok());
  for (size_t p = 0; p < model.size(); ++p) {
    void* v = *r.engine->param_data(p);
    for (size_t i = 0; i < numel(model[p]); ++i) {
      testing_util::store_element(layout.dtype, v, i, rank == 0 ? initial(p, i) : 999.0);
    }
  }
  ASSERT_TRUE(r.engine->broadcast_parameters().ok());
  r.state = dynamic_cast<Checkpointable*>(r.engine.get());
  ASSERT_NE(r.state, nullptr);
  if (!root.empty()) {
    auto c = Checkpointer::create(*r.state, r.world, root, checkpoint_options);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    r.checkpointer = std::move(*c);
  }
}

// The unsharded reference: fp32 parameters, AdamW or SGD on the mean gradient of every
// rank of the phase's world. phases: (world size, steps), in order.
inline std::vector<std::vector<float>> reference(
    const EngineOptions& o, const std::vector<std::pair<int32_t, int>>& phases) {
  std::vector<std::vector<float>> params(kModel.size()), a(kModel.size()), b(kModel.size());
  for (size_t p = 0; p < kModel.size(); ++p) {
    for (size_t i = 0; i < numel(kModel[p]); ++i) params[p].push_back(initial(p, i));
    a[p].assign(numel(kModel[p]), 0.0f);
    b[p].assign(numel(kModel[p]), 0.0f);
  }
  int step = 0;
  for (const auto& [world, steps] : phases) {
    for (int s = 0; s < steps; ++s, ++step) {
      for (size_t p = 0; p < kModel.size(); ++p) {
        if (!kModel[p].trainable) continue;
        std::vector<float> g;
        for (size_t i = 0; i < numel(kModel[p]); ++i) {
          double sum = 0;
          for (int32_t r = 0; r < world; ++r) sum += gradient(r, step, p, i);
          g.push_back(static_cast<float>(sum / world));
        }
        if (o.optimizer == OptimizerKind::kAdamW) {
          cpu::adamw(params[p].data(), g.data(), a[p].data(), b[p].data(), g.size(), o.adamw,
                     step + 1, nullptr, 1.0f);
        } else {
          cpu::sgd(params[p].data(), g.data(), a[p].data(), g.size(), o.sgd, nullptr, 1.0f,
                   step == 0);
        }
      }
    }
  }
  return params;
}

inline void expect_near_reference(const std::vector<std::vector<float>>& got,
                                  const std::vector<std::vector<float>>& expected,
                                  const std::string& context) {
  ASSERT_EQ(got.size(), expected.size());
  for (size_t p = 0; p < expected.size(); ++p) {
    ASSERT_EQ(got[p].size(), expected[p].size());
    for (size_t i = 0; i < expected[p].size(); ++i) {
      ASSERT_NEAR(got[p][i], expected[p][i], 1e-6f * std::max(1.0f, std::fabs(expected[p][i])))
          << context << ": " << kModel[p].name << "[" << i << "]";
    }
  }
}

}  // namespace hps::ckpt_test
