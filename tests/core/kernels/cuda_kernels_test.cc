// The CUDA norm and optimizer kernels against the CPU ones on the same data: every float
// dtype, sizes around the block and grid boundaries, the fixed-point sums bit for bit.
// Label gpu: skipped with a reason where no CUDA device is usable.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/common/config.h"
#include "core/common/half.h"
#include "core/device/device.h"
#include "core/kernels/norm.h"
#include "core/kernels/optimizer.h"

#if HPS_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "core/device/cuda/stream.h"
#endif

namespace hps {
namespace {

#if !HPS_HAVE_CUDA

TEST(CudaKernels, NeedCuda) { GTEST_SKIP() << "hpshard built without CUDA"; }

#else

class CudaKernelsTest : public testing::Test {
 protected:
  void SetUp() override {
    if (device_count(DeviceType::kCuda) == 0) {
      GTEST_SKIP() << "no usable CUDA device (or hpshard built without CUDA)";
    }
    auto s = create_stream(Device::cuda(0));
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    stream_ = std::move(s).value();
  }
  cudaStream_t native() const { return static_cast<cuda::CudaStream&>(*stream_).native(); }
  void sync() { ASSERT_TRUE(stream_->synchronize().ok()); }
  std::unique_ptr<Stream> stream_;
};

// Device memory for the test, with blocking copies (a test may block).
class DeviceBytes {
 public:
  explicit DeviceBytes(size_t bytes) : bytes_(bytes) {
    EXPECT_EQ(cudaMalloc(&pointer_, bytes == 0 ? 1 : bytes), cudaSuccess);
  }
  ~DeviceBytes() { cudaFree(pointer_); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(pointer_);
  }
  void upload(const void* host) {
    ASSERT_EQ(cudaMemcpy(pointer_, host, bytes_, cudaMemcpyHostToDevice), cudaSuccess);
  }
  void download(void* host) const {
    ASSERT_EQ(cudaMemcpy(host, pointer_, bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
  }

 private:
  void* pointer_ = nullptr;
  size_t bytes_;
};

// `count` values of `dtype` (as raw bytes) drawn from [-range, range].
std::vector<unsigned char> random_values(DType dtype, size_t count, uint32_t seed,
                                         double range = 3.0) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(-range, range);
  std::vector<unsigned char> bytes(count * dtype_size(dtype));
  for (size_t i = 0; i < count; ++i) {
    const double v = dist(rng);
    switch (dtype) {
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
      case DType::kBFloat16: {
        const uint16_t h = float_to_bf16_bits(static_cast<float>(v));
        std::memcpy(&bytes[i * 2], &h, 2);
        break;
      }
      default: break;
    }
  }
  return bytes;
}

const DType kFloatTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64};
// Around the warp (32), the block (256), one block's share (256·16), the largest grid
// (1024 blocks of 256·16) and beyond it.
const size_t kSizes[] = {0,    1,    31,   32,   33,    255,     256,     257,           4095,
                         4096, 4097, 8191, 8193, 65537, 1 << 20, 4194304, 4194304 + 4097};

TEST_F(CudaKernelsTest, SumOfSquaresMatchesCpuAndIsDeterministic) {
  for (const DType dtype : kFloatTypes) {
    for (const size_t n : kSizes) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " n=" + std::to_string(n));
      const auto host = random_values(dtype, n, static_cast<uint32_t>(n * 7 + 1));
      DeviceBytes data(host.size());
      data.upload(host.data());
      DeviceBytes out(2 * sizeof(double));
      const double start[2] = {0.5, 0.5};
      out.upload(start);
      // The scratch-taking overload, then the one that allocates in stream order.
      DeviceBytes scratch(cuda::kSumOfSquaresMaxBlocks * sizeof(double));
      ASSERT_TRUE(cuda::sum_of_squares(dtype, data.as<void>(), n, out.as<double>(),
                                       scratch.as<double>(), native())
                      .ok());
      ASSERT_TRUE(
          cuda::sum_of_squares(dtype, data.as<void>(), n, out.as<double>() + 1, native()).ok());
      sync();
      double result[2];
      out.download(result);
      EXPECT_EQ(std::bit_cast<uint64_t>(result[0]), std::bit_cast<uint64_t>(result[1]))
          << "the same launch shape must give the same bits";
      const double expected = cpu::sum_of_squares(dtype, host.data(), n);
      const double tolerance = (dtype == DType::kFloat64 ? 1e-12 : 2e-5) * (expected + 1.0);
      EXPECT_NEAR(result[0] - 0.5, expected, tolerance);
    }
  }
}

TEST_F(CudaKernelsTest, FixedSquaresAreBitwiseTheCpuOnes) {
  for (const DType dtype : kFloatTypes) {
    for (const size_t n : kSizes) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " n=" + std::to_string(n));
      const auto host = random_values(dtype, n, static_cast<uint32_t>(n * 13 + 5));
      DeviceBytes data(host.size());
      data.upload(host.data());
      // Added twice into one sum, as the clip adds several tensors.
      FixedSquares cpu_sum;
      cpu::sum_of_squares_fixed(dtype, host.data(), n, cpu_sum);
      cpu::sum_of_squares_fixed(dtype, host.data(), n / 2, cpu_sum);
      DeviceBytes out(sizeof(FixedSquares));
      const FixedSquares zero;
      out.upload(&zero);
      ASSERT_TRUE(
          cuda::sum_of_squares_fixed(dtype, data.as<void>(), n, out.as<FixedSquares>(), native())
              .ok());
      ASSERT_TRUE(cuda::sum_of_squares_fixed(dtype, data.as<void>(), n / 2, out.as<FixedSquares>(),
                                             native())
                      .ok());
      sync();
      FixedSquares gpu_sum;
      out.download(&gpu_sum);
      EXPECT_EQ(gpu_sum.slots, cpu_sum.slots);
    }
  }
}

TEST_F(CudaKernelsTest, FixedSquaresOfSpecialValues) {
  const std::vector<double> values = {0.0,   -0.0,  1e-90,    1e-30,     3.5,    -1e20,
                                      1e24,  1e30,  INFINITY, -INFINITY, NAN,    4.9e-324,
                                      1e-24, 2e-24, 0x1p-80,  0x1p-81,   0x1p79, 0x1p80};
  for (const DType dtype : {DType::kFloat64, DType::kFloat32}) {
    SCOPED_TRACE(dtype_name(dtype));
    std::vector<unsigned char> host(values.size() * dtype_size(dtype));
    for (size_t i = 0; i < values.size(); ++i) {
      if (dtype == DType::kFloat64) {
        std::memcpy(&host[i * 8], &values[i], 8);
      } else {
        const auto f = static_cast<float>(values[i]);
        std::memcpy(&host[i * 4], &f, 4);
      }
    }
    DeviceBytes data(host.size());
    data.upload(host.data());
    FixedSquares cpu_sum;
    cpu::sum_of_squares_fixed(dtype, host.data(), values.size(), cpu_sum);
    DeviceBytes out(sizeof(FixedSquares));
    const FixedSquares zero;
    out.upload(&zero);
    ASSERT_TRUE(cuda::sum_of_squares_fixed(dtype, data.as<void>(), values.size(),
                                           out.as<FixedSquares>(), native())
                    .ok());
    sync();
    FixedSquares gpu_sum;
    out.download(&gpu_sum);
    EXPECT_EQ(gpu_sum.slots, cpu_sum.slots);
    EXPECT_GT(gpu_sum.slots[FixedSquares::kDigits + 1], 0);  // the NaN was counted
  }
}

TEST_F(CudaKernelsTest, ScaleMatchesCpuBitwise) {
  const double coefficient = 0.3712345678901234;
  const float coefficient_fp32 = 0.7123f;
  DeviceBytes c64(sizeof(double)), c32(sizeof(float));
  c64.upload(&coefficient);
  c32.upload(&coefficient_fp32);
  for (const DType dtype : kFloatTypes) {
    for (const size_t n : {size_t{0}, size_t{1}, size_t{257}, size_t{4097}, size_t{1} << 21}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " n=" + std::to_string(n));
      const auto host = random_values(dtype, n, static_cast<uint32_t>(n + 3), 1e4);
      DeviceBytes data(host.size());
      data.upload(host.data());
      ASSERT_TRUE(cuda::scale(dtype, data.as<void>(), n, c64.as<double>(), native()).ok());
      ASSERT_TRUE(cuda::scale(dtype, data.as<void>(), n, c32.as<float>(), native()).ok());
      sync();
      auto expected = host;
      cpu::scale(dtype, expected.data(), n, coefficient);
      cpu::scale(dtype, expected.data(), n, static_cast<double>(coefficient_fp32));
      std::vector<unsigned char> result(host.size());
      data.download(result.data());
      EXPECT_TRUE(result == expected);
    }
  }
}

// The CPU clip's arithmetic (hybrid_clip.cc) on the host.
void expected_clip(double squares, double max_norm, float& norm, float& coefficient) {
  const double n = std::sqrt(squares);
  const double c = max_norm / ((n < max_norm ? max_norm : n) + 1e-6);
  norm = static_cast<float>(n);
  coefficient = static_cast<float>(c);
}

bool same_float(float a, float b) {
  return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b) ||
         (std::isnan(a) && std::isnan(b));
}

TEST_F(CudaKernelsTest, FinishClipMatchesTheCpuFormula) {
  struct Case {
    double d, n, max_norm;
  };
  const Case cases[] = {{3.0, 13.0, 1.0}, {0.01, 0.02, 1.0},  {INFINITY, 1.0, 2.0}, {NAN, 1.0, 1.0},
                        {0.0, 0.0, 0.5},  {1e30, 2e30, 1e10}, {INFINITY, NAN, 1.0}};
  DeviceBytes partials(2 * sizeof(double)), outputs(2 * sizeof(float)), c64(sizeof(double));
  for (const Case& c : cases) {
    const double p[2] = {c.d, c.n};
    partials.upload(p);
    ASSERT_TRUE(cuda::finish_clip(partials.as<double>(), nullptr, false, c.max_norm,
                                  outputs.as<float>(), outputs.as<float>() + 1, c64.as<double>(),
                                  native())
                    .ok());
    sync();
    float result[2];
    outputs.download(result);
    float norm = 0, coefficient = 0;
    expected_clip(c.d + c.n, c.max_norm, norm, coefficient);
    EXPECT_TRUE(same_float(result[0], norm)) << result[0] << " vs " << norm;
    EXPECT_TRUE(same_float(result[1], coefficient)) << result[1] << " vs " << coefficient;
  }
  // Deterministic: the value of two FixedSquares, as FixedSquares::value() gives it.
  const auto host = random_values(DType::kFloat64, 1000, 99);
  FixedSquares fixed[2];
  cpu::sum_of_squares_fixed(DType::kFloat64, host.data(), 600, fixed[0]);
  cpu::sum_of_squares_fixed(DType::kFloat64, host.data() + 600 * 8, 400, fixed[1]);
  DeviceBytes device_fixed(sizeof(fixed));
  device_fixed.upload(fixed);
  ASSERT_TRUE(cuda::finish_clip(nullptr, device_fixed.as<FixedSquares>(), true, 1.0,
                                outputs.as<float>(), outputs.as<float>() + 1, nullptr, native())
                  .ok());
  sync();
  float result[2];
  outputs.download(result);
  float norm = 0, coefficient = 0;
  expected_clip(fixed[0].value() + fixed[1].value(), 1.0, norm, coefficient);
  EXPECT_TRUE(same_float(result[0], norm));
  EXPECT_TRUE(same_float(result[1], coefficient));
}

TEST_F(CudaKernelsTest, NonFloatDtypesAreRefused) {
  DeviceBytes out(sizeof(FixedSquares));
  EXPECT_EQ(
      cuda::sum_of_squares(DType::kInt32, out.as<void>(), 1, out.as<double>(), native()).code(),
      StatusCode::kInvalidArgument);
  EXPECT_EQ(
      cuda::sum_of_squares_fixed(DType::kInt64, out.as<void>(), 1, out.as<FixedSquares>(), native())
          .code(),
      StatusCode::kInvalidArgument);
}

// Units in the last place between two floats of the same sign.
int64_t ulps(float a, float b) {
  const auto ia = static_cast<int64_t>(std::bit_cast<int32_t>(a));
  const auto ib = static_cast<int64_t>(std::bit_cast<int32_t>(b));
  return ia > ib ? ia - ib : ib - ia;
}

int64_t max_ulps(const std::vector<float>& a, const std::vector<float>& b) {
  int64_t worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, ulps(a[i], b[i]));
  return worst;
}

std::vector<float> random_floats(size_t n, uint32_t seed, float low, float high) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(low, high);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// Same arithmetic without fused multiply-adds: expected bit for bit; at most 2 ulps allowed,
// and the worst seen is reported.
TEST_F(CudaKernelsTest, SgdMatchesCpu) {
  const size_t n = 100003;
  const float clip = 0.625f;
  DeviceBytes clip_device(sizeof(float));
  clip_device.upload(&clip);
  struct Case {
    float momentum;
    bool nesterov, first_step, with_clip;
  };
  for (const Case c : {Case{0.0f, false, false, true}, Case{0.9f, false, true, true},
                       Case{0.9f, false, false, false}, Case{0.9f, true, false, true}}) {
    SgdHyper h;
    h.learning_rate = 0.05f;
    h.momentum = c.momentum;
    h.weight_decay = 0.01f;
    h.nesterov = c.nesterov;
    auto param = random_floats(n, 1, -1, 1), grad = random_floats(n, 2, -2, 2),
         buffer = random_floats(n, 3, -0.5f, 0.5f);
    DeviceBytes p(n * 4), g(n * 4), b(n * 4);
    p.upload(param.data());
    g.upload(grad.data());
    b.upload(buffer.data());
    ASSERT_TRUE(cuda::sgd(p.as<float>(), g.as<float>(), b.as<float>(), n, h,
                          c.with_clip ? clip_device.as<float>() : nullptr, 0.5f, c.first_step,
                          native())
                    .ok());
    sync();
    cpu::sgd(param.data(), grad.data(), buffer.data(), n, h, c.with_clip ? &clip : nullptr, 0.5f,
             c.first_step);
    std::vector<float> param_gpu(n), buffer_gpu(n);
    p.download(param_gpu.data());
    b.download(buffer_gpu.data());
    const int64_t worst = std::max(max_ulps(param_gpu, param), max_ulps(buffer_gpu, buffer));
    RecordProperty("sgd_max_ulps", static_cast<int>(worst));
    EXPECT_LE(worst, 2) << "momentum " << c.momentum;
  }
}

TEST_F(CudaKernelsTest, AdamWMatchesCpu) {
  const size_t n = 100003;
  const float clip = 0.375f;
  DeviceBytes clip_device(sizeof(float));
  clip_device.upload(&clip);
  AdamWHyper h;
  auto param = random_floats(n, 4, -1, 1), m = random_floats(n, 5, -0.1f, 0.1f),
       v = random_floats(n, 6, 0.0f, 0.01f);
  DeviceBytes p(n * 4), g(n * 4), dm(n * 4), dv(n * 4);
  p.upload(param.data());
  dm.upload(m.data());
  dv.upload(v.data());
  for (long step = 1; step <= 5; ++step) {
    const auto grad = random_floats(n, static_cast<uint32_t>(10 + step), -2, 2);
    g.upload(grad.data());
    const float* clip_host = step % 2 ? &clip : nullptr;
    ASSERT_TRUE(cuda::adamw(p.as<float>(), g.as<float>(), dm.as<float>(), dv.as<float>(), n, h,
                            step, clip_host ? clip_device.as<float>() : nullptr, 0.25f, native())
                    .ok());
    sync();
    cpu::adamw(param.data(), grad.data(), m.data(), v.data(), n, h, step, clip_host, 0.25f);
  }
  std::vector<float> param_gpu(n), m_gpu(n), v_gpu(n);
  p.download(param_gpu.data());
  dm.download(m_gpu.data());
  dv.download(v_gpu.data());
  const int64_t worst =
      std::max({max_ulps(param_gpu, param), max_ulps(m_gpu, m), max_ulps(v_gpu, v)});
  RecordProperty("adamw_max_ulps", static_cast<int>(worst));
  EXPECT_LE(worst, 4) << "after 5 steps";
}

#endif  // HPS_HAVE_CUDA

}  // namespace
}  // namespace hps
