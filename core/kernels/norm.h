// Gradient-norm kernels: sum of squares and in-place scaling of flat buffers. The CPU
// versions (kernels/cpu/) are vectorised and chunked; the CUDA ones live behind the kernel
// table (kernel_table.h, kernels/cuda/).
#pragma once

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "core/common/config.h"
#include "core/common/dtype.h"
#include "core/common/host_device.h"
#include "core/common/status.h"

namespace hps {

// An exact, order-independent sum of squares: each square is truncated to a multiple of
// 2^-160 and added as an integer, so any split of the same values over ranks and buffers
// sums to the same bits. Squares of 2^160 and above count as overflow (an infinite norm).
struct FixedSquares {
  static constexpr int kDigits = 11;  // base 2^32, least significant first
  static constexpr int kLowestExponent = -160;
  // digits, then the number of infinite and of NaN contributions: all summed by plain
  // int64 all-reduces across ranks.
  static constexpr int kSlots = kDigits + 2;
  std::array<int64_t, kSlots> slots{};

  void add_square(double square);
  void normalize();  // carries, so every digit is below 2^32
  void merge(const FixedSquares& other);
  double value() const;  // +Inf / NaN when any contribution was
};
static_assert(sizeof(FixedSquares) == sizeof(int64_t) * FixedSquares::kSlots,
              "FixedSquares is its slots");

// The digits' rules, written once for the CPU (FixedSquares' members, the fp32 fast path)
// and the CUDA kernels (per-thread and per-block digits), on the FixedSquares::kSlots
// int64 slots. A digit may hold more than 32 bits until fixed_normalize carries.

// Adds `bits` · 2^shift (bits < 2^63, 0 <= shift, shift / 32 + 2 < kDigits) to the digits.
HPS_HOST_DEVICE void fixed_add_shifted(int64_t* slots, uint64_t bits, int shift) {
  // bits << (shift % 32) spans three 32-bit digits; split it without 128-bit math.
  constexpr uint64_t kMask = 0xffffffffu;
  const int offset = shift % 32;
  const int digit = shift / 32;
  const uint64_t low = (bits & kMask) << offset;  // < 2^64
  const uint64_t high = (bits >> 32) << offset;   // < 2^63
  slots[digit] += static_cast<int64_t>(low & kMask);
  slots[digit + 1] += static_cast<int64_t>((low >> 32) + (high & kMask));
  slots[digit + 2] += static_cast<int64_t>(high >> 32);
}

// Adds one square, truncated to a multiple of 2^-160; NaN and squares of 2^160 and above
// are counted in the last two slots.
HPS_HOST_DEVICE void fixed_add_square(int64_t* slots, double square) {
  constexpr int kDigits = FixedSquares::kDigits;
  if (!(square == square)) {  // NaN
    ++slots[kDigits + 1];
    return;
  }
  if (square >= 0x1p160) {
    ++slots[kDigits];
    return;
  }
  if (square < 0x1p-160) return;  // below the fixed point's resolution
  // square = 1.m · 2^(biased - 1023), a normal double: its 53-bit significand's lowest bit
  // is at 2^(biased - 1075).
  uint64_t bits = 0;
  memcpy(&bits, &square, sizeof bits);
  const int biased = static_cast<int>(bits >> 52);
  uint64_t mantissa = (bits & 0x000fffffffffffffull) | 0x0010000000000000ull;
  int shift = biased - 1075 - FixedSquares::kLowestExponent;  // its lsb's bit in the digits
  if (shift < 0) {
    mantissa >>= -shift;
    shift = 0;
  }
  fixed_add_shifted(slots, mantissa, shift);
}

// Carries, so every digit but the last holds 32 bits.
HPS_HOST_DEVICE void fixed_normalize(int64_t* slots) {
  for (int i = 0; i + 1 < FixedSquares::kDigits; ++i) {
    slots[i + 1] += slots[i] >> 32;
    slots[i] &= 0xffffffff;
  }
}

// The sum the digits hold: +Inf or NaN when any contribution was.
HPS_HOST_DEVICE double fixed_value(const int64_t* slots) {
  constexpr int kDigits = FixedSquares::kDigits;
  uint64_t special = 0;
  if (slots[kDigits + 1] != 0)
    special = 0x7ff8000000000000ull;  // NaN
  else if (slots[kDigits] != 0)
    special = 0x7ff0000000000000ull;  // +Inf
  if (special != 0) {
    double v = 0;
    memcpy(&v, &special, sizeof v);
    return v;
  }
  int64_t n[FixedSquares::kSlots];
  for (int s = 0; s < FixedSquares::kSlots; ++s) n[s] = slots[s];
  fixed_normalize(n);
  double v = 0;
  for (int i = kDigits - 1; i >= 0; --i) {
    v += ldexp(static_cast<double>(n[i]), 32 * i + FixedSquares::kLowestExponent);
  }
  return v;
}

// A FixedSquares' slots, where its members cannot be called (device code).
HPS_HOST_DEVICE const int64_t* fixed_slots(const FixedSquares& f) {
  return reinterpret_cast<const int64_t*>(&f);
}

// The two partial sums of squares of hybrid clipping: gradients of is_distributed
// parameters (summed over mp too) and the others.
inline constexpr int kClipPartialD = 0;
inline constexpr int kClipPartialN = 1;

namespace cpu {

// Σ x² over `count` elements: fp16, bf16 and fp32 accumulate in fp32 per chunk (chunks
// summed in fp64), fp64 in fp64. Non-float dtypes are the caller's error (returns 0).
double sum_of_squares(DType dtype, const void* data, size_t count);
// The same values, accumulated exactly into `out`.
void sum_of_squares_fixed(DType dtype, const void* data, size_t count, FixedSquares& out);
// data[i] *= coefficient, in fp32 for 16-bit types (rounded once), in the type otherwise.
void scale(DType dtype, void* data, size_t count, double coefficient);
// The unscale pass of a step, one read of the gradient: dst[i] = src[i] · factor in fp32
// (src is fp32 — it may be dst — fp16 or bf16, converted first). Returns false when
// `check_finite` and some dst[i] is Inf or NaN. When `partial` is given it gets Σ dst[i]²
// accumulated as sum_of_squares does (fp32 chunks of 4096 added in fp64); when `fixed` is
// given it gets the exact squares, as sum_of_squares_fixed does. In place by 1 (fp32, src
// == dst, factor 1) nothing is written: the pass only reads.
bool unscale(DType src_dtype, const void* src, float* dst, size_t count, float factor,
             bool check_finite, double* partial, FixedSquares* fixed);

}  // namespace cpu
}  // namespace hps
