// Gradient-norm kernels: sum of squares and in-place scaling of flat buffers. The CPU
// versions (kernels/cpu/) are vectorised and chunked; the CUDA ones live behind the kernel
// table (kernel_table.h, kernels/cuda/).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "core/common/config.h"
#include "core/common/dtype.h"
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
