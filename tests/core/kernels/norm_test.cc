// Norm kernels: chunked fp32 sums against fp64 references, every dtype, and scaling.
#include "core/kernels/norm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/common/half.h"
#include "tests/core/comm/comm_test_util.h"

namespace hps {
namespace {

using testing_util::Buffer;

TEST(NormKernels, SumOfSquaresEveryFloatDtype) {
  for (DType d : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16}) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{4095}, size_t{4096}, size_t{100003}}) {
      Buffer b(d, n);
      double reference = 0;
      for (size_t i = 0; i < n; ++i) {
        b.set(i, std::sin(static_cast<double>(i)) * 3.0);
        reference += b.at(i) * b.at(i);
      }
      const double got = cpu::sum_of_squares(d, b.data(), n);
      // fp32 accumulation within 4096-element chunks: about 1e-6 relative, bounded here by 1e-5.
      EXPECT_NEAR(got, reference, reference * 1e-5 + 1e-12) << dtype_name(d) << " n=" << n;
      FixedSquares f;
      cpu::sum_of_squares_fixed(d, b.data(), n, f);
      EXPECT_NEAR(f.value(), reference, reference * 1e-12 + 1e-30) << dtype_name(d);
    }
  }
}

// The exact sums' digits equal those of adding every square one by one
// (FixedSquares::add_square, the definition), bitwise, for values drawn from every range:
// zeros, subnormals, squares truncated below the resolution, ordinary ones, squares at and
// past the overflow, Inf and NaN; enough of them to cross the kernel's batches, added onto
// digits already holding a sum.
TEST(NormKernels, FixedSquaresEqualTheSquareBySquareSum) {
  std::mt19937_64 rng(20261201);
  for (DType d : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (size_t n : {size_t{1}, size_t{7}, size_t{32768}, size_t{100003}}) {
      for (int mode = 0; mode < 3; ++mode) {
        std::vector<uint32_t> bits(n);
        for (auto& b : bits) {
          const uint64_t r = rng();
          // mode 0: any bit pattern; 1: ordinary magnitudes; 2: mostly tiny and huge ones.
          if (mode == 0) {
            b = static_cast<uint32_t>(r);
          } else {
            const int shift = mode == 1 ? 50 + static_cast<int>(r % 70) : static_cast<int>(r % 256);
            b = static_cast<uint32_t>((r >> 32) & 0x807fffffu) |
                (static_cast<uint32_t>(shift & 0xff) << 23);
          }
          if (r % 97 == 0) b = 0;  // zeros
        }
        std::vector<uint8_t> data(n * dtype_size(d));
        std::vector<float> values(n);
        for (size_t i = 0; i < n; ++i) {
          if (d == DType::kFloat32) {
            std::memcpy(data.data() + 4 * i, &bits[i], 4);
            std::memcpy(&values[i], &bits[i], 4);
          } else {
            const auto h = static_cast<uint16_t>(bits[i] >> 16);
            std::memcpy(data.data() + 2 * i, &h, 2);
            values[i] = d == DType::kFloat16 ? half_bits_to_float(h) : bf16_bits_to_float(h);
          }
        }
        FixedSquares start;
        start.add_square(12345.678);
        FixedSquares expected = start;
        for (float v : values) {
          expected.add_square(static_cast<double>(v) * v);
          expected.normalize();
        }
        FixedSquares got = start;
        cpu::sum_of_squares_fixed(d, data.data(), n, got);
        EXPECT_EQ(got.slots, expected.slots) << dtype_name(d) << " n=" << n << " mode " << mode;
      }
    }
  }
}

TEST(NormKernels, ScaleEveryFloatDtype) {
  for (DType d : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16}) {
    Buffer b(d, 9);
    for (size_t i = 0; i < 9; ++i) b.set(i, static_cast<double>(i) - 4.0);
    cpu::scale(d, b.data(), 9, 0.5);
    for (size_t i = 0; i < 9; ++i) EXPECT_EQ(b.at(i), (static_cast<double>(i) - 4.0) * 0.5);
  }
}

}  // namespace
}  // namespace hps
