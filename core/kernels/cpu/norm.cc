#include "core/kernels/norm.h"

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

}  // namespace

// The vectorised kernels are those of the instruction-set variant in use (kernel_set.h).
double sum_of_squares(DType dtype, const void* data, size_t count) {
  return active_cpu_kernels().sum_of_squares(dtype, data, count);
}

void sum_of_squares_fixed(DType dtype, const void* data, size_t count, FixedSquares& out) {
  switch (dtype) {
    case DType::kFloat32: {
      const auto* x = static_cast<const float*>(data);
      fixed_squares(
          count, [x](size_t i) { return static_cast<double>(x[i]); }, out);
      return;
    }
    case DType::kFloat16: {
      const auto* x = static_cast<const uint16_t*>(data);
      fixed_squares(
          count, [x](size_t i) { return static_cast<double>(half_bits_to_float(x[i])); }, out);
      return;
    }
    case DType::kBFloat16: {
      const auto* x = static_cast<const uint16_t*>(data);
      fixed_squares(
          count, [x](size_t i) { return static_cast<double>(bf16_bits_to_float(x[i])); }, out);
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
    fixed_squares(
        count, [dst](size_t i) { return static_cast<double>(dst[i]); }, *fixed);
  }
  return finite;
}

}  // namespace cpu
}  // namespace hps
