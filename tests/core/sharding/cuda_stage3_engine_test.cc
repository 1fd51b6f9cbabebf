// Stage 3 on a CUDA GPU over NCCL at world size 1 (label gpu; skipped where no device or
// no loadable NCCL is present): training equals a CPU reference computed here, and the
// steady steps make no host sync, counted twice: by hpshard's counter, and independently
// by wrapping the CUDA runtime's synchronize and device-to-host copy entry points at link
// time (-Wl,--wrap=..., see tests/CMakeLists.txt): every call hpshard's code makes to them
// lands in the __wrap_ functions below.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "core/common/config.h"
#include "core/device/device.h"
#include "core/device/host_sync.h"
#include "core/kernels/norm.h"
#include "core/kernels/optimizer.h"
#include "core/sharding/sharded_engine.h"

#if HPS_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "core/device/cuda/stream.h"
#include "core/sharding/cuda_stage3_engine.h"

namespace {
std::atomic<bool> counting{false};
std::atomic<int> runtime_syncs{0};
void note(const char*) {
  if (counting) ++runtime_syncs;
}
bool device_to_host(cudaMemcpyKind kind) {
  return kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDefault;
}
}  // namespace

extern "C" {
cudaError_t __real_cudaStreamSynchronize(cudaStream_t);
cudaError_t __real_cudaDeviceSynchronize();
cudaError_t __real_cudaEventSynchronize(cudaEvent_t);
cudaError_t __real_cudaMemcpy(void*, const void*, size_t, cudaMemcpyKind);
cudaError_t __real_cudaMemcpyAsync(void*, const void*, size_t, cudaMemcpyKind, cudaStream_t);

cudaError_t __wrap_cudaStreamSynchronize(cudaStream_t s) {
  note("cudaStreamSynchronize");
  return __real_cudaStreamSynchronize(s);
}
cudaError_t __wrap_cudaDeviceSynchronize() {
  note("cudaDeviceSynchronize");
  return __real_cudaDeviceSynchronize();
}
cudaError_t __wrap_cudaEventSynchronize(cudaEvent_t e) {
  note("cudaEventSynchronize");
  return __real_cudaEventSynchronize(e);
}
cudaError_t __wrap_cudaMemcpy(void* d, const void* s, size_t n, cudaMemcpyKind k) {
  if (device_to_host(k)) note("cudaMemcpy D2H");
  return __real_cudaMemcpy(d, s, n, k);
}
cudaError_t __wrap_cudaMemcpyAsync(void* d, const void* s, size_t n, cudaMemcpyKind k,
                                   cudaStream_t st) {
  if (device_to_host(k)) note("cudaMemcpyAsync D2H");
  return __real_cudaMemcpyAsync(d, s, n, k, st);
}
}
#endif

namespace hps {
namespace {

#if HPS_HAVE_CUDA

// Three units of two parameters each, odd sizes (padding and uneven parts).
struct Model {
  std::vector<ParamSpec> specs;
  std::vector<std::vector<float>> init, target;
  Model() {
    const std::vector<int64_t> sizes = {37, 5, 300, 17, 1025, 3};
    for (size_t i = 0; i < sizes.size(); ++i) {
      ParamSpec p{std::string("p").append(std::to_string(i)), {sizes[i]}, DType::kFloat32};
      p.unit = static_cast<int32_t>(i / 2);
      specs.push_back(p);
      std::vector<float> w(static_cast<size_t>(sizes[i])), t(w.size());
      for (size_t k = 0; k < w.size(); ++k) {
        w[k] = static_cast<float>(std::sin(0.3 * double(i) + 0.11 * double(k)));
        t[k] = static_cast<float>(0.5 * std::cos(0.7 * double(i) + 0.05 * double(k)));
      }
      init.push_back(w);
      target.push_back(t);
    }
  }
};

// Loss of micro-batch m: ½ Σ (w − t·(1 + m/4))², so the gradient is w − t·(1 + m/4).
float target_scale(int micro) { return 1.0f + 0.25f * static_cast<float>(micro); }

class CudaStage3EngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (device_count(DeviceType::kCuda) == 0) {
      GTEST_SKIP() << "no usable CUDA device (or hpshard built without CUDA)";
    }
    auto c = create_communicator(make_in_memory_store(), 0, 1, Device::cuda(0));
    if (c.status().code() == StatusCode::kUnavailable) GTEST_SKIP() << c.status().message();
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    comm_ = std::shared_ptr<Communicator>(std::move(c).value());
  }
  std::shared_ptr<Communicator> comm_;
};

TEST_F(CudaStage3EngineTest, EqualsTheCpuReferenceWithNoHostSyncInSteadySteps) {
  const Model model;
  const int kSteps = 5, kMicro = 2;
  const double kMaxNorm = 0.5;
  auto compute_or = create_stream(Device::cuda(0));
  ASSERT_TRUE(compute_or.ok());
  auto compute = std::move(compute_or).value();
  const cudaStream_t cs = static_cast<cuda::CudaStream&>(*compute).native();

  EngineOptions o;
  o.optimizer = OptimizerKind::kAdamW;
  o.adamw.learning_rate = 0.05f;
  o.clip_max_norm = kMaxNorm;
  o.accumulation_steps = kMicro;
  o.prefetch_window = 2;
  o.compute_stream = compute.get();
  auto engine_or = create_sharded_engine(3, comm_, nullptr, o);
  ASSERT_TRUE(engine_or.ok()) << engine_or.status().to_string();
  auto& engine = **engine_or;
  for (const auto& p : model.specs) ASSERT_TRUE(engine.add_param(p).ok());
  ASSERT_TRUE(engine.seal().ok());
  for (size_t i = 0; i < model.specs.size(); ++i) {
    float* w = *engine.param(i);
    ASSERT_EQ(cudaMemcpy(w, model.init[i].data(), model.init[i].size() * 4, cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  ASSERT_TRUE(engine.broadcast_parameters().ok());
  // The negated targets of each micro-batch, on the device.
  std::vector<std::vector<float*>> neg(kMicro);
  for (int m = 0; m < kMicro; ++m) {
    for (size_t i = 0; i < model.specs.size(); ++i) {
      std::vector<float> t(model.target[i]);
      for (float& x : t) x *= -target_scale(m);
      float* d = nullptr;
      ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&d), t.size() * 4), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(d, t.data(), t.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
      neg[m].push_back(d);
    }
  }
  std::vector<float*> scratch;  // w copies: grad += w − t·s, as two kernels
  for (const auto& w : model.init) {
    float* d = nullptr;
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&d), w.size() * 4), cudaSuccess);
    scratch.push_back(d);
  }

  const int32_t units = 3;
  for (int step = 0; step < kSteps; ++step) {
    if (step == 1) {  // steady from the second step on (the first records the order)
      host_sync_reset();
      runtime_syncs = 0;
      counting = true;
    }
    for (int m = 0; m < kMicro; ++m) {
      for (int32_t u = 0; u < units; ++u) {  // "forward": gather, read, release
        ASSERT_TRUE(engine.gather(u).ok());
        ASSERT_TRUE(engine.release(u).ok());
      }
      for (int32_t u = units; u-- > 0;) {  // "backward"
        ASSERT_TRUE(engine.gather(u).ok());
        for (size_t i : {size_t(2 * u), size_t(2 * u + 1)}) {
          const size_t n = model.init[i].size();
          float* w = *engine.param(i);
          float* g = *engine.grad(i);
          ASSERT_EQ(cudaMemcpyAsync(scratch[i], w, n * 4, cudaMemcpyDeviceToDevice, cs),
                    cudaSuccess);
          ASSERT_TRUE(cuda::accumulate(scratch[i], neg[m][i], n, cs).ok());
          ASSERT_TRUE(cuda::accumulate(g, scratch[i], n, cs).ok());
          ASSERT_TRUE(engine.grad_ready(i, nullptr).ok());
        }
        ASSERT_TRUE(engine.release(u).ok());
      }
    }
    ASSERT_TRUE(engine.step().ok());
  }
  counting = false;
  EXPECT_EQ(host_sync_count_thread(), 0u) << "hpshard's counter: host syncs in steady steps";
  EXPECT_EQ(runtime_syncs.load(), 0)
      << "CUDA runtime synchronize / device-to-host calls in steady steps";
  ASSERT_TRUE(engine.synchronize().ok());
  auto got_or = engine.gather_all();
  ASSERT_TRUE(got_or.ok()) << got_or.status().to_string();

  // The CPU reference: the same steps with the CPU kernels on full parameters.
  std::vector<std::vector<float>> w = model.init, ma, va;
  for (const auto& x : w) {
    ma.emplace_back(x.size(), 0.0f);
    va.emplace_back(x.size(), 0.0f);
  }
  for (int step = 1; step <= kSteps; ++step) {
    std::vector<std::vector<float>> g;
    double squares = 0;
    for (size_t i = 0; i < w.size(); ++i) {
      std::vector<float> gi(w[i].size(), 0.0f);
      for (int m = 0; m < kMicro; ++m) {
        for (size_t k = 0; k < gi.size(); ++k) {
          gi[k] += w[i][k] + (-target_scale(m) * model.target[i][k]);
        }
      }
      for (float& x : gi) x *= 1.0f / kMicro;
      squares += cpu::sum_of_squares(DType::kFloat32, gi.data(), gi.size());
      g.push_back(gi);
    }
    const double norm = std::sqrt(squares);
    const float coef = static_cast<float>(kMaxNorm / (std::max(norm, kMaxNorm) + 1e-6));
    for (size_t i = 0; i < w.size(); ++i) {
      cpu::adamw(w[i].data(), g[i].data(), ma[i].data(), va[i].data(), w[i].size(), o.adamw, step,
                 &coef, 1.0f);
    }
  }
  for (size_t i = 0; i < w.size(); ++i) {
    ASSERT_EQ((*got_or)[i].size(), w[i].size());
    for (size_t k = 0; k < w[i].size(); ++k) {
      // Summation orders of the norm differ (CPU vs the GPU's blocks): 1e-5 relative.
      EXPECT_NEAR((*got_or)[i][k], w[i][k], 1e-5 * std::max(1.0f, std::fabs(w[i][k])))
          << "parameter " << i << " element " << k;
    }
  }
  auto* s3 = dynamic_cast<CudaStage3Engine*>(&engine);
  ASSERT_NE(s3, nullptr);
  EXPECT_GT(s3->prefetched_gathers(), 0u) << "later steps prefetch in the recorded order";
  for (auto& v : neg)
    for (float* d : v) cudaFree(d);
  for (float* d : scratch) cudaFree(d);
}

TEST_F(CudaStage3EngineTest, RefusesWhatItDoesNotSupport) {
  EngineOptions o;
  o.dynamic_loss_scaling = true;
  EXPECT_EQ(create_sharded_engine(3, comm_, nullptr, o).status().code(),
            StatusCode::kUnimplemented);
  EXPECT_EQ(create_sharded_engine(2, comm_, nullptr, {}).status().code(),
            StatusCode::kUnimplemented);
  auto e = std::move(create_sharded_engine(3, comm_, nullptr, {})).value();
  EXPECT_EQ(e->add_param({"h", {4}, DType::kFloat16}).status().code(), StatusCode::kUnimplemented);
  ASSERT_TRUE(e->add_param({"w", {4}, DType::kFloat32}).ok());
  ASSERT_TRUE(e->seal().ok());
  EXPECT_EQ(e->gather(0).code(), StatusCode::kFailedPrecondition);  // before broadcast
  ASSERT_TRUE(e->broadcast_parameters().ok());
  EXPECT_EQ(e->gather(7).code(), StatusCode::kNotFound);
  EXPECT_EQ(e->step().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(e->param(0).status().code(), StatusCode::kFailedPrecondition);  // not gathered
}

#else

TEST(CudaStage3Engine, Skipped) { GTEST_SKIP() << "hpshard built without CUDA"; }

#endif

}  // namespace
}  // namespace hps
