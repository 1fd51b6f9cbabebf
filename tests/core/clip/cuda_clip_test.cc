// The hybrid clip on CUDA (world size 1, an NCCL communicator) against the CPU clip of the
// same values: the same norm, coefficient and scaled gradients (bit for bit in
// deterministic mode), and no host sync in run(). Label gpu: skipped with a reason where no
// CUDA device or no loadable NCCL is present.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/clip/hybrid_clip.h"
#include "core/common/config.h"
#include "core/common/half.h"
#include "core/device/buffer.h"
#include "core/device/host_sync.h"
#include "core/device/stream.h"

namespace hps {
namespace {

#if !HPS_HAVE_CUDA

TEST(CudaClip, NeedsCuda) { GTEST_SKIP() << "hpshard built without CUDA"; }

#else

struct Param {
  size_t size;
  DType dtype;
  bool is_distributed, need_clip, shared_not_first;
};
const std::vector<Param> kModel = {
    {4099, DType::kFloat32, true, true, false}, {300, DType::kBFloat16, false, true, false},
    {1025, DType::kFloat16, true, true, false}, {77, DType::kFloat64, false, true, false},
    {64, DType::kFloat32, false, false, false}, {20000, DType::kFloat32, false, true, false},
    {96, DType::kFloat64, true, true, false},   {300, DType::kBFloat16, false, true, true},
};

std::vector<unsigned char> gradient_bytes(size_t p, double nan_at = -1) {
  const Param& param = kModel[p];
  std::vector<unsigned char> bytes(param.size * dtype_size(param.dtype));
  for (size_t i = 0; i < param.size; ++i) {
    double v = std::sin(static_cast<double>(p * 31 + i) * 0.37) * (1.0 + static_cast<double>(p));
    if (static_cast<double>(i) == nan_at) v = NAN;
    switch (param.dtype) {
      case DType::kFloat32: {
        const auto f = static_cast<float>(v);
        std::memcpy(&bytes[i * 4], &f, 4);
        break;
      }
      case DType::kFloat64: std::memcpy(&bytes[i * 8], &v, 8); break;
      case DType::kFloat16: {
        const uint16_t h = float_to_half_bits(static_cast<float>(v));
        std::memcpy(&bytes[i * 2], &h, 2);
        break;
      }
      default: {
        const uint16_t h = float_to_bf16_bits(static_cast<float>(v));
        std::memcpy(&bytes[i * 2], &h, 2);
        break;
      }
    }
  }
  return bytes;
}

struct Outcome {
  float norm = 0, coefficient = 0;
  std::vector<std::vector<unsigned char> > gradients;
};

class CudaClipTest : public testing::Test {
 protected:
  void SetUp() override {
    if (device_count(DeviceType::kCuda) == 0) {
      GTEST_SKIP() << "no usable CUDA device (or hpshard built without CUDA)";
    }
    CommOptions options;
    options.timeout = std::chrono::seconds(30);  // below ctest's timeout: a hang fails here
    auto c = create_communicator(make_in_memory_store(), 0, 1, Device::cuda(0), options);
    if (c.status().code() == StatusCode::kUnavailable) GTEST_SKIP() << c.status().message();
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    comm_ = std::shared_ptr<Communicator>(std::move(c).value());
  }

  // The CPU clip of the model's gradients.
  static Outcome cpu_clip(const ClipOptions& options, bool scale, double nan_at) {
    Outcome out;
    auto clip = std::move(HybridClip::create(nullptr, nullptr, nullptr, options)).value();
    for (size_t p = 0; p < kModel.size(); ++p) out.gradients.push_back(gradient_bytes(p, nan_at));
    add_all(*clip, out.gradients);
    EXPECT_TRUE(clip->seal().ok());
    auto stream = std::move(create_stream(Device::cpu())).value();
    EXPECT_TRUE(clip->run(*stream, &out.norm, scale).ok());
    EXPECT_TRUE(stream->synchronize().ok());
    out.coefficient = *clip->coefficient();
    return out;
  }

  // The CUDA clip of the same gradients, with `comm_` as every group. Host data moves by
  // stream-ordered copies the test waits for.
  Outcome cuda_clip(const ClipOptions& options, bool scale, double nan_at) {
    Outcome out;
    auto created = HybridClip::create(comm_, comm_, comm_, options);
    EXPECT_TRUE(created.ok()) << created.status().to_string();
    auto clip = std::move(created).value();
    auto stream = std::move(create_stream(Device::cuda(0))).value();
    auto copy = [&](void* dst, const void* src, size_t bytes) {
      EXPECT_TRUE(stream->memcpy_async(dst, src, bytes).ok());
      EXPECT_TRUE(stream->synchronize().ok());
    };
    std::vector<DeviceBuffer> device;
    for (size_t p = 0; p < kModel.size(); ++p) {
      out.gradients.push_back(gradient_bytes(p, nan_at));
      device.push_back(
          std::move(DeviceBuffer::allocate(Device::cuda(0), out.gradients[p].size())).value());
      copy(device[p].data().get(), out.gradients[p].data(), out.gradients[p].size());
    }
    for (size_t p = 0; p < kModel.size(); ++p) {
      ClipTensor t{device[p].data().get(),   kModel[p].size,      kModel[p].dtype,
                   kModel[p].is_distributed, kModel[p].need_clip, kModel[p].shared_not_first};
      EXPECT_TRUE(clip->add_tensor(t).ok());
    }
    EXPECT_TRUE(clip->seal().ok());
    float initial = 0;
    copy(&initial, clip->coefficient(), sizeof(float));
    EXPECT_EQ(initial, 1.0f) << "the coefficient reads 1 before the first run()";
    auto norm_memory = std::move(DeviceBuffer::allocate(Device::cuda(0), sizeof(float))).value();
    auto* norm_device = norm_memory.data<float>().get();
    for (int repeat = 0; repeat < 2; ++repeat) {  // partials are zeroed on every run
      if (repeat == 1) {
        for (size_t p = 0; p < kModel.size(); ++p) {
          copy(device[p].data().get(), out.gradients[p].data(), out.gradients[p].size());
        }
      }
      host_sync_reset();
      const Status status = clip->run(*stream, norm_device, scale);
      EXPECT_TRUE(status.ok()) << status.to_string();
      EXPECT_EQ(host_sync_count_thread(), 0u) << "run() must not block the host";
      EXPECT_EQ(host_sync_count_total(), 0u);
      EXPECT_TRUE(stream->synchronize().ok());
    }
    copy(&out.norm, norm_device, sizeof(float));
    copy(&out.coefficient, clip->coefficient(), sizeof(float));
    for (size_t p = 0; p < kModel.size(); ++p) {
      copy(out.gradients[p].data(), device[p].data().get(), out.gradients[p].size());
    }
    return out;
  }

  static void add_all(HybridClip& clip, std::vector<std::vector<unsigned char> >& gradients) {
    for (size_t p = 0; p < kModel.size(); ++p) {
      ClipTensor t{gradients[p].data(),      kModel[p].size,      kModel[p].dtype,
                   kModel[p].is_distributed, kModel[p].need_clip, kModel[p].shared_not_first};
      EXPECT_TRUE(clip.add_tensor(t).ok());
    }
  }

  std::shared_ptr<Communicator> comm_;
};

bool same_float(float a, float b) {
  return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b) ||
         (std::isnan(a) && std::isnan(b));
}

TEST_F(CudaClipTest, DeterministicClipIsBitwiseTheCpuClip) {
  ClipOptions options;
  options.max_norm = 1.0;
  options.deterministic = true;
  const Outcome cpu = cpu_clip(options, true, -1);
  const Outcome gpu = cuda_clip(options, true, -1);
  EXPECT_TRUE(same_float(gpu.norm, cpu.norm)) << gpu.norm << " vs " << cpu.norm;
  EXPECT_TRUE(same_float(gpu.coefficient, cpu.coefficient));
  EXPECT_GT(cpu.norm, 1.0f);
  for (size_t p = 0; p < kModel.size(); ++p) {
    EXPECT_TRUE(gpu.gradients[p] == cpu.gradients[p]) << "parameter " << p;
  }
}

TEST_F(CudaClipTest, FloatClipMatchesTheCpuClip) {
  ClipOptions options;
  options.max_norm = 2.0;
  const Outcome cpu = cpu_clip(options, true, -1);
  const Outcome gpu = cuda_clip(options, true, -1);
  EXPECT_NEAR(gpu.norm, cpu.norm, 1e-5 * cpu.norm);
  EXPECT_NEAR(gpu.coefficient, cpu.coefficient, 1e-5 * cpu.coefficient);
  // fp32-and-wider gradients: within the coefficient's relative error.
  for (size_t p = 0; p < kModel.size(); ++p) {
    if (kModel[p].dtype != DType::kFloat32) continue;
    std::vector<float> a(kModel[p].size), b(kModel[p].size);
    std::memcpy(a.data(), gpu.gradients[p].data(), a.size() * 4);
    std::memcpy(b.data(), cpu.gradients[p].data(), b.size() * 4);
    for (size_t i = 0; i < a.size(); ++i)
      ASSERT_NEAR(a[i], b[i], 1e-5f * (std::fabs(b[i]) + 1e-6f));
  }
}

TEST_F(CudaClipTest, UnscaledAndNanBehaveAsOnCpu) {
  ClipOptions options;
  options.deterministic = true;
  // scale = false: gradients untouched, the coefficient is on the device.
  const Outcome cpu = cpu_clip(options, false, -1);
  const Outcome gpu = cuda_clip(options, false, -1);
  EXPECT_TRUE(same_float(gpu.coefficient, cpu.coefficient));
  for (size_t p = 0; p < kModel.size(); ++p) EXPECT_TRUE(gpu.gradients[p] == gradient_bytes(p));
  // A NaN gradient: a NaN norm and coefficient on both.
  const Outcome cpu_nan = cpu_clip(options, true, 5);
  const Outcome gpu_nan = cuda_clip(options, true, 5);
  EXPECT_TRUE(std::isnan(cpu_nan.norm));
  EXPECT_TRUE(std::isnan(gpu_nan.norm));
  EXPECT_TRUE(std::isnan(gpu_nan.coefficient));
}

TEST_F(CudaClipTest, StreamOnAnotherDeviceIsRefused) {
  auto clip = std::move(HybridClip::create(comm_, nullptr, nullptr, ClipOptions{})).value();
  ASSERT_TRUE(clip->seal().ok());
  auto cpu_stream = std::move(create_stream(Device::cpu())).value();
  float norm = 0;
  EXPECT_EQ(clip->run(*cpu_stream, &norm).code(), StatusCode::kInvalidArgument);
}

#endif  // HPS_HAVE_CUDA

}  // namespace
}  // namespace hps
