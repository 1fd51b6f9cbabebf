#include "core/kernels/norm.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include "core/common/half.h"
#include "core/kernels/cpu/kernel_set.h"

namespace hps {

void FixedSquares::add_square(double square) {
  if (std::isnan(square)) {
    ++slots[kDigits + 1];
    return;
  }
  if (square >= 0x1p160) {
    ++slots[kDigits];
    return;
  }
  if (square < 0x1p-160) return;  // below the fixed point's resolution
  int exponent = 0;
  const double fraction = std::frexp(square, &exponent);  // square = fraction · 2^exponent
  auto mantissa = static_cast<uint64_t>(std::ldexp(fraction, 53));
  int shift = exponent - 53 - kLowestExponent;  // bit position of the mantissa's lsb
  if (shift < 0) {
    mantissa >>= -shift;
    shift = 0;
  }
  // mantissa << (shift % 32) spans three 32-bit digits; split it without 128-bit math.
  constexpr uint64_t kMask = 0xffffffffu;
  const int offset = shift % 32;
  const int digit = shift / 32;
  const uint64_t low = (mantissa & kMask) << offset;  // < 2^63
  const uint64_t high = (mantissa >> 32) << offset;   // < 2^52
  slots[digit] += static_cast<int64_t>(low & kMask);
  slots[digit + 1] += static_cast<int64_t>((low >> 32) + (high & kMask));
  slots[digit + 2] += static_cast<int64_t>(high >> 32);
}

void FixedSquares::normalize() {
  for (int i = 0; i + 1 < kDigits; ++i) {
    slots[i + 1] += slots[i] >> 32;
    slots[i] &= 0xffffffff;
  }
}

void FixedSquares::merge(const FixedSquares& other) {
  for (int i = 0; i < kSlots; ++i) slots[i] += other.slots[i];
}

double FixedSquares::value() const {
  if (slots[kDigits + 1] != 0) return std::nan("");
  if (slots[kDigits] != 0) return INFINITY;
  FixedSquares n = *this;
  n.normalize();
  double v = 0;
  for (int i = kDigits - 1; i >= 0; --i) {
    v += std::ldexp(static_cast<double>(n.slots[i]), 32 * i + kLowestExponent);
  }
  return v;
}

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

// The same exact sum for values that are fp32 (or narrower), without a libm call per
// element. x = m · 2^(e - 150) with m its 24-bit significand (subnormals: e = 1, no
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
    constexpr uint64_t kMask = 0xffffffffu;
    for (int e = kLow; e <= kHigh; ++e) {
      const uint64_t sum = sums[e - kLow];
      if (sum == 0) continue;
      sums[e - kLow] = 0;
      const int bit = 2 * e - 140;
      const int offset = bit % 32;
      const int digit = bit / 32;
      const uint64_t low = (sum & kMask) << offset;  // < 2^64
      const uint64_t high = (sum >> 32) << offset;   // sum < 2^63: < 2^63
      out.slots[digit] += static_cast<int64_t>(low & kMask);
      out.slots[digit + 1] += static_cast<int64_t>((low >> 32) + (high & kMask));
      out.slots[digit + 2] += static_cast<int64_t>(high >> 32);
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
