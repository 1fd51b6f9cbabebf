#include "core/kernels/norm.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include "core/common/half.h"
#include "core/kernels/cpu/kernel_set.h"

namespace hps {

void FixedSquares::add_square(double square) { fixed_add_square(slots.data(), square); }

void FixedSquares::normalize() { fixed_normalize(slots.data()); }

void FixedSquares::merge(const FixedSquares& other) {
  for (int i = 0; i < kSlots; ++i) slots[i] += other.slots[i];
}

double FixedSquares::value() const { return fixed_value(slots.data()); }

namespace cpu {
namespace {

template <typename Load>
void fixed_squares(size_t count, Load load, FixedSquares& out) {
  for (size_t i = 0; i < count; ++i) {
    const double x = load(i);
    out.add_square(x * x);  // exact for fp32/fp16/bf16 inputs; one rounding for fp64
    if ((i & 0xfffff) == 0xfffff) out.normalize();  // keep every digit far from overflow
  }
  out.normalize();
}

// The same exact sum for values that are fp32 (or narrower), without three digit additions
// per element. x = m · 2^(e - 150) with m its 24-bit significand (subnormals: e = 1, no
// implicit bit), so x² = m² · 2^(2e - 300), an integer m² < 2^48 at bit 2e - 140 of the
// fixed point (lowest bit 2^-160). For 70 ≤ e ≤ 206 every bit of x² lies inside it and
// x² < 2^160: those squares are summed as integers per exponent (2^15 of them fit an
// int64) and each exponent's sum is added to the digits at its bit; zeros add nothing;
// every other value (truncated below the resolution, overflowing, Inf, NaN) goes through
// add_square as before. Integers add exactly, and normalize() leaves one representation of
// a value, so the digits are bitwise those of the per-element sum.
template <typename LoadFloat>
void fixed_squares_narrow(size_t count, LoadFloat load, FixedSquares& out) {
  constexpr int kLow = 70, kHigh = 206;
  constexpr size_t kBatch = size_t{1} << 15;
  uint64_t sums[kHigh - kLow + 1] = {};
  auto flush = [&] {
    for (int e = kLow; e <= kHigh; ++e) {
      const uint64_t sum = sums[e - kLow];
      if (sum == 0) continue;
      sums[e - kLow] = 0;
      fixed_add_shifted(out.slots.data(), sum, 2 * e - 140);  // sum < 2^63
    }
    out.normalize();
  };
  for (size_t start = 0; start < count; start += kBatch) {
    const size_t end = std::min(count, start + kBatch);
    for (size_t i = start; i < end; ++i) {
      const float x = load(i);
      const uint32_t bits = std::bit_cast<uint32_t>(x) & 0x7fffffffu;
      if (bits == 0) continue;
      const int field = static_cast<int>(bits >> 23);
      const int e = field == 0 ? 1 : field;
      if (e < kLow || e > kHigh) {
        const double wide = x;
        out.add_square(wide * wide);
        continue;
      }
      const uint64_t m = (bits & 0x7fffffu) | (field == 0 ? 0u : 0x800000u);
      sums[e - kLow] += m * m;
    }
    flush();  // also keeps the digits add_square fed far from overflow
  }
  out.normalize();
}

}  // namespace

// The vectorised kernels are those of the instruction-set variant in use (kernel_set.h).
double sum_of_squares(DType dtype, const void* data, size_t count) {
  return active_cpu_kernels().sum_of_squares(dtype, data, count);
}

void sum_of_squares_fixed(DType dtype, const void* data, size_t count, FixedSquares& out) {
  switch (dtype) {
    case DType::kFloat32: {
      const auto* x = static_cast<const float*>(data);
      fixed_squares_narrow(
          count, [x](size_t i) { return x[i]; }, out);
      return;
    }
    case DType::kFloat16: {
      const auto* x = static_cast<const uint16_t*>(data);
      fixed_squares_narrow(
          count, [x](size_t i) { return half_bits_to_float(x[i]); }, out);
      return;
    }
    case DType::kBFloat16: {
      const auto* x = static_cast<const uint16_t*>(data);
      fixed_squares_narrow(
          count, [x](size_t i) { return bf16_bits_to_float(x[i]); }, out);
      return;
    }
    case DType::kFloat64: {
      const auto* x = static_cast<const double*>(data);
      fixed_squares(
          count, [x](size_t i) { return x[i]; }, out);
      return;
    }
    default: return;
  }
}

void scale(DType dtype, void* data, size_t count, double coefficient) {
  active_cpu_kernels().scale(dtype, data, count, coefficient);
}

bool unscale(DType src_dtype, const void* src, float* dst, size_t count, float factor,
             bool check_finite, double* partial, FixedSquares* fixed) {
  const bool finite =
      active_cpu_kernels().unscale(src_dtype, src, dst, count, factor, check_finite, partial);
  if (fixed != nullptr) {
    fixed_squares_narrow(
        count, [dst](size_t i) { return dst[i]; }, *fixed);
  }
  return finite;
}

}  // namespace cpu
}  // namespace hps
