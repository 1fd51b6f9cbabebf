#include "core/kernels/norm.h"

#include <bit>
#include <cmath>
#include <cstring>

#include "core/common/half.h"

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

// float → bf16 with round-to-nearest-even and quiet NaNs, as float_to_bf16_bits, written
// without branches so the scale loop vectorises.
inline uint16_t to_bf16_select(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (x >> 16) | 0x0040u;
  // A signed compare (the masked value is below 2^31): SSE2 has no unsigned one.
  return static_cast<uint16_t>(static_cast<int32_t>(x & 0x7fffffffu) > 0x7f800000 ? quiet_nan
                                                                                  : rounded);
}

constexpr size_t kChunk = 4096;  // fp32 partial sums stay short; chunks add in fp64

template <typename Load>
double sum_squares_fp32(size_t count, Load load) {
  double total = 0;
  for (size_t start = 0; start < count; start += kChunk) {
    const size_t end = std::min(count, start + kChunk);
    float chunk = 0;
#pragma omp simd reduction(+ : chunk)
    for (size_t i = start; i < end; ++i) {
      const float x = load(i);
      chunk += x * x;
    }
    total += chunk;
  }
  return total;
}

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

// AVX2 clones where the processor has it (the 16-bit conversions vectorise poorly with
// baseline SSE2), chosen once at load time by the dynamic linker.
#define HPS_KERNEL_CLONES __attribute__((target_clones("avx2", "default")))

HPS_KERNEL_CLONES double sum_of_squares(DType dtype, const void* data, size_t count) {
  switch (dtype) {
    case DType::kFloat32: {
      const auto* x = static_cast<const float*>(data);
      return sum_squares_fp32(count, [x](size_t i) { return x[i]; });
    }
    case DType::kFloat16: {
      const auto* x = static_cast<const uint16_t*>(data);
      return sum_squares_fp32(count, [x](size_t i) { return half_bits_to_float(x[i]); });
    }
    case DType::kBFloat16: {
      const auto* x = static_cast<const uint16_t*>(data);
      return sum_squares_fp32(count, [x](size_t i) { return bf16_bits_to_float(x[i]); });
    }
    case DType::kFloat64: {
      const auto* x = static_cast<const double*>(data);
      double total = 0;
#pragma omp simd reduction(+ : total)
      for (size_t i = 0; i < count; ++i) total += x[i] * x[i];
      return total;
    }
    default: return 0;
  }
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

HPS_KERNEL_CLONES void scale(DType dtype, void* data, size_t count, double coefficient) {
  switch (dtype) {
    case DType::kFloat32: {
      auto* x = static_cast<float*>(data);
      const auto c = static_cast<float>(coefficient);
#pragma omp simd
      for (size_t i = 0; i < count; ++i) x[i] *= c;
      return;
    }
    case DType::kFloat64: {
      auto* x = static_cast<double*>(data);
#pragma omp simd
      for (size_t i = 0; i < count; ++i) x[i] *= coefficient;
      return;
    }
    case DType::kFloat16: {
      auto* x = static_cast<uint16_t*>(data);
      const auto c = static_cast<float>(coefficient);
#pragma omp simd
      for (size_t i = 0; i < count; ++i) x[i] = float_to_half_bits(half_bits_to_float(x[i]) * c);
      return;
    }
    case DType::kBFloat16: {
      auto* x = static_cast<uint16_t*>(data);
      const auto c = static_cast<float>(coefficient);
#pragma omp simd
      for (size_t i = 0; i < count; ++i) x[i] = to_bf16_select(bf16_bits_to_float(x[i]) * c);
      return;
    }
    default: return;
  }
}

namespace {

// One chunk of the unscale pass; returns the chunk's fp32 sum of squares and sets
// `nonfinite` when a result is Inf or NaN (x · 0 is NaN exactly then).
template <typename Load>
__attribute__((always_inline)) inline float unscale_chunk(Load load, float* dst, size_t begin,
                                                          size_t end, float factor,
                                                          bool& nonfinite) {
  float squares = 0;
  float poison = 0;
#pragma omp simd reduction(+ : squares, poison)
  for (size_t i = begin; i < end; ++i) {
    const float x = load(i) * factor;
    dst[i] = x;
    squares += x * x;
    poison += x * 0.0f;
  }
  if (poison != 0 || poison != poison) nonfinite = true;
  return squares;
}

template <typename Load>
bool unscale_with(Load load, float* dst, size_t count, float factor, bool check_finite,
                  double* partial, FixedSquares* fixed) {
  bool nonfinite = false;
  double total = 0;
  for (size_t start = 0; start < count; start += kChunk) {
    const size_t end = std::min(count, start + kChunk);
    total += unscale_chunk(load, dst, start, end, factor, nonfinite);
  }
  if (partial != nullptr) *partial += total;
  if (fixed != nullptr) {
    fixed_squares(
        count, [dst](size_t i) { return static_cast<double>(dst[i]); }, *fixed);
  }
  return !(check_finite && nonfinite);
}

}  // namespace

HPS_KERNEL_CLONES bool unscale(DType src_dtype, const void* src, float* dst, size_t count,
                               float factor, bool check_finite, double* partial,
                               FixedSquares* fixed) {
  switch (src_dtype) {
    case DType::kFloat16: {
      const auto* x = static_cast<const uint16_t*>(src);
      return unscale_with([x](size_t i) { return half_bits_to_float(x[i]); }, dst, count, factor,
                          check_finite, partial, fixed);
    }
    case DType::kBFloat16: {
      const auto* x = static_cast<const uint16_t*>(src);
      return unscale_with([x](size_t i) { return bf16_bits_to_float(x[i]); }, dst, count, factor,
                          check_finite, partial, fixed);
    }
    default: {
      const auto* x = static_cast<const float*>(src);
      return unscale_with([x](size_t i) { return x[i]; }, dst, count, factor, check_finite, partial,
                          fixed);
    }
  }
}

}  // namespace cpu
}  // namespace hps
