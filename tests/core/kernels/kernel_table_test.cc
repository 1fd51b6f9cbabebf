// The kernel tables' conformance suite (core/kernels/kernel_table.h): every entry of every
// available device's table, over random sizes (odd ones, above 1M elements), every float
// dtype, buffers off their 16-byte alignment and NaN / Inf inputs.
//  - Cpu/KernelTableTest.*: the CPU table against scalar references written here (ctest
//    kernel_table_test, label cpp).
//  - Cuda/KernelTableTest.*: the CUDA table against the CPU table on the same inputs (ctest
//    kernel_table_cuda_test, label gpu; Skipped with a reason where no CUDA device is usable).
// What is compared how:
//  - bitwise, NaN payloads included: cast, fill, sum_of_squares_fixed (the digits),
//    write_step_state;
//  - bitwise, a NaN matching any NaN (a GPU's arithmetic makes the canonical NaN, x86 keeps
//    the operand's): accumulate, scale, unscale's data, finish_clip from the same partials,
//    update_step_state but for its AdamW constants, sgd, adamw given the same step state;
//  - found_inf and the step counters exactly;
//  - within a tolerance: sum_of_squares and unscale's float partials, relative 1e-5 for
//    fp32 / fp16 / bf16 data (fp32 chunks of at most kSquaresChunk elements whose
//    summation order differs) and 1e-12 for fp64; update_step_state's AdamW constants
//    within 1 ulp (the CUDA pow is not the host's); against the scalar references the
//    fixed-point sums' values within 1e-12 (a long double sum of the exact squares).
#include "core/kernels/kernel_table.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/common/half.h"
#include "core/device/buffer.h"
#include "core/device/cpu/stream.h"

namespace hps {
namespace {

using Bytes = std::vector<uint8_t>;

const DType kFloatTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64};

std::string name_of(DType d) { return std::string(dtype_name(d)); }

// ---- host values of any float dtype, as raw bytes ----

double value_at(DType d, const Bytes& b, size_t i) {
  switch (d) {
    case DType::kFloat32: {
      float f;
      std::memcpy(&f, &b[i * 4], 4);
      return f;
    }
    case DType::kFloat64: {
      double v;
      std::memcpy(&v, &b[i * 8], 8);
      return v;
    }
    case DType::kFloat16: {
      uint16_t h;
      std::memcpy(&h, &b[i * 2], 2);
      return half_bits_to_float(h);
    }
    case DType::kBFloat16: {
      uint16_t h;
      std::memcpy(&h, &b[i * 2], 2);
      return bf16_bits_to_float(h);
    }
    default: return 0;
  }
}

void set_value(DType d, Bytes& b, size_t i, double v) {
  switch (d) {
    case DType::kFloat32: {
      const auto f = static_cast<float>(v);
      std::memcpy(&b[i * 4], &f, 4);
      return;
    }
    case DType::kFloat64: std::memcpy(&b[i * 8], &v, 8); return;
    case DType::kFloat16: {
      const uint16_t h = float_to_half_bits(static_cast<float>(v));
      std::memcpy(&b[i * 2], &h, 2);
      return;
    }
    case DType::kBFloat16: {
      const uint16_t h = float_to_bf16_bits(static_cast<float>(v));
      std::memcpy(&b[i * 2], &h, 2);
      return;
    }
    default: return;
  }
}

bool is_nan_at(DType d, const Bytes& b, size_t i) { return std::isnan(value_at(d, b, i)); }

// `count` values in [-range, range]; with `specials`, NaN, ±Inf, -0 and a subnormal at a
// few random places.
Bytes random_values(DType d, size_t count, uint64_t seed, double range = 3.0,
                    bool specials = false) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(-range, range);
  Bytes b(count * dtype_size(d));
  for (size_t i = 0; i < count; ++i) set_value(d, b, i, dist(rng));
  if (specials && count > 0) {
    // The NaN last: a later special never overwrites it.
    const double special[] = {-0.0, 1e-41, 3e-8, -INFINITY, INFINITY, std::nan("")};
    for (const double v : special) set_value(d, b, rng() % count, v);
  }
  return b;
}

// Random bit patterns: every class of value, NaN payloads and rounding ties included.
Bytes random_bits(size_t bytes, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Bytes b(bytes);
  for (auto& x : b) x = static_cast<uint8_t>(rng());
  return b;
}

std::vector<float> random_floats(size_t n, uint64_t seed, float low, float high) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(low, high);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

Bytes as_bytes(const std::vector<float>& v) {
  Bytes b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// Sizes around the vector group (8), the warp (32), the block (256), the chunk (4096), a
// few random ones and one above 1M; odd where it matters. `seed` varies the random ones.
std::vector<size_t> test_sizes(uint64_t seed) {
  std::mt19937_64 rng(seed);
  return {0,
          1,
          7,
          31,
          33,
          257,
          4095,
          4097,
          12289,
          65537,
          2 + rng() % 50000,
          (size_t{1} << 20) + 2 * (rng() % 32768) + 1};
}

// ---- comparisons ----

enum class Nan { kSameBits, kAnyNan };

testing::AssertionResult same_values(DType d, const Bytes& actual, const Bytes& expected,
                                     Nan nan = Nan::kAnyNan) {
  if (actual.size() != expected.size()) {
    return testing::AssertionFailure()
           << "sizes differ: " << actual.size() << " vs " << expected.size();
  }
  const size_t element = dtype_size(d);
  const size_t n = actual.size() / element;
  size_t mismatches = 0, first = 0;
  for (size_t i = 0; i < n; ++i) {
    if (std::memcmp(&actual[i * element], &expected[i * element], element) == 0) continue;
    if (nan == Nan::kAnyNan && dtype_is_floating(d) && is_nan_at(d, actual, i) &&
        is_nan_at(d, expected, i)) {
      continue;
    }
    if (mismatches++ == 0) first = i;
  }
  if (mismatches == 0) return testing::AssertionSuccess();
  auto failure = testing::AssertionFailure() << mismatches << " of " << n << " " << name_of(d)
                                             << " elements differ; first at " << first;
  if (dtype_is_floating(d)) {
    failure << ": " << value_at(d, actual, first) << " vs " << value_at(d, expected, first);
  }
  return failure;
}

bool same_float(float a, float b) {
  return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b) ||
         (std::isnan(a) && std::isnan(b));
}
bool same_double(double a, double b) {
  return std::bit_cast<uint64_t>(a) == std::bit_cast<uint64_t>(b) ||
         (std::isnan(a) && std::isnan(b));
}

int64_t ulps(float a, float b) {
  const auto ia = static_cast<int64_t>(std::bit_cast<int32_t>(a));
  const auto ib = static_cast<int64_t>(std::bit_cast<int32_t>(b));
  return ia > ib ? ia - ib : ib - ia;
}

// |actual - expected| ≤ relative · |expected|, NaN and Inf matching themselves.
testing::AssertionResult near_relative(double actual, double expected, double relative) {
  if (std::isnan(expected) ? std::isnan(actual)
                           : (std::isinf(expected) ? actual == expected
                                                   : std::fabs(actual - expected) <=
                                                         relative * std::fabs(expected))) {
    return testing::AssertionSuccess();
  }
  return testing::AssertionFailure()
         << actual << " vs " << expected << " (relative error "
         << std::fabs(actual - expected) / std::fabs(expected) << ", allowed " << relative << ")";
}

double squares_tolerance(DType d) { return d == DType::kFloat64 ? 1e-12 : 1e-5; }

// ---- scalar references (what the CPU table must give) ----

// An element as fp32, bit for bit as cpu::cast reads it (a NaN keeps its payload).
float to_float(DType d, const Bytes& b, size_t i) {
  switch (d) {
    case DType::kFloat32: {
      float f;
      std::memcpy(&f, &b[i * 4], 4);
      return f;
    }
    case DType::kFloat16: {
      uint16_t h;
      std::memcpy(&h, &b[i * 2], 2);
      return half_bits_to_float(h);
    }
    case DType::kBFloat16: {
      uint16_t h;
      std::memcpy(&h, &b[i * 2], 2);
      return bf16_bits_to_float(h);
    }
    default: return static_cast<float>(value_at(d, b, i));
  }
}

void store_float(DType d, Bytes& b, size_t i, float f) {
  switch (d) {
    case DType::kFloat32: std::memcpy(&b[i * 4], &f, 4); return;
    case DType::kFloat64: {
      const double v = f;
      std::memcpy(&b[i * 8], &v, 8);
      return;
    }
    case DType::kFloat16: {
      const uint16_t h = float_to_half_bits(f);
      std::memcpy(&b[i * 2], &h, 2);
      return;
    }
    case DType::kBFloat16: {
      const uint16_t h = float_to_bf16_bits(f);
      std::memcpy(&b[i * 2], &h, 2);
      return;
    }
    default: return;
  }
}

// The contract's conversion: through fp32 (so fp64 → fp16 / bf16 rounds twice).
Bytes scalar_cast(DType from, const Bytes& in, DType to, size_t n) {
  if (from == to) return in;
  Bytes out(n * dtype_size(to));
  for (size_t i = 0; i < n; ++i) store_float(to, out, i, to_float(from, in, i));
  return out;
}

long double exact_squares(DType d, const Bytes& b, size_t n) {
  long double sum = 0;
  for (size_t i = 0; i < n; ++i) {
    const double x = value_at(d, b, i);
    sum += static_cast<long double>(x) * x;
  }
  return sum;
}

void scalar_update(StepState& s, const StepRule& rule) {
  if (s.found_inf != 0) {
    s.skipped_steps += 1;
    s.good_steps = 0;
    s.loss_scale = s.loss_scale * rule.backoff_factor;
    s.found_inf = 0;
    s.skip = 1;
    return;
  }
  s.skip = 0;
  s.applied_steps += 1;
  if (rule.dynamic_loss_scaling) {
    s.good_steps += 1;
    if (s.good_steps >= rule.growth_interval) {
      const float grown = s.loss_scale * rule.growth_factor;
      if (std::isfinite(grown)) s.loss_scale = grown;  // GradScaler keeps a finite scale
      s.good_steps = 0;
    }
  }
  if (rule.adamw) {
    const double t = static_cast<double>(s.applied_steps);
    const auto bias1 = static_cast<float>(1.0 - std::pow(double{rule.adamw_hyper.beta1}, t));
    const auto bias2 = static_cast<float>(1.0 - std::pow(double{rule.adamw_hyper.beta2}, t));
    s.adamw_step_size = rule.adamw_hyper.learning_rate / bias1;
    s.adamw_bias2_sqrt = std::sqrt(bias2);
  }
}

// ---- the fixture: one device's table and stream ----

class KernelTableTest : public testing::TestWithParam<DeviceType> {
 protected:
  void SetUp() override {
    if (GetParam() == DeviceType::kCuda && device_count(DeviceType::kCuda) == 0) {
      GTEST_SKIP() << "no usable CUDA device: hpshard built without CUDA, or no driver or GPU "
                      "on this machine; the CUDA table runs on a GPU machine (tools/gpu-check.sh)";
    }
    device_ = GetParam() == DeviceType::kCpu ? Device::cpu() : Device::cuda(0);
    auto table = kernels_for(GetParam());
    ASSERT_TRUE(table.ok()) << table.status().to_string();
    table_ = *table;
    ASSERT_EQ(table_->device_type(), GetParam());
    auto stream = create_stream(device_);
    ASSERT_TRUE(stream.ok()) << stream.status().to_string();
    stream_ = std::move(stream).value();
    cpu_table_ = &*kernels_for(DeviceType::kCpu).value();
  }

  bool on_cuda() const { return GetParam() == DeviceType::kCuda; }

  // Device memory holding `host` at `offset` bytes past an aligned address (an offset of
  // one element puts the buffer off its 16-byte alignment).
  struct Buffer {
    DeviceBuffer memory;
    size_t offset = 0;
    size_t bytes = 0;
    template <typename T = void>
    DevicePtr<T> ptr() const {
      return memory.data<void>().byte_offset(offset).template as<T>();
    }
  };

  Buffer upload(const Bytes& host, size_t offset = 0) {
    Buffer b;
    auto memory = DeviceBuffer::allocate(device_, host.size() + offset + 16);
    EXPECT_TRUE(memory.ok()) << memory.status().to_string();
    b.memory = std::move(memory).value();
    b.offset = offset;
    b.bytes = host.size();
    // Stream-ordered, and the host waits before `host` may go away.
    EXPECT_TRUE(stream_->memcpy_async(b.ptr().get(), host.data(), host.size()).ok());
    sync();
    return b;
  }
  template <typename T>
  Buffer upload_value(const T& value) {
    Bytes b(sizeof(T));
    std::memcpy(b.data(), &value, sizeof(T));
    return upload(b);
  }

  Bytes download(const Buffer& b) {
    Bytes host(b.bytes);
    EXPECT_TRUE(stream_->memcpy_async(host.data(), b.ptr().get(), b.bytes).ok());
    sync();
    return host;
  }
  template <typename T>
  T download_value(const Buffer& b) {
    const Bytes bytes = download(b);
    T value;
    std::memcpy(&value, bytes.data(), sizeof(T));
    return value;
  }

  void sync() { ASSERT_TRUE(stream_->synchronize().ok()); }

  // The CPU table on host memory, run at once on the calling thread: the reference of the
  // CUDA table.
  const Kernels& cpu() const { return *cpu_table_; }
  cpu::CallerStream& caller() { return caller_; }
  template <typename T>
  static DevicePtr<T> host(T* p) {
    return DevicePtr<T>(p);
  }

  Device device_;
  const Kernels* table_ = nullptr;
  const Kernels* cpu_table_ = nullptr;
  std::unique_ptr<Stream> stream_;
  cpu::CallerStream caller_;
};

// ---- cast, fill, accumulate ----

TEST_P(KernelTableTest, CastIsBitwiseForEveryPairOfFloatTypes) {
  for (const DType from : kFloatTypes) {
    for (const DType to : kFloatTypes) {
      const auto sizes = test_sizes(static_cast<uint64_t>(from) * 7 + static_cast<uint64_t>(to));
      for (size_t k = 0; k < sizes.size(); ++k) {
        const size_t n = sizes[k];
        SCOPED_TRACE(name_of(from) + " -> " + name_of(to) + " n=" + std::to_string(n));
        // Random bits half the time (NaN payloads, subnormals, overflow, ties), values in
        // range the other half.
        const uint64_t seed = n * 31 + static_cast<uint64_t>(from) * 5 + static_cast<uint64_t>(to);
        const Bytes in = k % 2 == 0 ? random_bits(n * dtype_size(from), seed)
                                    : random_values(from, n, seed, 7e4, true);
        Bytes expected;
        if (on_cuda()) {
          expected.resize(n * dtype_size(to));
          ASSERT_TRUE(cpu()
                          .cast(caller(), from, host<const void>(in.data()), to,
                                host<void>(expected.data()), n)
                          .ok());
        } else {
          expected = scalar_cast(from, in, to, n);
        }
        // Misaligned on odd size indices: the CUDA table's single-element path.
        const size_t offset = (k % 3 == 1) ? dtype_size(from) : 0;
        Buffer src = upload(in, offset);
        Buffer dst = upload(Bytes(n * dtype_size(to), 0xab), k % 3 == 2 ? dtype_size(to) : 0);
        ASSERT_TRUE(table_->cast(*stream_, from, src.ptr<const void>(), to, dst.ptr(), n).ok());
        EXPECT_TRUE(same_values(to, download(dst), expected, Nan::kSameBits));
      }
    }
  }
}

TEST_P(KernelTableTest, FillConvertsTheValueOnceForEveryDtype) {
  struct Case {
    DType dtype;
    double value;
  };
  const Case cases[] = {
      {DType::kFloat32, 0.1},      {DType::kFloat32, -0.0},     {DType::kFloat32, INFINITY},
      {DType::kFloat32, 1e300},    {DType::kFloat64, 0.1},      {DType::kFloat64, std::nan("")},
      {DType::kFloat16, 0.1},      {DType::kFloat16, 70000.0},  {DType::kFloat16, 1e-7},
      {DType::kBFloat16, 0.1},     {DType::kBFloat16, -3.0e38}, {DType::kInt32, -123456.0},
      {DType::kInt64, 1e15 + 3.0}, {DType::kUInt8, 200.0},      {DType::kFloat32, 1.0},
  };
  for (const Case& c : cases) {
    for (const size_t n : {size_t{0}, size_t{1}, size_t{13}, size_t{4099}, size_t{1} << 20}) {
      SCOPED_TRACE(name_of(c.dtype) + " " + std::to_string(c.value) + " n=" + std::to_string(n));
      Bytes expected(n * dtype_size(c.dtype));
      if (on_cuda()) {
        ASSERT_TRUE(cpu().fill(caller(), c.dtype, host<void>(expected.data()), n, c.value).ok());
      } else {
        for (size_t i = 0; i < n; ++i) {
          uint8_t* p = &expected[i * dtype_size(c.dtype)];
          switch (c.dtype) {
            case DType::kInt32: {
              const auto v = static_cast<int32_t>(c.value);
              std::memcpy(p, &v, 4);
              break;
            }
            case DType::kInt64: {
              const auto v = static_cast<int64_t>(c.value);
              std::memcpy(p, &v, 8);
              break;
            }
            case DType::kUInt8: *p = static_cast<uint8_t>(c.value); break;
            default: store_float(c.dtype, expected, i, static_cast<float>(c.value));
          }
          if (c.dtype == DType::kFloat64) std::memcpy(p, &c.value, 8);  // no fp32 step
        }
      }
      Buffer data = upload(Bytes(expected.size(), 0x5a), n % 2 == 1 ? dtype_size(c.dtype) : 0);
      ASSERT_TRUE(table_->fill(*stream_, c.dtype, data.ptr(), n, c.value).ok());
      EXPECT_TRUE(same_values(c.dtype, download(data), expected, Nan::kSameBits));
    }
  }
}

TEST_P(KernelTableTest, AccumulateAddsTheConvertedSource) {
  for (const DType src_dtype : kFloatTypes) {
    const auto sizes = test_sizes(100 + static_cast<uint64_t>(src_dtype));
    for (size_t k = 0; k < sizes.size(); ++k) {
      const size_t n = sizes[k];
      SCOPED_TRACE(name_of(src_dtype) + " n=" + std::to_string(n));
      const Bytes src = random_values(src_dtype, n, n + 1, 5.0, k % 2 == 0);
      const Bytes dst = random_values(DType::kFloat32, n, n + 2, 5.0, k % 4 == 1);
      Bytes expected = dst;
      if (on_cuda()) {
        ASSERT_TRUE(cpu()
                        .accumulate(caller(), host(reinterpret_cast<float*>(expected.data())),
                                    src_dtype, host<const void>(src.data()), n)
                        .ok());
      } else {
        for (size_t i = 0; i < n; ++i) {
          float d;
          std::memcpy(&d, &expected[i * 4], 4);
          d += to_float(src_dtype, src, i);
          std::memcpy(&expected[i * 4], &d, 4);
        }
      }
      Buffer s = upload(src, k % 3 == 1 ? dtype_size(src_dtype) : 0);
      Buffer d = upload(dst, k % 3 == 2 ? 4 : 0);
      ASSERT_TRUE(
          table_->accumulate(*stream_, d.ptr<float>(), src_dtype, s.ptr<const void>(), n).ok());
      EXPECT_TRUE(same_values(DType::kFloat32, download(d), expected));
    }
  }
}

// ---- sums of squares, finish_clip, scale ----

TEST_P(KernelTableTest, SumOfSquaresWithinTheChunkedTolerance) {
  for (const DType dtype : kFloatTypes) {
    const auto sizes = test_sizes(200 + static_cast<uint64_t>(dtype));
    for (size_t k = 0; k < sizes.size(); ++k) {
      const size_t n = sizes[k];
      const bool specials = k == 5 || k == 9;
      SCOPED_TRACE(name_of(dtype) + " n=" + std::to_string(n) + (specials ? " with NaN/Inf" : ""));
      const Bytes data = random_values(dtype, n, n * 3 + 1, 3.0, specials);
      const double start = 0.25;  // the entry adds to what is there
      double expected = start;
      if (on_cuda()) {
        ASSERT_TRUE(
            cpu()
                .sum_of_squares(caller(), dtype, host<const void>(data.data()), n, host(&expected))
                .ok());
      } else {
        expected = start + static_cast<double>(exact_squares(dtype, data, n));
      }
      Buffer d = upload(data, k % 3 == 1 ? dtype_size(dtype) : 0);
      Buffer partial = upload_value(start);
      ASSERT_TRUE(
          table_->sum_of_squares(*stream_, dtype, d.ptr<const void>(), n, partial.ptr<double>())
              .ok());
      const double got = download_value<double>(partial);
      EXPECT_TRUE(near_relative(got, expected, squares_tolerance(dtype)));
      if (on_cuda()) {
        // Deterministic: the same launch on the same buffer gives the same bits.
        Buffer again = upload_value(start);
        ASSERT_TRUE(
            table_->sum_of_squares(*stream_, dtype, d.ptr<const void>(), n, again.ptr<double>())
                .ok());
        EXPECT_EQ(std::bit_cast<uint64_t>(download_value<double>(again)),
                  std::bit_cast<uint64_t>(got));
      }
    }
  }
}

TEST_P(KernelTableTest, FixedSquaresAreExactAndOrderIndependent) {
  for (const DType dtype : kFloatTypes) {
    const auto sizes = test_sizes(300 + static_cast<uint64_t>(dtype));
    for (size_t k = 0; k < sizes.size(); ++k) {
      const size_t n = sizes[k];
      const bool specials = k == 4;
      SCOPED_TRACE(name_of(dtype) + " n=" + std::to_string(n) + (specials ? " with NaN/Inf" : ""));
      // Wide magnitudes: the digits far apart are all exercised.
      const Bytes data = random_values(dtype, n, n * 5 + 3, k % 2 ? 1e-3 : 6e4, specials);
      FixedSquares start;
      start.add_square(0.75);  // the entry adds to what is there
      start.normalize();
      Buffer d = upload(data, k % 3 == 1 ? dtype_size(dtype) : 0);
      Buffer sum = upload_value(start);
      ASSERT_TRUE(table_
                      ->sum_of_squares_fixed(*stream_, dtype, d.ptr<const void>(), n,
                                             sum.ptr<FixedSquares>())
                      .ok());
      const auto got = download_value<FixedSquares>(sum);
      // The same values in two pieces, the second first: the same bits.
      const size_t half = n / 3;
      Buffer split = upload_value(start);
      const size_t element = dtype_size(dtype);
      ASSERT_TRUE(table_
                      ->sum_of_squares_fixed(*stream_, dtype,
                                             d.ptr<const void>().byte_offset(half * element),
                                             n - half, split.ptr<FixedSquares>())
                      .ok());
      ASSERT_TRUE(table_
                      ->sum_of_squares_fixed(*stream_, dtype, d.ptr<const void>(), half,
                                             split.ptr<FixedSquares>())
                      .ok());
      EXPECT_EQ(download_value<FixedSquares>(split).slots, got.slots);
      if (on_cuda()) {
        FixedSquares expected = start;
        ASSERT_TRUE(cpu()
                        .sum_of_squares_fixed(caller(), dtype, host<const void>(data.data()), n,
                                              host(&expected))
                        .ok());
        EXPECT_EQ(got.slots, expected.slots);
      } else {
        const long double exact = 0.75L + exact_squares(dtype, data, n);
        EXPECT_TRUE(near_relative(got.value(), static_cast<double>(exact), 1e-12));
        for (int i = 0; i < FixedSquares::kDigits - 1; ++i) {
          EXPECT_GE(got.slots[i], 0);
          EXPECT_LT(got.slots[i], int64_t{1} << 32) << "digit " << i << " left unnormalized";
        }
      }
      if (specials) {
        EXPECT_GT(got.slots[FixedSquares::kDigits + 1], 0) << "the NaN was counted";
      }
    }
  }
}

TEST_P(KernelTableTest, FixedSquaresTruncateBelowTheResolutionAndOverflowAbove) {
  // Squares are truncated to multiples of 2^-160; a square of 2^160 or more is an overflow.
  struct Case {
    std::vector<double> values;
    bool overflow, nan;
  };
  const Case cases[] = {
      {{0x1p-80, 0x1p-81, 1e-24, 2e-24, 4.9e-324, 1e-90, -0.0, 3e-30}, false, false},
      {{0x1p79, -0x1p79, 1.5}, false, false},
      {{0x1p80, 1.0}, true, false},
      {{INFINITY, 2.0, -INFINITY}, true, false},
      {{std::nan(""), INFINITY, 1.0}, true, true},
  };
  for (const DType dtype : {DType::kFloat64, DType::kFloat32}) {
    for (const Case& c : cases) {
      SCOPED_TRACE(name_of(dtype) + " case of " + std::to_string(c.values.size()) + " values");
      Bytes data(c.values.size() * dtype_size(dtype));
      for (size_t i = 0; i < c.values.size(); ++i) set_value(dtype, data, i, c.values[i]);
      Buffer d = upload(data);
      Buffer sum = upload_value(FixedSquares{});
      ASSERT_TRUE(table_
                      ->sum_of_squares_fixed(*stream_, dtype, d.ptr<const void>(), c.values.size(),
                                             sum.ptr<FixedSquares>())
                      .ok());
      const auto got = download_value<FixedSquares>(sum);
      if (on_cuda()) {
        FixedSquares expected;
        ASSERT_TRUE(cpu()
                        .sum_of_squares_fixed(caller(), dtype, host<const void>(data.data()),
                                              c.values.size(), host(&expected))
                        .ok());
        EXPECT_EQ(got.slots, expected.slots);
        continue;
      }
      long double units = 0;  // the exact sum in units of 2^-160
      int64_t overflows = 0, nans = 0;
      for (size_t i = 0; i < c.values.size(); ++i) {
        const long double x = value_at(dtype, data, i);
        const long double square = x * x;
        if (std::isnan(square)) {
          ++nans;
        } else if (square >= 0x1p160L) {
          ++overflows;
        } else {
          units += std::floor(square * 0x1p160L);
        }
      }
      EXPECT_EQ(got.slots[FixedSquares::kDigits], overflows);
      EXPECT_EQ(got.slots[FixedSquares::kDigits + 1], nans);
      EXPECT_EQ(overflows > 0, c.overflow);
      EXPECT_EQ(nans > 0, c.nan);
      if (!c.overflow && !c.nan) {
        EXPECT_EQ(got.value(), static_cast<double>(units * 0x1p-160L));
      } else {
        EXPECT_EQ(std::isnan(got.value()), c.nan);
        EXPECT_EQ(std::isinf(got.value()), c.overflow && !c.nan);
      }
    }
  }
}

TEST_P(KernelTableTest, FinishClipIsBitwiseFromTheSamePartials) {
  struct Case {
    double d, n, max_norm;
  };
  const Case cases[] = {
      {3.0, 13.0, 1.0}, {0.01, 0.02, 1.0},  {INFINITY, 1.0, 2.0},          {std::nan(""), 1.0, 1.0},
      {0.0, 0.0, 0.5},  {1e30, 2e30, 1e10}, {INFINITY, std::nan(""), 1.0}, {0.3, 0.4, 0.7}};
  const Bytes grads = random_values(DType::kFloat32, 5000, 77, 2.0);
  for (const bool deterministic : {false, true}) {
    for (const Case& c : cases) {
      SCOPED_TRACE(std::to_string(c.d) + " + " + std::to_string(c.n) + " max " +
                   std::to_string(c.max_norm) + (deterministic ? " fixed" : " float"));
      ClipState state;
      state.partials[0] = c.d;
      state.partials[1] = c.n;
      if (deterministic) {
        // The fixed partials: squares of real gradients, and the case's special values.
        cpu::sum_of_squares_fixed(DType::kFloat32, grads.data(), 3000, state.fixed[0]);
        cpu::sum_of_squares_fixed(DType::kFloat32, grads.data() + 3000 * 4, 2000, state.fixed[1]);
        state.fixed[0].add_square(c.d);
        state.fixed[0].normalize();
      }
      ClipState expected = state;
      if (on_cuda()) {
        ASSERT_TRUE(cpu().finish_clip(caller(), host(&expected), deterministic, c.max_norm).ok());
      } else {
        const double squares = deterministic ? expected.fixed[0].value() + expected.fixed[1].value()
                                             : expected.partials[0] + expected.partials[1];
        const double norm = std::sqrt(squares);
        expected.coefficient_fp64 = c.max_norm / ((norm < c.max_norm ? c.max_norm : norm) + 1e-6);
        expected.coefficient = static_cast<float>(expected.coefficient_fp64);
        expected.norm = static_cast<float>(norm);
      }
      Buffer clip = upload_value(state);
      ASSERT_TRUE(
          table_->finish_clip(*stream_, clip.ptr<ClipState>(), deterministic, c.max_norm).ok());
      const auto got = download_value<ClipState>(clip);
      EXPECT_TRUE(same_double(got.coefficient_fp64, expected.coefficient_fp64))
          << got.coefficient_fp64 << " vs " << expected.coefficient_fp64;
      EXPECT_TRUE(same_float(got.coefficient, expected.coefficient))
          << got.coefficient << " vs " << expected.coefficient;
      EXPECT_TRUE(same_float(got.norm, expected.norm)) << got.norm << " vs " << expected.norm;
      if (std::isinf(c.d) && !std::isnan(c.n)) {
        EXPECT_EQ(got.coefficient, 0.0f);
      }
    }
  }
}

TEST_P(KernelTableTest, ScaleMultipliesByTheCoefficientOfTheDtype) {
  ClipState clip;
  clip.coefficient_fp64 = 0.3712345678901234;
  clip.coefficient = static_cast<float>(clip.coefficient_fp64);
  Buffer device_clip = upload_value(clip);
  for (const DType dtype : kFloatTypes) {
    const auto sizes = test_sizes(400 + static_cast<uint64_t>(dtype));
    for (size_t k = 0; k < sizes.size(); ++k) {
      const size_t n = sizes[k];
      SCOPED_TRACE(name_of(dtype) + " n=" + std::to_string(n));
      const Bytes data = random_values(dtype, n, n + 11, 6e4, k % 2 == 1);
      Bytes expected = data;
      if (on_cuda()) {
        ASSERT_TRUE(cpu()
                        .scale(caller(), dtype, host<void>(expected.data()), n,
                               host<const ClipState>(&clip))
                        .ok());
      } else {
        for (size_t i = 0; i < n; ++i) {
          if (dtype == DType::kFloat64) {
            set_value(dtype, expected, i, value_at(dtype, data, i) * clip.coefficient_fp64);
          } else {
            store_float(dtype, expected, i, to_float(dtype, data, i) * clip.coefficient);
          }
        }
      }
      Buffer d = upload(data, k % 3 == 1 ? dtype_size(dtype) : 0);
      ASSERT_TRUE(
          table_->scale(*stream_, dtype, d.ptr(), n, device_clip.ptr<const ClipState>()).ok());
      EXPECT_TRUE(same_values(dtype, download(d), expected));
    }
  }
}

// ---- unscale ----

struct UnscaleCase {
  DType dtype;
  int partial;  // -1, kClipPartialD or kClipPartialN
  bool deterministic, check_finite, specials, in_place;
};

TEST_P(KernelTableTest, UnscaleConvertsScalesChecksAndCountsInOnePass) {
  std::vector<UnscaleCase> cases;
  for (const DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (const int partial : {-1, kClipPartialD, kClipPartialN}) {
      for (const bool deterministic : {false, true}) {
        if (partial < 0 && deterministic) continue;
        for (const bool specials : {false, true}) {
          cases.push_back({dtype, partial, deterministic, true, specials, false});
        }
      }
    }
    cases.push_back({dtype, kClipPartialN, false, false, true, false});  // Inf, but unchecked
  }
  cases.push_back({DType::kFloat32, kClipPartialD, false, true, false, true});
  cases.push_back({DType::kFloat32, kClipPartialN, true, true, true, true});

  size_t index = 0;
  for (const UnscaleCase& c : cases) {
    const auto sizes = test_sizes(500 + index);
    // Three sizes per case (small, odd, above 1M on every third case) keep the suite short.
    for (const size_t n : {sizes[2], sizes[8 + index % 3], sizes[index % 3 == 0 ? 11 : 10]}) {
      SCOPED_TRACE(name_of(c.dtype) + " n=" + std::to_string(n) + " partial " +
                   std::to_string(c.partial) + (c.deterministic ? " fixed" : "") +
                   (c.check_finite ? " checked" : "") + (c.specials ? " with NaN/Inf" : "") +
                   (c.in_place ? " in place" : ""));
      const Bytes src = random_values(c.dtype, n, n * 13 + index, 40.0, c.specials);
      StepState state;
      state.loss_scale = 1024.0f;
      state.applied_steps = 17;
      ClipState clip;
      clip.partials[0] = 0.5;
      clip.partials[1] = 1.5;
      clip.fixed[0].add_square(2.0);
      clip.fixed[1].add_square(3.0);
      const float mean_scale = 0.125f;
      UnscaleArgs a;
      a.src_dtype = c.dtype;
      a.count = n;
      a.mean_scale = mean_scale;
      a.check_finite = c.check_finite;
      a.partial = c.partial;
      a.deterministic = c.deterministic;

      // The reference.
      StepState expected_state = state;
      ClipState expected_clip = clip;
      std::vector<float> expected_dst(n);
      if (on_cuda()) {
        UnscaleArgs h = a;
        h.src = host<const void>(src.data());
        h.dst = host(expected_dst.data());
        h.state = host(&expected_state);
        h.clip = c.partial >= 0 ? host(&expected_clip) : nullptr;
        ASSERT_TRUE(cpu().unscale(caller(), h).ok());
      } else {
        const float factor = mean_scale / state.loss_scale;
        bool finite = true;
        for (size_t i = 0; i < n; ++i) {
          expected_dst[i] = to_float(c.dtype, src, i) * factor;
          finite = finite && std::isfinite(expected_dst[i]);
        }
        if (c.check_finite && !finite) expected_state.found_inf = 1;
        if (c.partial >= 0) {
          const Bytes dst_bytes = as_bytes(expected_dst);
          const long double squares = exact_squares(DType::kFloat32, dst_bytes, n);
          if (c.deterministic) {
            for (size_t i = 0; i < n; ++i) {
              const double x = expected_dst[i];
              expected_clip.fixed[c.partial].add_square(x * x);
            }
            expected_clip.fixed[c.partial].normalize();
          } else {
            expected_clip.partials[c.partial] += static_cast<double>(squares);
          }
        }
      }

      // The table under test.
      const size_t offset = index % 2 == 1 ? dtype_size(c.dtype) : 0;
      Buffer s = upload(src, offset);
      Buffer d = c.in_place ? Buffer{} : upload(Bytes(n * 4, 0), index % 4 == 2 ? 4 : 0);
      Buffer st = upload_value(state);
      Buffer cl = upload_value(clip);
      UnscaleArgs u = a;
      u.src = s.ptr<const void>();
      u.dst = c.in_place ? s.ptr<float>() : d.ptr<float>();
      u.state = st.ptr<StepState>();
      u.clip = c.partial >= 0 ? cl.ptr<ClipState>() : nullptr;
      ASSERT_TRUE(table_->unscale(*stream_, u).ok());

      EXPECT_TRUE(
          same_values(DType::kFloat32, download(c.in_place ? s : d), as_bytes(expected_dst)));
      const auto got_state = download_value<StepState>(st);
      EXPECT_EQ(got_state.found_inf, expected_state.found_inf);
      EXPECT_EQ(got_state.loss_scale, state.loss_scale);
      EXPECT_EQ(got_state.applied_steps, state.applied_steps);
      if (c.check_finite && c.specials) {
        EXPECT_EQ(got_state.found_inf, 1);
      }
      if (!c.check_finite) {
        EXPECT_EQ(got_state.found_inf, 0);
      }
      const auto got_clip = download_value<ClipState>(cl);
      for (int p = 0; p < 2; ++p) {
        SCOPED_TRACE("partial " + std::to_string(p));
        if (c.deterministic && p == c.partial && on_cuda()) {
          EXPECT_EQ(got_clip.fixed[p].slots, expected_clip.fixed[p].slots);
        } else if (c.deterministic && p == c.partial) {
          EXPECT_TRUE(
              near_relative(got_clip.fixed[p].value(), expected_clip.fixed[p].value(), 1e-12));
        } else {
          EXPECT_EQ(got_clip.fixed[p].slots, clip.fixed[p].slots);
        }
        if (!c.deterministic && p == c.partial) {
          EXPECT_TRUE(near_relative(got_clip.partials[p], expected_clip.partials[p], 1e-5));
        } else {
          EXPECT_EQ(got_clip.partials[p], clip.partials[p]);
        }
      }
    }
    ++index;
  }
}

// ---- the step state ----

bool same_state(const StepState& a, const StepState& b, bool adamw_exact) {
  return same_float(a.loss_scale, b.loss_scale) && a.found_inf == b.found_inf && a.skip == b.skip &&
         a.good_steps == b.good_steps && a.applied_steps == b.applied_steps &&
         a.skipped_steps == b.skipped_steps &&
         (adamw_exact ? same_float(a.adamw_step_size, b.adamw_step_size) &&
                            same_float(a.adamw_bias2_sqrt, b.adamw_bias2_sqrt)
                      : ulps(a.adamw_step_size, b.adamw_step_size) <= 1 &&
                            ulps(a.adamw_bias2_sqrt, b.adamw_bias2_sqrt) <= 1);
}

std::string describe(const StepState& s) {
  return "scale " + std::to_string(s.loss_scale) + " found_inf " + std::to_string(s.found_inf) +
         " skip " + std::to_string(s.skip) + " good " + std::to_string(s.good_steps) + " applied " +
         std::to_string(s.applied_steps) + " skipped " + std::to_string(s.skipped_steps) +
         " step_size " + std::to_string(s.adamw_step_size) + " bias2_sqrt " +
         std::to_string(s.adamw_bias2_sqrt);
}

TEST_P(KernelTableTest, WriteStepStateWritesEveryField) {
  StepState value;
  value.loss_scale = 65536.0f;
  value.found_inf = 1;
  value.skip = 1;
  value.good_steps = 7;
  value.applied_steps = int64_t{1} << 40;
  value.skipped_steps = 3;
  value.adamw_step_size = 0.001f;
  value.adamw_bias2_sqrt = 0.5f;
  Buffer state = upload_value(StepState{});
  ASSERT_TRUE(table_->write_step_state(*stream_, state.ptr<StepState>(), value).ok());
  const auto got = download_value<StepState>(state);
  EXPECT_TRUE(same_state(got, value, true)) << describe(got);
}

TEST_P(KernelTableTest, UpdateStepStateFollowsTheVerdicts) {
  // found_inf per step: skips, a run of good steps long enough to grow the scale, skips.
  const int verdicts[] = {0, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0};
  for (const bool dynamic : {false, true}) {
    for (const bool adamw : {false, true}) {
      SCOPED_TRACE(std::string(dynamic ? "dynamic" : "static") + (adamw ? " adamw" : " sgd"));
      StepRule rule;
      rule.dynamic_loss_scaling = dynamic;
      rule.growth_factor = 2.0f;
      rule.backoff_factor = 0.5f;
      rule.growth_interval = 3;
      rule.adamw = adamw;
      rule.adamw_hyper.beta1 = 0.9f;
      rule.adamw_hyper.beta2 = 0.999f;
      rule.adamw_hyper.learning_rate = 3e-4f;
      StepState start;
      start.loss_scale = 32768.0f;
      StepState expected = start;
      Buffer state = upload_value(start);
      for (size_t step = 0; step < std::size(verdicts); ++step) {
        SCOPED_TRACE("step " + std::to_string(step));
        if (verdicts[step] != 0) {
          // found_inf as unscale sets it: a kernel writing into the state.
          const auto found_inf = state.ptr().byte_offset(offsetof(StepState, found_inf));
          ASSERT_TRUE(table_->fill(*stream_, DType::kInt32, found_inf, 1, 1.0).ok());
          expected.found_inf = 1;
        }
        ASSERT_TRUE(table_->update_step_state(*stream_, state.ptr<StepState>(), rule).ok());
        if (on_cuda()) {
          ASSERT_TRUE(cpu().update_step_state(caller(), host(&expected), rule).ok());
        } else {
          scalar_update(expected, rule);
        }
        const auto got = download_value<StepState>(state);
        EXPECT_TRUE(same_state(got, expected, !on_cuda()))
            << describe(got) << "\nexpected " << describe(expected);
        EXPECT_EQ(got.found_inf, 0) << "the verdict resets found_inf";
      }
      EXPECT_EQ(expected.skipped_steps, 3);
      EXPECT_EQ(expected.applied_steps, 12);
      // Halved at each of the three skips; with dynamic scaling also doubled after each of
      // the three runs of three good steps.
      EXPECT_EQ(expected.loss_scale, dynamic ? 32768.0f : 32768.0f * 0.125f);
    }
  }
}

// As torch's GradScaler: a growth past the largest float keeps the scale (an infinite one
// would skip every later step: inf × backoff is inf), and the good steps start over.
TEST_P(KernelTableTest, UpdateStepStateNeverGrowsTheScaleToInfinity) {
  StepRule rule;
  rule.dynamic_loss_scaling = true;
  rule.growth_factor = 2.0f;
  rule.backoff_factor = 0.5f;
  rule.growth_interval = 1;
  StepState start;
  start.loss_scale = std::ldexp(1.0f, 126);
  Buffer state = upload_value(start);
  const float expected[] = {std::ldexp(1.0f, 127), std::ldexp(1.0f, 127), std::ldexp(1.0f, 127)};
  for (const float scale : expected) {
    ASSERT_TRUE(table_->update_step_state(*stream_, state.ptr<StepState>(), rule).ok());
    const auto got = download_value<StepState>(state);
    EXPECT_EQ(got.loss_scale, scale);
    EXPECT_EQ(got.good_steps, 0);
    EXPECT_EQ(got.skip, 0);
  }
  // A factor that overflows from any scale (3.5e38 × 1e38) leaves it too.
  rule.growth_factor = 1e38f;
  ASSERT_TRUE(table_->update_step_state(*stream_, state.ptr<StepState>(), rule).ok());
  EXPECT_EQ(download_value<StepState>(state).loss_scale, std::ldexp(1.0f, 127));
  // A skip still backs it off.
  const auto found_inf = state.ptr().byte_offset(offsetof(StepState, found_inf));
  ASSERT_TRUE(table_->fill(*stream_, DType::kInt32, found_inf, 1, 1.0).ok());
  ASSERT_TRUE(table_->update_step_state(*stream_, state.ptr<StepState>(), rule).ok());
  EXPECT_EQ(download_value<StepState>(state).loss_scale, std::ldexp(1.0f, 126));
}

// ---- optimizers ----

// Without weight decay SGD adds none, as torch: an infinite parameter stays infinite (0 ·
// inf added to the gradient made it NaN), with or without momentum and nesterov.
TEST_P(KernelTableTest, SgdWithoutDecayKeepsAnInfiniteParameterInfinite) {
  const float inf = std::numeric_limits<float>::infinity();
  for (const float momentum : {0.0f, 0.9f}) {
    for (const bool nesterov : {false, true}) {
      if (nesterov && momentum == 0.0f) continue;
      SCOPED_TRACE("momentum " + std::to_string(momentum) + (nesterov ? " nesterov" : ""));
      SgdHyper h;
      h.learning_rate = 0.5f;
      h.momentum = momentum;
      h.nesterov = nesterov;
      const std::vector<float> param = {inf, -inf, 1.0f}, grad = {1.0f, 1.0f, 1.0f};
      const std::vector<float> buffer = {0.0f, 0.0f, 0.0f};
      StepState state;
      state.applied_steps = 1;
      Buffer p = upload(as_bytes(param)), g = upload(as_bytes(grad)), b = upload(as_bytes(buffer)),
             st = upload_value(state);
      SgdArgs a;
      a.param = p.ptr<float>();
      a.grad = g.ptr<const float>();
      a.momentum = momentum != 0 ? b.ptr<float>() : nullptr;
      a.count = param.size();
      a.hyper = h;
      a.state = st.ptr<const StepState>();
      ASSERT_TRUE(table_->sgd(*stream_, a).ok());
      const auto bytes = download(p);
      std::vector<float> got(param.size());
      std::memcpy(got.data(), bytes.data(), bytes.size());
      EXPECT_EQ(got[0], inf);
      EXPECT_EQ(got[1], -inf);
      EXPECT_EQ(got[2], nesterov ? 1.0f - 0.5f * 1.9f : 0.5f);
    }
  }
}

TEST_P(KernelTableTest, SgdIsBitwiseAndHonoursSkipFirstStepAndClip) {
  struct Case {
    float momentum;
    bool nesterov;
    int64_t applied_steps;
    bool clip, skip, nan;
  };
  const Case cases[] = {{0.0f, false, 3, true, false, false}, {0.9f, false, 1, true, false, false},
                        {0.9f, false, 4, false, false, true}, {0.9f, true, 2, true, false, false},
                        {0.9f, false, 5, true, true, false},  {0.0f, false, 2, false, false, true}};
  size_t index = 0;
  for (const Case& c : cases) {
    const auto sizes = test_sizes(600 + index);
    for (const size_t n : {sizes[1], sizes[9], sizes[index % 2 == 0 ? 11 : 10]}) {
      SCOPED_TRACE("case " + std::to_string(index) + " n=" + std::to_string(n));
      SgdHyper h;
      h.learning_rate = 0.05f;
      h.momentum = c.momentum;
      h.weight_decay = 0.01f;
      h.nesterov = c.nesterov;
      auto param = random_floats(n, n + 1, -1, 1), grad = random_floats(n, n + 2, -2, 2),
           buffer = random_floats(n, n + 3, -0.5f, 0.5f);
      if (c.nan && n > 0) grad[n / 2] = std::nanf("");
      StepState state;
      state.applied_steps = c.applied_steps;
      state.skip = c.skip ? 1 : 0;
      const float coefficient = 0.625f;
      auto expected_param = param, expected_buffer = buffer;
      if (on_cuda()) {
        SgdArgs a;
        a.param = host(expected_param.data());
        a.grad = host<const float>(grad.data());
        a.momentum = c.momentum != 0 ? host(expected_buffer.data()) : nullptr;
        a.count = n;
        a.hyper = h;
        a.state = host<const StepState>(&state);
        a.clip_coefficient = c.clip ? host(&coefficient) : nullptr;
        ASSERT_TRUE(cpu().sgd(caller(), a).ok());
      } else if (!c.skip) {
        const float scale = c.clip ? coefficient : 1.0f;
        for (size_t i = 0; i < n; ++i) {
          const float g = grad[i] * scale + h.weight_decay * expected_param[i];
          if (c.momentum == 0.0f) {
            expected_param[i] -= h.learning_rate * g;
            continue;
          }
          const float b = c.applied_steps == 1 ? g : c.momentum * expected_buffer[i] + g;
          expected_buffer[i] = b;
          expected_param[i] -= h.learning_rate * (c.nesterov ? g + c.momentum * b : b);
        }
      }
      const size_t offset = index % 3 == 1 ? 4 : 0;
      Buffer p = upload(as_bytes(param), offset), g = upload(as_bytes(grad), offset),
             b = upload(as_bytes(buffer), offset), st = upload_value(state),
             cf = upload_value(coefficient);
      SgdArgs a;
      a.param = p.ptr<float>();
      a.grad = g.ptr<const float>();
      a.momentum = c.momentum != 0 ? b.ptr<float>() : nullptr;
      a.count = n;
      a.hyper = h;
      a.state = st.ptr<const StepState>();
      a.clip_coefficient = c.clip ? cf.ptr<const float>() : nullptr;
      ASSERT_TRUE(table_->sgd(*stream_, a).ok());
      EXPECT_TRUE(same_values(DType::kFloat32, download(p), as_bytes(expected_param)));
      EXPECT_TRUE(same_values(DType::kFloat32, download(b), as_bytes(expected_buffer)));
      if (c.skip) {
        EXPECT_TRUE(same_values(DType::kFloat32, download(p), as_bytes(param)));
      }
    }
    ++index;
  }
}

TEST_P(KernelTableTest, AdamWIsBitwiseGivenTheStepStateAndHonoursSkipAndClip) {
  struct Case {
    int64_t step;
    bool clip, skip, nan;
  };
  const Case cases[] = {{1, true, false, false},
                        {2, false, false, false},
                        {7, true, false, true},
                        {3, true, true, false}};
  size_t index = 0;
  for (const Case& c : cases) {
    const auto sizes = test_sizes(700 + index);
    for (const size_t n : {sizes[3], sizes[8], sizes[index % 2 == 0 ? 11 : 10]}) {
      SCOPED_TRACE("step " + std::to_string(c.step) + " n=" + std::to_string(n));
      AdamWHyper h;
      h.learning_rate = 1e-3f;
      h.weight_decay = 0.05f;
      auto param = random_floats(n, n + 4, -1, 1), grad = random_floats(n, n + 5, -2, 2),
           m = random_floats(n, n + 6, -0.1f, 0.1f), v = random_floats(n, n + 7, 0.0f, 0.01f);
      if (c.nan && n > 0) grad[n - 1] = std::nanf("");
      // The step's constants as update_step_state leaves them.
      StepState state;
      state.applied_steps = c.step;
      state.skip = c.skip ? 1 : 0;
      const AdamWConstants k = adamw_constants(h, c.step);
      state.adamw_step_size = k.step_size;
      state.adamw_bias2_sqrt = k.bias2_sqrt;
      const float coefficient = 0.375f;
      auto ep = param, em = m, ev = v;
      if (on_cuda()) {
        AdamWArgs a;
        a.param = host(ep.data());
        a.grad = host<const float>(grad.data());
        a.exp_avg = host(em.data());
        a.exp_avg_sq = host(ev.data());
        a.count = n;
        a.hyper = h;
        a.state = host<const StepState>(&state);
        a.clip_coefficient = c.clip ? host(&coefficient) : nullptr;
        ASSERT_TRUE(cpu().adamw(caller(), a).ok());
      } else if (!c.skip) {
        const float scale = c.clip ? coefficient : 1.0f;
        const float decay = 1.0f - h.learning_rate * h.weight_decay;
        for (size_t i = 0; i < n; ++i) {
          const float g = grad[i] * scale;
          em[i] = h.beta1 * em[i] + (1.0f - h.beta1) * g;
          ev[i] = h.beta2 * ev[i] + (1.0f - h.beta2) * g * g;
          ep[i] =
              ep[i] * decay - k.step_size * em[i] / (std::sqrt(ev[i]) / k.bias2_sqrt + h.epsilon);
        }
      }
      const size_t offset = index % 2 == 1 ? 4 : 0;
      Buffer p = upload(as_bytes(param), offset), g = upload(as_bytes(grad)),
             dm = upload(as_bytes(m), offset), dv = upload(as_bytes(v)), st = upload_value(state),
             cf = upload_value(coefficient);
      AdamWArgs a;
      a.param = p.ptr<float>();
      a.grad = g.ptr<const float>();
      a.exp_avg = dm.ptr<float>();
      a.exp_avg_sq = dv.ptr<float>();
      a.count = n;
      a.hyper = h;
      a.state = st.ptr<const StepState>();
      a.clip_coefficient = c.clip ? cf.ptr<const float>() : nullptr;
      ASSERT_TRUE(table_->adamw(*stream_, a).ok());
      EXPECT_TRUE(same_values(DType::kFloat32, download(p), as_bytes(ep)));
      EXPECT_TRUE(same_values(DType::kFloat32, download(dm), as_bytes(em)));
      EXPECT_TRUE(same_values(DType::kFloat32, download(dv), as_bytes(ev)));
      if (c.skip) {
        EXPECT_TRUE(same_values(DType::kFloat32, download(p), as_bytes(param)));
      }
    }
    ++index;
  }
}

// ---- what a table refuses ----

// What only the CUDA run can check: a CUDA stream exists only where a device does.
class CudaKernelTableTest : public KernelTableTest {};

TEST_P(CudaKernelTableTest, AStreamOfAnotherDeviceIsRefused) {
  Buffer partial = upload_value(0.0);
  cpu::CallerStream cpu_stream;
  EXPECT_EQ(table_
                ->sum_of_squares(cpu_stream, DType::kFloat32, partial.ptr<const void>(), 1,
                                 partial.ptr<double>())
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(cpu()
                .sum_of_squares(*stream_, DType::kFloat32, partial.ptr<const void>(), 1,
                                partial.ptr<double>())
                .code(),
            StatusCode::kInvalidArgument);
}

TEST_P(CudaKernelTableTest, RefusesWhatItCannotCompute) {
  Buffer memory = upload(Bytes(sizeof(ClipState), 0));
  EXPECT_EQ(table_
                ->sum_of_squares(*stream_, DType::kInt32, memory.ptr<const void>(), 1,
                                 memory.ptr<double>())
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(table_
                ->sum_of_squares_fixed(*stream_, DType::kInt64, memory.ptr<const void>(), 1,
                                       memory.ptr<FixedSquares>())
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(table_
                ->cast(*stream_, DType::kInt32, memory.ptr<const void>(), DType::kFloat32,
                       memory.ptr(), 1)
                .code(),
            StatusCode::kInvalidArgument);
  UnscaleArgs u;
  u.src_dtype = DType::kFloat64;
  u.src = memory.ptr<const void>();
  u.dst = memory.ptr<float>();
  u.state = memory.ptr<StepState>();
  u.count = 1;
  EXPECT_EQ(table_->unscale(*stream_, u).code(), StatusCode::kInvalidArgument);
  u.src_dtype = DType::kFloat32;
  u.state = nullptr;
  EXPECT_EQ(table_->unscale(*stream_, u).code(), StatusCode::kInvalidArgument);
  SgdArgs s;
  s.count = 4;
  EXPECT_EQ(table_->sgd(*stream_, s).code(), StatusCode::kInvalidArgument);
}

TEST(KernelTables, EachDeviceTypeHasItsTableWhereBuilt) {
  auto cpu_table = kernels_for(DeviceType::kCpu);
  ASSERT_TRUE(cpu_table.ok());
  EXPECT_EQ((*cpu_table)->device_type(), DeviceType::kCpu);
  auto cuda_table = kernels_for(DeviceType::kCuda);
  if (cuda_table.ok()) {
    EXPECT_EQ((*cuda_table)->device_type(), DeviceType::kCuda);
  } else {
    EXPECT_EQ(cuda_table.status().code(), StatusCode::kUnavailable);
  }
}

std::string device_name(const testing::TestParamInfo<DeviceType>& info) {
  return info.param == DeviceType::kCpu ? "cpu" : "cuda";
}

INSTANTIATE_TEST_SUITE_P(Cpu, KernelTableTest, testing::Values(DeviceType::kCpu), device_name);
INSTANTIATE_TEST_SUITE_P(Cuda, KernelTableTest, testing::Values(DeviceType::kCuda), device_name);
INSTANTIATE_TEST_SUITE_P(Cuda, CudaKernelTableTest, testing::Values(DeviceType::kCuda),
                         device_name);

}  // namespace
}  // namespace hps
