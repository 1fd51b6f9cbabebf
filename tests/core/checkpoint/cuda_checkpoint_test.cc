// Checkpoints of a CUDA engine (label gpu; skipped without a device): world size 1 over
// NCCL, the checkpoint's agreement over the CPU group of one (core/comm/self where the build
// has no Gloo, as on the GPU machine). The snapshot is taken in stream order into page-locked
// staging (device-to-host copies on a side stream): the steps overlapping the save count 0
// host syncs in the engine's calls; a fresh CUDA engine loads it and continues bitwise equal;
// a CPU engine loads the same checkpoint and continues within 1e-6 of the CUDA run.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/checkpoint/checkpointer.h"
#include "core/comm/store.h"
#include "core/device/host_sync.h"
#include "core/sharding/sharded_engine.h"
#include "tests/core/checkpoint/temp_dir.h"
#include "tests/core/comm/comm_test_util.h"

namespace hps {
namespace {

struct Param {
  const char* name;
  std::vector<int64_t> shape;
  DType dtype;
};
const std::vector<Param> kParams = {{"w0", {1000}, DType::kFloat32},
                                    {"w1", {37, 3}, DType::kFloat32},
                                    {"w2", {77}, DType::kBFloat16}};

size_t numel(const Param& p) {
  size_t n = 1;
  for (int64_t d : p.shape) n *= static_cast<size_t>(d);
  return n;
}
double initial(size_t p, size_t i) { return std::cos(0.1 * static_cast<double>(p * 31 + i)); }
double gradient(int step, size_t p, size_t i) {
  return std::sin(0.05 * static_cast<double>((i + 1) * (p + 2)) + 0.3 * step);
}

// One engine on `device` (world size 1) with its checkpointer under `root`.
struct EngineRun {
  std::unique_ptr<Stream> compute;  // CUDA: the framework's stream; CPU: unused
  std::unique_ptr<ShardedEngine> engine;
  std::unique_ptr<Checkpointer> checkpointer;
  uint64_t engine_syncs = 0;  // host syncs counted inside the engine's calls of the steps

  EngineRun(Device device, const std::string& root) {
    auto comm = create_communicator(make_in_memory_store(), 0, 1, device);
    EXPECT_TRUE(comm.ok()) << comm.status().to_string();
    auto cpu_group = create_communicator(make_in_memory_store(), 0, 1, Device::cpu());
    EXPECT_TRUE(cpu_group.ok()) << cpu_group.status().to_string();
    if (!comm.ok() || !cpu_group.ok()) return;
    EngineOptions o;
    o.optimizer = OptimizerKind::kAdamW;
    o.adamw = {1e-2f, 0.9f, 0.99f, 1e-8f, 0.05f};
    if (device.type == DeviceType::kCuda) {
      auto s = create_stream(device);
      EXPECT_TRUE(s.ok());
      compute = std::move(*s);
      o.compute_stream = compute.get();
    } else {
      auto s = default_compute_stream(device);
      EXPECT_TRUE(s.ok());
      compute = std::move(*s);
    }
    auto e = create_sharded_engine(2, std::shared_ptr<Communicator>(std::move(*comm)), nullptr, o);
    EXPECT_TRUE(e.ok()) << e.status().to_string();
    if (!e.ok()) return;
    engine = std::move(*e);
    for (const Param& p : kParams) {
      ParamSpec spec{p.name, p.shape, p.dtype, true};
      spec.unit = 0;
      EXPECT_TRUE(engine->add_param(spec).ok());
    }
    EXPECT_TRUE(engine->seal().ok());
    for (size_t p = 0; p < kParams.size(); ++p)
      upload(
          p, [p](size_t i) { return initial(p, i); }, true);
    EXPECT_TRUE(engine->broadcast_parameters().ok());
    auto* state = dynamic_cast<Checkpointable*>(engine.get());
    EXPECT_NE(state, nullptr);
    CheckpointOptions co;
    co.chunk_bytes = 256;
    auto c = Checkpointer::create(*state, std::shared_ptr<Communicator>(std::move(*cpu_group)),
                                  root, co);
    EXPECT_TRUE(c.ok()) << c.status().to_string();
    if (c.ok()) checkpointer = std::move(*c);
  }

  // Writes values into parameter p (param_data) or its gradient (grad_data).
  template <typename F>
  void upload(size_t p, F value, bool param) {
    const DType d = kParams[p].dtype;
    std::vector<uint8_t> host(numel(kParams[p]) * dtype_size(d));
    for (size_t i = 0; i < numel(kParams[p]); ++i) {
      testing_util::store_element(d, host.data(), i, value(i));
    }
    auto view = param ? engine->param_data(p) : engine->grad_data(p);
    ASSERT_TRUE(view.ok()) << view.status().to_string();
    ASSERT_TRUE(compute->memcpy_async(*view, host.data(), host.size()).ok());
    ASSERT_TRUE(compute->synchronize().ok());  // the host buffer goes after this
  }

  template <typename F>
  void engine_call(F fn) {
    const uint64_t before = host_sync_count_thread();
    const Status s = fn();
    engine_syncs += host_sync_count_thread() - before;
    ASSERT_TRUE(s.ok()) << s.to_string();
  }

  void train_step(int step) {
    engine_call([&] { return engine->gather(0); });
    for (size_t p = 0; p < kParams.size(); ++p) {
      upload(
          p, [step, p](size_t i) { return gradient(step, p, i); }, false);
      engine_call([&] { return engine->grad_ready(p, compute.get()); });
    }
    engine_call([&] { return engine->release(0); });
    engine_call([&] { return engine->step(); });
  }

  // Every state tensor's bytes, by name (a host copy; after synchronize()).
  std::map<std::string, std::vector<uint8_t>> state_bytes() {
    EXPECT_TRUE(engine->synchronize().ok());
    std::map<std::string, std::vector<uint8_t>> out;
    auto tensors = dynamic_cast<Checkpointable*>(engine.get())->state_tensors();
    EXPECT_TRUE(tensors.ok());
    if (!tensors.ok()) return out;
    for (const StateTensor& t : *tensors) {
      std::vector<uint8_t> bytes((t.end - t.begin) * dtype_size(t.dtype));
      if (!bytes.empty()) {
        EXPECT_TRUE(copy_to_host(*compute, bytes.data(), t.data, bytes.size()).ok()) << t.name;
      }
      out[t.name] = std::move(bytes);
    }
    return out;
  }
};

using testing_util::TempDir;

TEST(CudaCheckpoint, SavesInStreamOrderAndResumesOnEitherDevice) {
  if (device_count(DeviceType::kCuda) == 0) GTEST_SKIP() << "no CUDA device";
  TempDir dir;
  const int n = 2, m = 3;
  std::map<std::string, std::vector<uint8_t>> at_save, after;
  std::vector<std::vector<float>> full_after;
  {
    EngineRun a(Device::cuda(0), dir.path());
    ASSERT_TRUE(a.engine && a.checkpointer);
    for (int s = 0; s < n; ++s) a.train_step(s);
    at_save = a.state_bytes();
    host_sync_reset();
    const uint64_t before = host_sync_count_thread();
    auto work = a.checkpointer->save("cuda", {{"step", std::to_string(n)}});
    ASSERT_TRUE(work.ok()) << work.status().to_string();
    EXPECT_EQ(host_sync_count_thread() - before, 0u) << "save() synced the host";
    a.engine_syncs = 0;
    for (int s = n; s < n + m; ++s) a.train_step(s);
    EXPECT_EQ(a.engine_syncs, 0u) << "the steps beside the save synced the host";
    ASSERT_TRUE((*work)->wait().ok()) << (*work)->status().to_string();
    after = a.state_bytes();
    auto full = a.engine->gather_all();
    ASSERT_TRUE(full.ok());
    full_after = std::move(*full);
  }
  ASSERT_TRUE(verify_checkpoint(dir.path() + "/cuda").ok());
  {
    // A fresh CUDA engine: what it loads is the state at save(), not what the steps after
    // it made; the same steps then give the same bytes.
    EngineRun b(Device::cuda(0), dir.path());
    ASSERT_TRUE(b.engine && b.checkpointer);
    auto report = b.checkpointer->load("cuda");
    ASSERT_TRUE(report.ok()) << report.status().to_string();
    EXPECT_EQ(report->metadata.at("step"), std::to_string(n));
    EXPECT_EQ(b.state_bytes(), at_save);
    for (int s = n; s < n + m; ++s) b.train_step(s);
    EXPECT_EQ(b.state_bytes(), after);
  }
  {
    // A CPU engine loads the same checkpoint (the same bytes) and continues within 1e-6.
    EngineRun c(Device::cpu(), dir.path());
    ASSERT_TRUE(c.engine && c.checkpointer);
    ASSERT_TRUE(c.checkpointer->load("cuda").ok());
    EXPECT_EQ(c.state_bytes(), at_save);
    for (int s = n; s < n + m; ++s) c.train_step(s);
    auto full = c.engine->gather_all();
    ASSERT_TRUE(full.ok());
    ASSERT_EQ(full->size(), full_after.size());
    for (size_t p = 0; p < full_after.size(); ++p) {
      for (size_t i = 0; i < full_after[p].size(); ++i) {
        EXPECT_NEAR((*full)[p][i], full_after[p][i],
                    1e-6 * std::max(1.0, std::fabs(double{full_after[p][i]})))
            << kParams[p].name << "[" << i << "]";
      }
    }
  }
}

}  // namespace
}  // namespace hps
