// The engine harness: one parameterised test of both stages against the float64 model of
// the documented semantics (tests/reference/engine_model.h), driven as a framework drives
// them — over stage × optimizer × clip (float, deterministic) × accumulation × sharding ×
// dp × parameter dtypes (fp32, or bf16 / fp16 with fp32 masters) × dynamic loss scaling
// (with an injected Inf) × frozen, NO_CLIP, distributed and shared parameters × bucket caps.
// Gradients depend on the parameters the framework reads (g = a ⊙ p + b), so a stale gather
// shows in the next step's values.
//
// The same source builds two binaries: engine_harness_test (CPU communicators, every case
// multi-rank, ranks as threads) and cuda_engine_harness_test (world size 1 on a CUDA device,
// label gpu, skipped without one), which also counts the CUDA runtime's synchronising calls
// with the interposer (tests/support/cuda_sync_interposer.h), independently of hpshard's own
// host-sync counter: both must stay 0 inside the engine's calls of every steady step.
#include <gtest/gtest.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "core/comm/store.h"
#include "core/common/config.h"
#include "core/device/host_sync.h"
#include "core/sharding/sharded_engine.h"
#include "core/topology/hybrid_group.h"
#include "tests/core/comm/comm_test_util.h"
#include "tests/reference/engine_model.h"
#if HPS_HARNESS_CUDA
#include "tests/support/cuda_sync_interposer.h"
#endif

namespace hps {
namespace {

#if HPS_HARNESS_CUDA
constexpr DeviceType kDevice = DeviceType::kCuda;
#else
constexpr DeviceType kDevice = DeviceType::kCpu;
#endif

enum class Clip { kNone, kFloat, kDeterministic };

struct Case {
  std::string name;
  int32_t stage = 2;
  bool adamw = false;
  Clip clip = Clip::kNone;
  int32_t accumulation = 1;
  int32_t sharding = 2;
  int32_t dp = 1;
  bool mixed = false;  // bf16 and fp16 parameters beside fp32 ones
  bool loss_scaling = false;
  bool frozen = false;
  uint64_t bucket_bytes = 0;
  // Every rank checks in each unit's gradients in an order of its own (seeded by rank,
  // step, micro-batch and unit), so the ranks' buckets complete in different orders.
  bool rank_orders = false;
  // Backward visits the units in forward order (every rank): each unit's buckets complete
  // before their turn and are held past the unit's release.
  bool units_forward_in_backward = false;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

constexpr int kSteps = 4;
constexpr int kInjectStep = 1;  // loss scaling: one rank writes an Inf in this step

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (int32_t stage : {2, 3}) {
    auto add = [&](Case c) {
      c.stage = stage;
      c.name = "stage" + std::to_string(stage) + "_" + c.name;
      out.push_back(std::move(c));
    };
    add({.name = "sgd", .sharding = 2});
    add({.name = "adamw_clip", .adamw = true, .clip = Clip::kFloat, .sharding = 3});
    add({.name = "sgd_clip_frozen", .clip = Clip::kFloat, .sharding = 2, .frozen = true});
    add({.name = "adamw_deterministic_clip_dp",
         .adamw = true,
         .clip = Clip::kDeterministic,
         .sharding = 2,
         .dp = 2});
    add({.name = "sgd_accumulation_dp", .accumulation = 2, .sharding = 2, .dp = 2});
    add({.name = "adamw_mixed_loss_scaling",
         .adamw = true,
         .clip = Clip::kFloat,
         .sharding = 2,
         .mixed = true,
         .loss_scaling = true});
    add({.name = "sgd_mixed_accumulation_frozen",
         .accumulation = 3,
         .sharding = 3,
         .mixed = true,
         .frozen = true});
    add({.name = "adamw_loss_scaling_buckets",
         .adamw = true,
         .clip = Clip::kFloat,
         .sharding = 4,
         .loss_scaling = true,
         .bucket_bytes = 512});
    // Equal-sized buckets (l2.w and l2.shared pad to 1024 bytes at sharding 4) completed
    // in different orders: their reduce-scatters must still pair bucket with bucket.
    add({.name = "sgd_accumulation_buckets_rank_orders",
         .accumulation = 2,
         .sharding = 4,
         .bucket_bytes = 512,
         .rank_orders = true});
    add({.name = "adamw_mixed_buckets_rank_orders_dp",
         .adamw = true,
         .clip = Clip::kFloat,
         .sharding = 2,
         .dp = 2,
         .mixed = true,
         .bucket_bytes = 256,
         .rank_orders = true,
         .units_forward_in_backward = true});
  }
  if (kDevice == DeviceType::kCuda) {
    for (Case& c : out) c.sharding = c.dp = 1;  // one GPU
  }
  return out;
}

// The model: three units, with NO_CLIP, distributed, shared and (optionally) frozen
// parameters, sizes that do not divide evenly.
std::vector<hps_ref::Param> model_params(const Case& c) {
  using D = hps_ref::DType;
  const D w = c.mixed ? D::kBFloat16 : D::kFloat32;
  const D h = c.mixed ? D::kFloat16 : D::kFloat32;
  std::vector<hps_ref::Param> p = {
      {"embed", {37, 5}, w, true, true, false, false, 0},
      {"l1.w", {33, 9}, h, true, true, false, false, 1},
      {"l1.b", {9}, D::kFloat32, true, /*need_clip=*/false, false, false, 1},
      {"l2.w", {64, 3}, D::kFloat32, true, true, /*is_distributed=*/true, false, 2},
      {"l2.shared", {5}, w, true, true, false, /*shared_not_first=*/true, 2},
  };
  if (c.frozen) p.push_back({"embed.frozen", {11}, h, false, true, false, false, 0});
  return p;
}

DType core_dtype(hps_ref::DType t) {
  switch (t) {
    case hps_ref::DType::kFloat16: return DType::kFloat16;
    case hps_ref::DType::kBFloat16: return DType::kBFloat16;
    default: return DType::kFloat32;
  }
}

double uniform(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  uint64_t x = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull) * 0xBF58476D1CE4E5B9ull;
  x ^= (c + 1) * 0x94D049BB133111EBull;
  x ^= (d + 7) * 0xD6E8FEB86659FD93ull;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<double>(x >> 11) * 0x1p-53;  // [0, 1)
}

// Host copies of device memory, for the framework's own reads and writes (outside the
// engine's calls: they are the harness's host syncs, not the engine's).
std::vector<double> read(Stream& stream, DType dtype, const void* data, size_t n) {
  std::vector<uint8_t> bytes(n * dtype_size(dtype));
  EXPECT_TRUE(copy_to_host(stream, bytes.data(), data, bytes.size()).ok());
  std::vector<double> out(n);
  for (size_t e = 0; e < n; ++e) out[e] = testing_util::load_element(dtype, bytes.data(), e);
  return out;
}

struct Shared {
  explicit Shared(const Case& c, int32_t world)
      : params(model_params(c)), sync(world), grads(static_cast<size_t>(world)) {}
  std::vector<hps_ref::Param> params;
  std::unique_ptr<hps_ref::EngineModel> model;
  std::barrier<> sync;
  hps_ref::StepGradients grads;  // [rank][micro][param][element]
};

class EngineHarness : public ::testing::TestWithParam<Case> {};

// One rank of the framework.
void run_rank(const Case& c, int32_t rank, std::shared_ptr<Communicator> sharding,
              std::shared_ptr<Communicator> dp, Shared& shared) {
  const Device device = sharding->device();
  const auto& params = shared.params;
  const int32_t world = c.sharding * c.dp;
  auto compute_or = create_stream(device);
  ASSERT_TRUE(compute_or.ok());
  std::unique_ptr<Stream> compute = std::move(*compute_or);
  // On the CPU the framework computes on its own thread (the engine's default compute
  // stream); on CUDA on a stream of its own.
  const bool own_stream = device.type == DeviceType::kCuda;
  auto host_stream_or = default_compute_stream(device);
  ASSERT_TRUE(host_stream_or.ok());
  Stream& copies = own_stream ? *compute : **host_stream_or;

  EngineOptions o;
  o.optimizer = c.adamw ? OptimizerKind::kAdamW : OptimizerKind::kSgd;
  o.sgd = {0.05f, 0.9f, 0.01f, c.stage == 3};
  o.adamw = {0.02f, 0.85f, 0.97f, 1e-6f, 0.03f};
  o.clip_max_norm = c.clip == Clip::kNone ? 0.0 : 0.5;
  o.deterministic_clip = c.clip == Clip::kDeterministic;
  o.accumulation_steps = c.accumulation;
  o.bucket_bytes = c.bucket_bytes;
  o.dynamic_loss_scaling = c.loss_scaling;
  o.initial_loss_scale = 4.0f;
  o.growth_interval = 2;
  o.compute_stream = own_stream ? compute.get() : nullptr;
  auto engine_or = create_sharded_engine(c.stage, sharding, dp, o);
  ASSERT_TRUE(engine_or.ok()) << engine_or.status().to_string();
  ShardedEngine& e = **engine_or;

  std::vector<std::vector<double>> initial;
  for (size_t i = 0; i < params.size(); ++i) {
    ParamSpec spec{params[i].name, params[i].shape, core_dtype(params[i].dtype),
                   params[i].trainable};
    spec.need_clip = params[i].need_clip;
    spec.is_distributed = params[i].is_distributed;
    spec.shared_not_first = params[i].shared_not_first;
    spec.unit = params[i].unit;
    ASSERT_TRUE(e.add_param(spec).ok());
    std::vector<double> v(params[i].numel());
    for (size_t k = 0; k < v.size(); ++k) {
      v[k] = hps_ref::round_to(params[i].dtype, 0.6 * uniform(1, i, k, 0) - 0.3);
    }
    initial.push_back(std::move(v));
  }
  ASSERT_TRUE(e.seal().ok());
  if (rank == 0) {
    shared.model = std::make_unique<hps_ref::EngineModel>(
        params,
        hps_ref::Options{
            .optimizer = c.adamw ? hps_ref::Optimizer::kAdamW : hps_ref::Optimizer::kSgd,
            .learning_rate = c.adamw ? double{o.adamw.learning_rate} : double{o.sgd.learning_rate},
            .momentum = o.sgd.momentum,
            .weight_decay = c.adamw ? double{o.adamw.weight_decay} : double{o.sgd.weight_decay},
            .nesterov = o.sgd.nesterov,
            .beta1 = o.adamw.beta1,
            .beta2 = o.adamw.beta2,
            .epsilon = o.adamw.epsilon,
            .clip_max_norm = o.clip_max_norm,
            .accumulation_steps = c.accumulation,
            .ranks = world,
            .dynamic_loss_scaling = c.loss_scaling,
            .initial_loss_scale = o.initial_loss_scale,
            .growth_factor = o.growth_factor,
            .backoff_factor = o.backoff_factor,
            .growth_interval = o.growth_interval},
        initial);
  }
  // Rank 0's initial values (the others write junk: the broadcast must replace it).
  for (size_t i = 0; i < params.size(); ++i) {
    const DType d = core_dtype(params[i].dtype);
    std::vector<uint8_t> host(params[i].numel() * dtype_size(d));
    for (size_t k = 0; k < params[i].numel(); ++k) {
      testing_util::store_element(d, host.data(), k, rank == 0 ? initial[i][k] : 7.0);
    }
    auto view = e.param_data(i);
    ASSERT_TRUE(view.ok()) << view.status().to_string();
    ASSERT_TRUE(copies.memcpy_async(*view, host.data(), host.size()).ok());
    ASSERT_TRUE(copies.synchronize().ok());
  }
  ASSERT_TRUE(e.broadcast_parameters().ok());

  // The engine's own calls: hpshard's host-sync counter and, on CUDA, the interposer's
  // count of synchronising runtime calls, both on this thread.
  uint64_t engine_syncs = 0;
  auto engine = [&](auto&& fn) {
    const uint64_t before = host_sync_count_thread();
#if HPS_HARNESS_CUDA
    const uint64_t cuda_before = testing_util::cuda_sync_counts_thread().total();
#endif
    auto result = fn();
    engine_syncs += host_sync_count_thread() - before;
#if HPS_HARNESS_CUDA
    engine_syncs += testing_util::cuda_sync_counts_thread().total() - cuda_before;
#endif
    return result;
  };
  // An engine call that must succeed: false (and a failure) when it does not.
  auto ok = [&](const char* what, auto&& fn) {
    const Status s = engine(fn);
    if (!s.ok()) ADD_FAILURE() << what << " rank " << rank << ": " << s.to_string();
    return s.ok();
  };
  std::vector<int32_t> units = {0, 1, 2};
  auto unit_params = [&](int32_t u) {
    std::vector<size_t> out;
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].unit == u) out.push_back(i);
    }
    return out;
  };
  auto check_view = [&](size_t i, const std::string& where) {
    auto view = e.param_data(i);
    ASSERT_TRUE(view.ok()) << where << ": " << view.status().to_string();
    const DType d = core_dtype(params[i].dtype);
    const std::vector<double> got = read(copies, d, *view, params[i].numel());
    const std::vector<double>& master = shared.model->master(i);
    const std::vector<double> bound = shared.model->error_bound(i);
    for (size_t k = 0; k < got.size(); ++k) {
      const double tolerance =
          bound[k] + 1e-7 + (d == DType::kFloat32 ? 0.0 : hps_ref::ulp(params[i].dtype, master[k]));
      ASSERT_NEAR(got[k], master[k], tolerance)
          << where << " rank " << rank << ": the view of " << params[i].name << "[" << k << "]";
    }
  };

  for (int step = 0; step < kSteps; ++step) {
    engine_syncs = 0;
    auto& mine = shared.grads[static_cast<size_t>(rank)];
    mine.assign(static_cast<size_t>(c.accumulation),
                std::vector<std::vector<double>>(params.size()));
    const float* scale_address = e.loss_scale();
    std::vector<std::vector<double>> written(params.size());
    for (int32_t mb = 0; mb < c.accumulation; ++mb) {
      const std::string where =
          "step " + std::to_string(step) + " micro-batch " + std::to_string(mb);
      if (c.stage == 3) {
        for (auto& w : written) w.clear();  // stage 3: each micro-batch's view starts at zero
      }
      for (int32_t u : units) {  // forward
        if (!ok("gather", [&] { return e.gather(u); })) return;
        for (size_t i : unit_params(u)) check_view(i, where + " forward");
        if (::testing::Test::HasFatalFailure()) return;
        if (!ok("release", [&] { return e.release(u); })) return;
      }
      std::vector<int32_t> backward(units.rbegin(), units.rend());
      if (c.units_forward_in_backward) backward = units;
      for (auto it = backward.begin(); it != backward.end(); ++it) {
        if (!ok("gather", [&] { return e.gather(*it); })) return;
        const double scale = read(copies, DType::kFloat32, scale_address, 1)[0];
        ASSERT_EQ(scale, shared.model->loss_scale()) << where;
        std::vector<size_t> order = unit_params(*it);
        if (c.rank_orders) {  // each rank, step and micro-batch its own order
          std::mt19937_64 random(0x5eed +
                                 static_cast<uint64_t>(((rank * 31 + step) * 7 + mb) * 5 + *it));
          std::shuffle(order.begin(), order.end(), random);
        }
        for (size_t i : order) {
          if (!params[i].trainable) continue;
          const DType d = core_dtype(params[i].dtype);
          const size_t n = params[i].numel();
          auto p_view = e.param_data(i);
          ASSERT_TRUE(p_view.ok());
          const std::vector<double> p = read(copies, d, *p_view, n);
          auto g_view = engine([&] { return e.grad_data(i); });
          ASSERT_TRUE(g_view.ok()) << g_view.status().to_string();
          std::vector<double>& g = mine[static_cast<size_t>(mb)][i];
          g.resize(n);
          std::vector<double>& w = written[i];
          if (w.empty()) w.assign(n, 0.0);
          const std::vector<double> held = read(copies, d, *g_view, n);
          std::vector<uint8_t> host(n * dtype_size(d));
          for (size_t k = 0; k < n; ++k) {
            const double a = 0.5 * (1.0 + uniform(2, static_cast<uint64_t>(rank), i, k));
            const double b = uniform(3, static_cast<uint64_t>(rank), i,
                                     static_cast<uint64_t>(step * 16 + mb) * 4096 + k) -
                             0.5;
            g[k] = a * p[k] + b;
            if (c.loss_scaling && step == kInjectStep && rank == world - 1 && mb == 0 && i == 1 &&
                k == 3) {
              g[k] = INFINITY;
            }
            ASSERT_EQ(held[k], w[k]) << where << ": the gradient view of " << params[i].name;
            w[k] = hps_ref::EngineModel::framework_accumulate(params[i].dtype, w[k], scale, g[k]);
            testing_util::store_element(d, host.data(), k, w[k]);
          }
          ASSERT_TRUE(copies.memcpy_async(*g_view, host.data(), host.size()).ok());
          if (!own_stream) {
            ASSERT_TRUE(copies.synchronize().ok());
          }
          if (!ok("grad_ready",
                  [&] { return e.grad_ready(i, own_stream ? compute.get() : nullptr); })) {
            return;
          }
          if (own_stream) {
            ASSERT_TRUE(compute->synchronize().ok());  // `host` may go
          }
        }
        if (!ok("release", [&] { return e.release(*it); })) return;
      }
    }
    if (!ok("step", [&] { return e.step(); })) return;
    if (step > 0) {
      EXPECT_EQ(engine_syncs, 0u) << "step " << step << " rank " << rank
                                  << ": the engine blocked the host";
    }
    shared.sync.arrive_and_wait();  // every rank's gradients are in
    if (rank == 0) shared.model->step(shared.grads);
    shared.sync.arrive_and_wait();
    if (step % 2 == 1) {  // gathering blocks: only on some steps, so later gathers meet
                          // all-gathers still in flight
      auto all = e.gather_all();
      ASSERT_TRUE(all.ok()) << all.status().to_string();
      for (size_t i = 0; i < params.size(); ++i) {
        const std::vector<double> bound = shared.model->error_bound(i);
        for (size_t k = 0; k < (*all)[i].size(); ++k) {
          ASSERT_NEAR((*all)[i][k], shared.model->master(i)[k], bound[k] + 1e-7)
              << "after step " << step << " rank " << rank << ": " << params[i].name << "[" << k
              << "]";
        }
      }
      const auto skipped = read(copies, DType::kInt64, e.skipped_steps(), 1);
      EXPECT_EQ(skipped[0], static_cast<double>(shared.model->skipped_steps()));
    }
  }
  ASSERT_TRUE(e.synchronize().ok());
}

TEST_P(EngineHarness, MatchesTheFloat64Model) {
  const Case& c = GetParam();
#if HPS_HARNESS_CUDA
  if (device_count(DeviceType::kCuda) == 0) GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(testing_util::cuda_sync_interposer_active());
  Shared shared(c, 1);
  auto comm = create_communicator(make_in_memory_store(), 0, 1, Device::cuda(0));
  ASSERT_TRUE(comm.ok()) << comm.status().to_string();
  run_rank(c, 0, std::shared_ptr<Communicator>(std::move(*comm)), nullptr, shared);
  shared.sync.arrive_and_drop();
#else
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  const int32_t world = c.sharding * c.dp;
  Shared shared(c, world);
  auto topology = *Topology::create({c.dp, 1, c.sharding, 1, 1}, world);
  testing_util::run_ranks(world, [&](int32_t rank, Communicator& comm) {
    std::shared_ptr<Communicator> w(&comm, [](Communicator*) {});
    auto hg = HybridGroup::create(w, topology);
    ASSERT_TRUE(hg.ok()) << hg.status().to_string();
    run_rank(c, rank, (*hg)->group(GroupKind::kSharding),
             c.dp > 1 ? (*hg)->group(GroupKind::kDp) : nullptr, shared);
    // A rank that stopped early leaves the barrier, so the others reach their failures
    // (a collective's timeout) instead of waiting for it forever.
    shared.sync.arrive_and_drop();
  });
#endif
}

INSTANTIATE_TEST_SUITE_P(Cases, EngineHarness, ::testing::ValuesIn(all_cases()),
                         [](const auto& p) { return p.param.name; });

}  // namespace
}  // namespace hps
