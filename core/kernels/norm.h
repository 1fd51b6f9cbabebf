// Gradient-norm kernels: sum of squares and in-place scaling of flat buffers. The CPU
// versions (kernels/cpu/) are vectorised and chunked; names match the CUDA versions.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "core/common/config.h"
#include "core/common/dtype.h"
#include "core/common/status.h"

#if HPS_HAVE_CUDA && defined(__CUDACC__)
#include <cuda_runtime_api.h>
#elif HPS_HAVE_CUDA
// cudaStream_t without the CUDA headers (the same typedef as driver_types.h).
struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;
#endif

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
// given it gets the exact squares, as sum_of_squares_fixed does.
bool unscale(DType src_dtype, const void* src, float* dst, size_t count, float factor,
             bool check_finite, double* partial, FixedSquares* fixed);

}  // namespace cpu

#if HPS_HAVE_CUDA
// The CUDA versions (kernels/cuda/norm.cu). Pointers are device memory; everything is
// enqueued on `stream` and nothing blocks the host. Results do not depend on the device
// (the launch shape depends only on `count`), so a rerun gives the same bits.
namespace cuda {

// The most per-block partials sum_of_squares needs in a scratch buffer (doubles).
inline constexpr size_t kSumOfSquaresMaxBlocks = 1024;

// *partial_out += Σ x² (one double in device memory), in stream order. fp16, bf16 and fp32
// accumulate in fp32 per thread and block, the block partials in fp64 in a fixed order
// (no floating-point atomics); fp64 in fp64 throughout. `scratch` holds at least
// kSumOfSquaresMaxBlocks doubles of device memory, reused in stream order; the overload
// without it takes one from the stream-ordered allocator (cudaMallocAsync) per call.
// INVALID_ARGUMENT for non-float dtypes.
Status sum_of_squares(DType dtype, const void* data, size_t count, double* partial_out,
                      double* scratch, cudaStream_t stream);
Status sum_of_squares(DType dtype, const void* data, size_t count, double* partial_out,
                      cudaStream_t stream);
// The same values added exactly into `*out` (device memory), bit for bit what
// cpu::sum_of_squares_fixed adds; `*out` is left normalized like the CPU one.
Status sum_of_squares_fixed(DType dtype, const void* data, size_t count, FixedSquares* out,
                            cudaStream_t stream);
// data[i] *= *coefficient (device memory): in fp32 for 16-bit types and fp32, in fp64 for
// fp64 (the double overload casts to fp32 for the others, as cpu::scale does).
Status scale(DType dtype, void* data, size_t count, const float* coefficient, cudaStream_t stream);
Status scale(DType dtype, void* data, size_t count, const double* coefficient, cudaStream_t stream);
// One thread: squares = partials[0] + partials[1] (or fixed[0].value() + fixed[1].value()
// when deterministic); norm = sqrt(squares); coefficient = max_norm / (max(norm, max_norm)
// + 1e-6), with the CPU clip's NaN / Inf behaviour. Outputs other than coefficient_out may
// be null; coefficient_fp64_out keeps the unrounded coefficient for fp64 gradients.
Status finish_clip(const double* partials, const FixedSquares* fixed, bool deterministic,
                   double max_norm, float* norm_out, float* coefficient_out,
                   double* coefficient_fp64_out, cudaStream_t stream);

}  // namespace cuda
#endif
}  // namespace hps
