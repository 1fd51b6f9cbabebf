// The CPU kernels' instruction-set variants (core/kernels/cpu/kernel_set.h): every variant
// this CPU can run, against scalar references written here from core/common/half.h, and
// against each other; the choice at load time against the CPU's flags in /proc/cpuinfo.
//  - bitwise: cast (NaN payloads included), scale, unscale's data, accumulate, sgd, adamw
//    (a NaN matching any NaN where arithmetic makes it), and the float sums of squares
//    across variants (their lanes do not depend on the vector width);
//  - within 1e-5 relative (fp32 chunks) of an exact sum: sum_of_squares and unscale's
//    partial, which is also bitwise sum_of_squares of unscale's results.
// A variant this CPU cannot run reports Skipped, naming it.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "core/common/half.h"
#include "core/kernels/cast.h"
#include "core/kernels/cpu/kernel_set.h"
#include "core/kernels/kernel_table.h"
#include "core/kernels/norm.h"

namespace hps::cpu {
namespace {

using Bytes = std::vector<uint8_t>;

const DType kFloatTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64};

// ---- scalar references ----

float to_float(DType d, const Bytes& b, size_t i) {
  switch (d) {
    case DType::kFloat32: {
      float f;
      std::memcpy(&f, &b[i * 4], 4);
      return f;
    }
    case DType::kFloat64: {
      double v;
      std::memcpy(&v, &b[i * 8], 8);
      return static_cast<float>(v);
    }
    case DType::kFloat16:
    case DType::kBFloat16: {
      uint16_t h;
      std::memcpy(&h, &b[i * 2], 2);
      return d == DType::kFloat16 ? half_bits_to_float(h) : bf16_bits_to_float(h);
    }
    default: return 0;
  }
}

double to_double(DType d, const Bytes& b, size_t i) {
  if (d != DType::kFloat64) return to_float(d, b, i);
  double v;
  std::memcpy(&v, &b[i * 8], 8);
  return v;
}

void store_float(DType d, Bytes& b, size_t i, float f) {
  switch (d) {
    case DType::kFloat32: std::memcpy(&b[i * 4], &f, 4); return;
    case DType::kFloat64: {
      const double v = f;
      std::memcpy(&b[i * 8], &v, 8);
      return;
    }
    case DType::kFloat16:
    case DType::kBFloat16: {
      const uint16_t h = d == DType::kFloat16 ? float_to_half_bits(f) : float_to_bf16_bits(f);
      std::memcpy(&b[i * 2], &h, 2);
      return;
    }
    default: return;
  }
}

Bytes random_bits(size_t bytes, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Bytes b(bytes);
  for (auto& x : b) x = static_cast<uint8_t>(rng());
  return b;
}

// Values in [-range, range] with NaN, ±Inf, -0 and subnormals at a few places.
Bytes random_values(DType d, size_t n, uint64_t seed, double range, bool specials) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(-range, range);
  Bytes b(n * dtype_size(d));
  for (size_t i = 0; i < n; ++i) {
    const double v = dist(rng);
    if (d == DType::kFloat64) {
      std::memcpy(&b[i * 8], &v, 8);
    } else {
      store_float(d, b, i, static_cast<float>(v));
    }
  }
  if (specials && n > 0) {
    for (const double v : {-0.0, 1e-41, 3e-8, 6e-5, -HUGE_VAL, HUGE_VAL, std::nan("")}) {
      const size_t i = rng() % n;
      if (d == DType::kFloat64) {
        std::memcpy(&b[i * 8], &v, 8);
      } else {
        store_float(d, b, i, static_cast<float>(v));
      }
    }
  }
  return b;
}

// fp32 bit patterns that exercise every rounding path of fp32 → fp16 / bf16: all 65,536
// upper halves, each with lower halves at and around the rounding points.
Bytes rounding_patterns() {
  const uint16_t lows[] = {0x0000, 0x0001, 0x0fff, 0x1000, 0x1001, 0x2000, 0x3000,
                           0x5555, 0x7fff, 0x8000, 0x8001, 0xc000, 0xe000, 0xffff};
  Bytes b;
  for (uint32_t high = 0; high < 0x10000; ++high) {
    for (uint16_t low : lows) {
      const uint32_t x = (high << 16) | low;
      const size_t at = b.size();
      b.resize(at + 4);
      std::memcpy(&b[at], &x, 4);
    }
  }
  return b;
}

// Sizes around the lane count (32), the block (4096) and odd ones.
const size_t kSizes[] = {0, 1, 7, 31, 32, 33, 100, 4095, 4096, 4097, 12289, 65537, 262147};

bool same_float_or_nans(float a, float b) {
  return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b) ||
         (std::isnan(a) && std::isnan(b));
}

enum class Nan { kSameBits, kAnyNan };

testing::AssertionResult same_values(DType d, const Bytes& actual, const Bytes& expected, Nan nan) {
  if (actual.size() != expected.size()) return testing::AssertionFailure() << "sizes differ";
  const size_t element = dtype_size(d);
  size_t mismatches = 0, first = 0;
  for (size_t i = 0; i < actual.size() / element; ++i) {
    if (std::memcmp(&actual[i * element], &expected[i * element], element) == 0) continue;
    if (nan == Nan::kAnyNan && std::isnan(to_double(d, actual, i)) &&
        std::isnan(to_double(d, expected, i))) {
      continue;
    }
    if (mismatches++ == 0) first = i;
  }
  if (mismatches == 0) return testing::AssertionSuccess();
  return testing::AssertionFailure()
         << mismatches << " " << dtype_name(d) << " elements differ; first at " << first << ": "
         << to_double(d, actual, first) << " vs " << to_double(d, expected, first);
}

long double exact_squares(DType d, const Bytes& b, size_t n) {
  long double sum = 0;
  for (size_t i = 0; i < n; ++i) {
    const double x = to_double(d, b, i);
    sum += static_cast<long double>(x) * x;
  }
  return sum;
}

// ---- the fixture: one variant ----

class CpuKernelVariantTest : public testing::TestWithParam<CpuIsa> {
 protected:
  void SetUp() override {
    if (!cpu_isa_supported(GetParam())) {
      GTEST_SKIP() << "the " << cpu_isa_name(GetParam())
                   << " variant cannot run on this CPU (it has: " << cpu_feature_text()
                   << "); it is compiled from the same source as the variants tested here";
    }
    auto set = cpu_kernel_set(GetParam());
    ASSERT_TRUE(set.ok()) << set.status().to_string();
    k_ = *set;
    ASSERT_EQ(k_->isa, GetParam());
  }
  const CpuKernelSet* k_ = nullptr;
};

TEST_P(CpuKernelVariantTest, CastIsBitwiseForEveryPairOfFloatTypes) {
  const Bytes patterns = rounding_patterns();
  for (const DType from : kFloatTypes) {
    for (const DType to : kFloatTypes) {
      for (size_t k = 0; k < std::size(kSizes) + 1; ++k) {
        // The last case: every fp16 / bf16 pattern, or the fp32 rounding patterns.
        const bool all = k == std::size(kSizes);
        Bytes in;
        if (all && dtype_size(from) == 2) {
          in.resize(0x10000 * 2);
          for (uint32_t h = 0; h < 0x10000; ++h) {
            const auto v = static_cast<uint16_t>(h);
            std::memcpy(&in[h * 2], &v, 2);
          }
        } else if (all && from == DType::kFloat32) {
          in = patterns;
        } else {
          const size_t n = all ? 100003 : kSizes[k];
          in = k % 2 == 0 ? random_bits(n * dtype_size(from), n * 7 + k)
                          : random_values(from, n, n + k, 7e4, true);
        }
        const size_t n = in.size() / dtype_size(from);
        SCOPED_TRACE(std::string(dtype_name(from)) + " -> " + std::string(dtype_name(to)) +
                     " n=" + std::to_string(n));
        Bytes expected(n * dtype_size(to));
        if (from == to) {
          expected = in;
        } else if (from == DType::kFloat32 && to == DType::kFloat64) {
          for (size_t i = 0; i < n; ++i) {
            const double v = to_float(from, in, i);
            std::memcpy(&expected[i * 8], &v, 8);
          }
        } else {
          for (size_t i = 0; i < n; ++i) store_float(to, expected, i, to_float(from, in, i));
        }
        Bytes out(n * dtype_size(to), 0xab);
        k_->cast(from, in.data(), to, out.data(), n);
        ASSERT_TRUE(same_values(to, out, expected, Nan::kSameBits));
      }
    }
  }
}

TEST_P(CpuKernelVariantTest, ScaleRoundsOncePerElement) {
  const double coefficient = 0.3712345678901234;
  for (const DType d : kFloatTypes) {
    for (size_t k = 0; k <= std::size(kSizes); ++k) {
      // The last case of a 16-bit type: every bit pattern (NaN payloads, subnormals, ties).
      const bool all = k == std::size(kSizes);
      if (all && dtype_size(d) != 2) continue;
      const size_t n = all ? 0x10000 : kSizes[k];
      SCOPED_TRACE(std::string(dtype_name(d)) + " n=" + std::to_string(n));
      Bytes data = random_values(d, n, n + 11, 6e4, n % 2 == 1);
      for (size_t i = 0; all && i < n; ++i) {
        const auto v = static_cast<uint16_t>(i);
        std::memcpy(&data[i * 2], &v, 2);
      }
      Bytes expected = data;
      for (size_t i = 0; i < n; ++i) {
        if (d == DType::kFloat64) {
          const double v = to_double(d, data, i) * coefficient;
          std::memcpy(&expected[i * 8], &v, 8);
        } else {
          store_float(d, expected, i, to_float(d, data, i) * static_cast<float>(coefficient));
        }
      }
      Bytes got = data;
      k_->scale(d, got.data(), n, coefficient);
      ASSERT_TRUE(same_values(d, got, expected, Nan::kAnyNan));
    }
  }
}

TEST_P(CpuKernelVariantTest, AccumulateAddsTheConvertedSource) {
  for (const DType d : kFloatTypes) {
    for (const size_t n : kSizes) {
      SCOPED_TRACE(std::string(dtype_name(d)) + " n=" + std::to_string(n));
      const Bytes src = random_values(d, n, n + 1, 5.0, n % 2 == 0);
      const Bytes dst = random_values(DType::kFloat32, n, n + 2, 5.0, false);
      Bytes expected = dst;
      for (size_t i = 0; i < n; ++i) {
        store_float(DType::kFloat32, expected, i,
                    to_float(DType::kFloat32, dst, i) + to_float(d, src, i));
      }
      Bytes got = dst;
      k_->accumulate(reinterpret_cast<float*>(got.data()), d, src.data(), n);
      ASSERT_TRUE(same_values(DType::kFloat32, got, expected, Nan::kAnyNan));
    }
  }
}

TEST_P(CpuKernelVariantTest, SumOfSquaresIsTheChunkedSumOfEveryVariant) {
  const CpuKernelSet& baseline = **cpu_kernel_set(CpuIsa::kBaseline);
  for (const DType d : kFloatTypes) {
    for (const size_t n : kSizes) {
      SCOPED_TRACE(std::string(dtype_name(d)) + " n=" + std::to_string(n));
      const Bytes data = random_values(d, n, n * 3 + 1, 3.0, false);
      const double got = k_->sum_of_squares(d, data.data(), n);
      const auto exact = static_cast<double>(exact_squares(d, data, n));
      EXPECT_NEAR(got, exact, exact * (d == DType::kFloat64 ? 1e-12 : 1e-5));
      // The lanes do not depend on the vector width: the same bits as the baseline.
      EXPECT_EQ(std::bit_cast<uint64_t>(got),
                std::bit_cast<uint64_t>(baseline.sum_of_squares(d, data.data(), n)));
    }
  }
  // Non-finite values give a non-finite sum; other dtypes give 0.
  const Bytes inf = random_values(DType::kFloat32, 9000, 5, 1.0, true);
  EXPECT_FALSE(std::isfinite(k_->sum_of_squares(DType::kFloat32, inf.data(), 9000)));
  const std::vector<int32_t> ints(10, 3);
  EXPECT_EQ(k_->sum_of_squares(DType::kInt32, ints.data(), ints.size()), 0.0);
}

TEST_P(CpuKernelVariantTest, UnscaleScalesChecksAndCountsInOnePass) {
  const CpuKernelSet& baseline = **cpu_kernel_set(CpuIsa::kBaseline);
  for (const DType d : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (const bool specials : {false, true}) {
      for (const bool in_place : {false, true}) {
        if (in_place && d != DType::kFloat32) continue;
        for (const size_t n : kSizes) {
          SCOPED_TRACE(std::string(dtype_name(d)) + " n=" + std::to_string(n) +
                       (specials ? " specials" : "") + (in_place ? " in place" : ""));
          const Bytes src = random_values(d, n, n + 5, 100.0, specials);
          const float factor = 0.125f / 3.0f;
          Bytes expected(n * 4);
          bool finite = true;
          for (size_t i = 0; i < n; ++i) {
            const float x = to_float(d, src, i) * factor;
            store_float(DType::kFloat32, expected, i, x);
            finite = finite && std::isfinite(x);
          }
          for (const bool check : {false, true}) {
            Bytes in = src;
            Bytes out(n * 4, 0xcd);
            float* dst = in_place ? reinterpret_cast<float*>(in.data())
                                  : reinterpret_cast<float*>(out.data());
            double partial = 0.5;  // added to
            const bool ok = k_->unscale(d, in.data(), dst, n, factor, check, &partial);
            EXPECT_EQ(ok, !check || finite);
            Bytes result(n * 4);
            if (n > 0) std::memcpy(result.data(), dst, n * 4);
            ASSERT_TRUE(same_values(DType::kFloat32, result, expected, Nan::kAnyNan));
            // The partial is sum_of_squares of the results, bit for bit, in every variant.
            const double squares = baseline.sum_of_squares(DType::kFloat32, dst, n);
            EXPECT_TRUE(std::bit_cast<uint64_t>(partial) ==
                            std::bit_cast<uint64_t>(0.5 + squares) ||
                        (std::isnan(partial) && std::isnan(squares)))
                << partial << " vs " << 0.5 + squares;
            if (!specials) {
              const auto exact = static_cast<double>(exact_squares(DType::kFloat32, result, n));
              EXPECT_NEAR(partial, 0.5 + exact, exact * 1e-5 + 1e-12);
            }
            // Without a partial: the same results and verdict.
            Bytes again(n * 4, 0x11);
            EXPECT_EQ(k_->unscale(d, src.data(), reinterpret_cast<float*>(again.data()), n, factor,
                                  check, nullptr),
                      ok);
            EXPECT_EQ(again, result);
          }
        }
      }
    }
  }
}

// torch.optim.SGD and AdamW, written out in fp32 operation for operation.
TEST_P(CpuKernelVariantTest, SgdIsBitwiseTheScalarUpdate) {
  for (const bool nesterov : {false, true}) {
    for (const float momentum : {0.0f, 0.9f}) {
      for (const size_t n : kSizes) {
        SCOPED_TRACE("n=" + std::to_string(n) + " momentum " + std::to_string(momentum) +
                     (nesterov ? " nesterov" : ""));
        const SgdHyper h{0.05f, momentum, 0.01f, nesterov};
        const Bytes gb = random_values(DType::kFloat32, n, n + 3, 2.0, n == 33);
        const auto* g = reinterpret_cast<const float*>(gb.data());
        std::vector<float> p(n), buf(n);
        for (size_t i = 0; i < n; ++i) {
          p[i] = std::sin(static_cast<float>(i)) + 0.5f;
          buf[i] = std::cos(static_cast<float>(i)) * 0.1f;
        }
        auto rp = p, rbuf = buf;
        const float coefficient = 0.375f;
        for (int step = 0; step < 2; ++step) {
          k_->sgd(p.data(), g, momentum != 0.0f ? buf.data() : nullptr, n, h, &coefficient, 0.5f,
                  step == 0);
          const float g_scale = coefficient * 0.5f;
          for (size_t i = 0; i < n; ++i) {
            const float gi = g[i] * g_scale + h.weight_decay * rp[i];
            if (momentum == 0.0f) {
              rp[i] -= h.learning_rate * gi;
              continue;
            }
            const float b = step == 0 ? gi : h.momentum * rbuf[i] + gi;
            rbuf[i] = b;
            rp[i] -= h.learning_rate * (nesterov ? gi + h.momentum * b : b);
          }
        }
        for (size_t i = 0; i < n; ++i) {
          ASSERT_TRUE(same_float_or_nans(p[i], rp[i])) << i << ": " << p[i] << " vs " << rp[i];
          ASSERT_TRUE(same_float_or_nans(buf[i], rbuf[i])) << i;
        }
      }
    }
  }
}

TEST_P(CpuKernelVariantTest, AdamWIsBitwiseTheScalarUpdate) {
  const AdamWHyper h{1e-2f, 0.9f, 0.99f, 1e-8f, 0.1f};
  for (const size_t n : kSizes) {
    SCOPED_TRACE("n=" + std::to_string(n));
    const Bytes gb = random_values(DType::kFloat32, n, n + 9, 3.0, n == 4097);
    const auto* g = reinterpret_cast<const float*>(gb.data());
    std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f);
    for (size_t i = 0; i < n; ++i) p[i] = std::sin(static_cast<float>(i) * 0.7f);
    auto rp = p, rm = m, rv = v;
    for (int64_t step = 1; step <= 3; ++step) {
      const AdamWConstants c = adamw_constants(h, step);
      const float* coefficient = step == 2 ? nullptr : &c.bias2_sqrt;  // any value in [0, 1]
      k_->adamw(p.data(), g, m.data(), v.data(), n, h, c, coefficient, 1.0f);
      const float g_scale = coefficient ? *coefficient : 1.0f;
      for (size_t i = 0; i < n; ++i) {
        const float gi = g[i] * g_scale;
        rm[i] = h.beta1 * rm[i] + (1.0f - h.beta1) * gi;
        rv[i] = h.beta2 * rv[i] + (1.0f - h.beta2) * gi * gi;
        rp[i] = rp[i] * (1.0f - h.learning_rate * h.weight_decay) -
                c.step_size * rm[i] / (std::sqrt(rv[i]) / c.bias2_sqrt + h.epsilon);
      }
    }
    for (size_t i = 0; i < n; ++i) {
      ASSERT_TRUE(same_float_or_nans(p[i], rp[i])) << i << ": " << p[i] << " vs " << rp[i];
      ASSERT_TRUE(same_float_or_nans(m[i], rm[i])) << i;
      ASSERT_TRUE(same_float_or_nans(v[i], rv[i])) << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Isa, CpuKernelVariantTest, testing::ValuesIn(kAllCpuIsas),
                         [](const testing::TestParamInfo<CpuIsa>& param) {
                           return std::string(cpu_isa_name(param.param));
                         });

// ---- the choice at load time ----

std::set<std::string> cpuinfo_flags() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    std::set<std::string> flags;
    for (std::string w; words >> w;) flags.insert(w);
    return flags;
  }
  return {};
}

TEST(CpuKernelChoice, TheBestVariantThisCpuRunsIsInUse) {
  const std::set<std::string> flags = cpuinfo_flags();
  if (flags.empty()) GTEST_SKIP() << "no /proc/cpuinfo flags line to check the choice against";
  auto has = [&](const char* f) { return flags.count(f) > 0; };
  CpuIsa expected = CpuIsa::kBaseline;
  if (has("avx2") && has("f16c")) expected = CpuIsa::kAvx2;
  if (expected == CpuIsa::kAvx2 && has("avx512f") && has("avx512bw") && has("avx512vl") &&
      has("avx512dq")) {
    expected = CpuIsa::kAvx512;
  }
  EXPECT_EQ(best_cpu_isa(), expected) << "cpu features: " << cpu_feature_text();
  EXPECT_EQ(active_cpu_kernels().isa, expected);
  for (CpuIsa isa : kAllCpuIsas) {
    EXPECT_EQ(cpu_isa_supported(isa), static_cast<int>(isa) <= static_cast<int>(expected))
        << cpu_isa_name(isa);
  }
  std::printf("cpu kernels in use: %s (cpu: %s)\n", cpu_isa_name(best_cpu_isa()),
              cpu_feature_text().c_str());
}

TEST(CpuKernelChoice, SelectingAVariantRoutesTheKernelsAndRefusesWhatTheCpuLacks) {
  const CpuIsa best = best_cpu_isa();
  ASSERT_TRUE(select_cpu_kernels(CpuIsa::kBaseline).ok());
  EXPECT_EQ(active_cpu_kernels().isa, CpuIsa::kBaseline);
  // The public kernels follow the choice: the same results either way.
  const Bytes in = random_values(DType::kFloat32, 1000, 3, 70000.0, true);
  Bytes a(2000), b(2000);
  cast(DType::kFloat32, in.data(), DType::kFloat16, a.data(), 1000);
  ASSERT_TRUE(select_cpu_kernels(best).ok());
  EXPECT_EQ(active_cpu_kernels().isa, best);
  cast(DType::kFloat32, in.data(), DType::kFloat16, b.data(), 1000);
  EXPECT_EQ(a, b);
  for (CpuIsa isa : kAllCpuIsas) {
    if (cpu_isa_supported(isa)) continue;
    const Status s = select_cpu_kernels(isa);
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << cpu_isa_name(isa);
    EXPECT_NE(s.message().find(cpu_isa_name(isa)), std::string::npos) << s.to_string();
    EXPECT_EQ(active_cpu_kernels().isa, best) << "a refused choice changed nothing";
  }
}

TEST(CpuKernelChoice, NamesRoundTripAndUnknownOnesAreRefused) {
  for (CpuIsa isa : kAllCpuIsas) {
    auto parsed = cpu_isa_from_name(cpu_isa_name(isa));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, isa);
  }
  auto bad = cpu_isa_from_name("avx1024");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("avx1024"), std::string::npos);
}

}  // namespace
}  // namespace hps::cpu
