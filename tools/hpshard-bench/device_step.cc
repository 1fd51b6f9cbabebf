#include "tools/hpshard-bench/device_step.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <vector>

#include "core/comm/communicator.h"
#include "core/comm/store.h"
#include "core/device/buffer.h"
#include "core/device/host_sync.h"
#include "core/kernels/kernel_table.h"
#include "core/sharding/sharded_engine.h"

namespace hps::bench {
namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void fail(const std::string& what, const Status& s) {
  std::fprintf(stderr, "hpshard-bench: error: %s: %s\n", what.c_str(), s.to_string().c_str());
  std::exit(1);
}
void check(const Status& s, const std::string& what) {
  if (!s.ok()) fail(what, s);
}
template <typename T>
T take(StatusOr<T> v, const std::string& what) {
  if (!v.ok()) fail(what, v.status());
  return std::move(v).value();
}

float initial_value(size_t layer, size_t i) {
  return static_cast<float>(std::sin(0.37 * static_cast<double>(i) + static_cast<double>(layer))) *
         0.05f;
}

// One engine, its compute stream, and the synthetic gradients it copies in.
struct Contender {
  std::unique_ptr<Stream> compute;  // outlives the engine that uses it
  std::unique_ptr<ShardedEngine> engine;
};

Contender make(int32_t stage, const std::shared_ptr<Communicator>& comm, const DeviceStepConfig& c,
               const std::vector<float>& host_init) {
  Contender k;
  k.compute = take(create_stream(c.device), "compute stream");
  EngineOptions o;
  o.optimizer = c.adamw ? OptimizerKind::kAdamW : OptimizerKind::kSgd;
  o.sgd = {0.01f, 0.9f, 0.0f, false};
  o.clip_max_norm = c.clip;
  o.compute_stream = k.compute.get();
  k.engine = take(create_sharded_engine(stage, comm, nullptr, o), "engine");
  const auto w = static_cast<size_t>(c.width);
  for (int32_t l = 0; l < c.depth; ++l) {
    ParamSpec weight{"layer" + std::to_string(l) + ".weight", {c.width, c.width}, DType::kFloat32};
    weight.unit = l;
    ParamSpec bias{"layer" + std::to_string(l) + ".bias", {c.width}, DType::kFloat32};
    bias.unit = l;
    take(k.engine->add_param(weight), "add_param");
    take(k.engine->add_param(bias), "add_param");
  }
  check(k.engine->seal(), "seal");
  // Initial values: one host-to-device copy per parameter at set-up.
  for (size_t p = 0; p < static_cast<size_t>(2 * c.depth); ++p) {
    void* view = take(k.engine->param_data(p), "param_data");
    const size_t n = p % 2 == 0 ? w * w : w;
    check(k.compute->memcpy_async(view, host_init.data(), n * sizeof(float)), "init copy");
  }
  check(k.compute->synchronize(), "init");
  check(k.engine->broadcast_parameters(), "broadcast_parameters");
  return k;
}

// One step: forward (gather, release per unit), backward (gather, a gradient copied in on
// the compute stream, check-ins, release, last unit first), step.
void step(Contender& k, const DeviceStepConfig& c, const DeviceBuffer& gradient) {
  ShardedEngine& e = *k.engine;
  const auto w = static_cast<size_t>(c.width);
  for (int32_t l = 0; l < c.depth; ++l) {
    check(e.gather(l), "gather");
    check(e.release(l), "release");
  }
  for (int32_t l = c.depth; l-- > 0;) {
    check(e.gather(l), "gather");
    for (size_t p : {static_cast<size_t>(2 * l), static_cast<size_t>(2 * l + 1)}) {
      void* g = take(e.grad_data(p), "grad_data");
      const size_t n = p % 2 == 0 ? w * w : w;
      check(k.compute->memcpy_async(g, gradient.data().get(), n * sizeof(float)), "gradient");
      check(e.grad_ready(p, k.compute.get()), "grad_ready");
    }
    check(e.release(l), "release");
  }
  check(e.step(), "step");
}

}  // namespace

DeviceStepResult run_device_step(const DeviceStepConfig& c) {
  check(check_device(c.device), "device");
  DeviceStepResult r;
  const auto w = static_cast<size_t>(c.width);
  r.parameters = (w * w + w) * static_cast<size_t>(c.depth);
  auto store = make_in_memory_store();
  CommOptions co;
  co.name = "bench";
  std::shared_ptr<Communicator> comm =
      take(create_communicator(store, 0, 1, c.device, co), "communicator");

  std::vector<float> host_init(w * w), host_grad(w * w);
  for (size_t i = 0; i < w * w; ++i) {
    host_init[i] = initial_value(0, i);
    host_grad[i] = static_cast<float>(std::cos(0.11 * static_cast<double>(i))) * 1e-2f;
  }
  Contender s2 = make(2, comm, c, host_init);
  Contender s3 = make(3, comm, c, host_init);
  DeviceBuffer gradient = take(DeviceBuffer::allocate(c.device, w * w * sizeof(float)), "grad");
  check(s2.compute->memcpy_async(gradient.data().get(), host_grad.data(), w * w * sizeof(float)),
        "gradient copy");
  check(s2.compute->synchronize(), "gradient copy");

  auto timed = [&](Contender& k, uint64_t& max_syncs) {
    for (int32_t i = 0; i < c.warmup; ++i) step(k, c, gradient);
    check(k.engine->synchronize(), "synchronize");
    std::vector<double> per_step;
    for (int32_t rep = 0; rep < c.reps; ++rep) {
      const auto start = Clock::now();
      for (int32_t i = 0; i < c.steps; ++i) {
        const uint64_t before = host_sync_count_thread();
        step(k, c, gradient);
        max_syncs = std::max(max_syncs, host_sync_count_thread() - before);
      }
      check(k.engine->synchronize(), "synchronize");
      per_step.push_back(std::chrono::duration<double>(Clock::now() - start).count() / c.steps);
    }
    return median(per_step);
  };
  r.stage2_seconds = timed(s2, r.stage2_host_syncs_max);
  r.stage3_seconds = timed(s3, r.stage3_host_syncs_max);

  // The same training, so the two engines hold the same parameters.
  auto all2 = take(s2.engine->gather_all(), "gather_all");
  auto all3 = take(s3.engine->gather_all(), "gather_all");
  for (size_t p = 0; p < all2.size(); ++p) {
    for (size_t i = 0; i < all2[p].size(); ++i) {
      r.stage2_max_diff =
          std::max(r.stage2_max_diff, static_cast<double>(std::fabs(all2[p][i] - all3[p][i])));
    }
  }

  // The reference: the optimizer kernel alone over every parameter, per step.
  const Kernels* kernels = take(kernels_for(c.device.type), "kernels");
  auto stream = take(create_stream(c.device), "stream");
  const size_t n = r.parameters;
  DeviceBuffer param = take(DeviceBuffer::allocate(c.device, n * sizeof(float)), "param");
  DeviceBuffer grad = take(DeviceBuffer::allocate(c.device, n * sizeof(float)), "grad");
  DeviceBuffer m = take(DeviceBuffer::allocate(c.device, n * sizeof(float)), "m");
  DeviceBuffer v = take(DeviceBuffer::allocate(c.device, n * sizeof(float)), "v");
  DeviceBuffer state = take(DeviceBuffer::allocate(c.device, sizeof(StepState)), "state");
  for (DeviceBuffer* b : {&param, &grad, &m, &v}) {
    check(kernels->fill(*stream, DType::kFloat32, b->data(), n, 0.001), "fill");
  }
  StepRule rule;
  rule.adamw = c.adamw;
  check(kernels->write_step_state(*stream, state.data<StepState>(), StepState{}), "state");
  auto optimizer_step = [&] {
    check(kernels->update_step_state(*stream, state.data<StepState>(), rule), "update");
    if (c.adamw) {
      check(kernels->adamw(*stream, {param.data<float>(), grad.data<const float>(), m.data<float>(),
                                     v.data<float>(), n, AdamWHyper{},
                                     state.data<const StepState>(), nullptr}),
            "adamw");
    } else {
      check(kernels->sgd(*stream, {param.data<float>(), grad.data<const float>(), m.data<float>(),
                                   n, SgdHyper{0.01f, 0.9f, 0.0f, false},
                                   state.data<const StepState>(), nullptr}),
            "sgd");
    }
  };
  for (int32_t i = 0; i < c.warmup; ++i) optimizer_step();
  check(stream->synchronize(), "synchronize");
  std::vector<double> per_step;
  for (int32_t rep = 0; rep < c.reps; ++rep) {
    const auto start = Clock::now();
    for (int32_t i = 0; i < c.steps; ++i) optimizer_step();
    check(stream->synchronize(), "synchronize");
    per_step.push_back(std::chrono::duration<double>(Clock::now() - start).count() / c.steps);
  }
  r.optimizer_seconds = median(per_step);
  return r;
}

void print_device_step(const DeviceStepConfig& c, const DeviceStepResult& r) {
  std::printf(
      "hpshard-bench step --device %s: the runtime's step at world size 1, no model "
      "compute\n",
      c.device.to_string().c_str());
  std::printf("model: %d layers of %dx%d + bias (%zu parameters), %s, clip %g\n", c.depth, c.width,
              c.width, r.parameters, c.adamw ? "AdamW" : "SGD momentum 0.9", c.clip);
  std::printf("%-10s %14s %12s %18s\n", "contender", "ms per step", "x optimizer",
              "host syncs/step");
  auto row = [&](const char* name, double s, uint64_t syncs) {
    std::printf("%-10s %14.3f %12.2f %18llu\n", name, s * 1e3,
                r.optimizer_seconds > 0 ? s / r.optimizer_seconds : 0.0,
                static_cast<unsigned long long>(syncs));
  };
  row("stage 2", r.stage2_seconds, r.stage2_host_syncs_max);
  row("stage 3", r.stage3_seconds, r.stage3_host_syncs_max);
  std::printf("%-10s %14.3f %12.2f %18s\n", "optimizer", r.optimizer_seconds * 1e3, 1.0, "-");
  std::printf("stage 2 vs stage 3 parameters after the same steps: max |diff| %.3g\n",
              r.stage2_max_diff);
}

Json device_step_to_json(const DeviceStepConfig& c, const DeviceStepResult& r) {
  return {{"family", "step"},
          {"device", c.device.to_string()},
          {"width", c.width},
          {"depth", c.depth},
          {"parameters", r.parameters},
          {"optimizer", c.adamw ? "adamw" : "sgd"},
          {"clip", c.clip},
          {"stage2_seconds", r.stage2_seconds},
          {"stage3_seconds", r.stage3_seconds},
          {"optimizer_seconds", r.optimizer_seconds},
          {"stage2_host_syncs_max", r.stage2_host_syncs_max},
          {"stage3_host_syncs_max", r.stage3_host_syncs_max},
          {"stage2_vs_stage3_max_diff", r.stage2_max_diff}};
}

}  // namespace hps::bench
