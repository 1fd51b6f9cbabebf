// Norm kernels: chunked fp32 sums against fp64 references, every dtype, and scaling.
#include "core/kernels/norm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

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
