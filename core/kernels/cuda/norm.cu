// Gradient-norm kernels on CUDA (declared in kernels/norm.h). Deterministic by
// construction: the launch shape depends only on the element count, every floating-point
// sum is a fixed tree (warp shuffles, then one block over the block partials, in index
// order), and the only atomics are integer ones (the fixed-point digits), which are exact
// and order-independent. Compiled with --fmad=false so each product is rounded on its own,
// as the CPU kernels do.
#include <cuda_runtime.h>

#include <cstdint>

#include "core/device/cuda/error.h"
#include "core/kernels/norm.h"

namespace hps::cuda {
namespace {

constexpr int kThreads = 256;      // per block; a multiple of the warp size
constexpr size_t kPerThread = 16;  // fewer blocks until each thread has this many
constexpr size_t kScaleMaxBlocks = 8192;
constexpr int kDigits = FixedSquares::kDigits;
constexpr int kSlots = FixedSquares::kSlots;
static_assert(sizeof(FixedSquares) == sizeof(int64_t) * kSlots, "FixedSquares is its slots");

// fp16 / bf16 ⇄ fp32 exactly as core/common/half.h does it (same bits, NaN payloads too).
__device__ inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return __uint_as_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return __uint_as_float(sign | __float_as_uint(magnitude));
  }
  return __uint_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

__device__ inline uint16_t float_to_half_bits(float f) {
  const uint32_t x = __float_as_uint(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t magnitude = x & 0x7fffffffu;
  if (magnitude > 0x7f800000u) {
    return static_cast<uint16_t>(sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu));
  }
  if (magnitude >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (magnitude < 0x38800000u) {
    const float shifted = __uint_as_float(magnitude) + 0.5f;
    return static_cast<uint16_t>(sign | (__float_as_uint(shifted) - 0x3f000000u));
  }
  const uint32_t mantissa_odd = (magnitude >> 13) & 1u;
  magnitude += 0xc8000fffu + mantissa_odd;
  return static_cast<uint16_t>(sign | (magnitude >> 13));
}

__device__ inline float bf16_bits_to_float(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}

__device__ inline uint16_t float_to_bf16_bits(float f) {
  const uint32_t x = __float_as_uint(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x0040u);
  const uint32_t lsb = (x >> 16) & 1u;
  return static_cast<uint16_t>((x + 0x7fffu + lsb) >> 16);
}

// Element types: how a stored value becomes the fp32 (or fp64) it is computed in.
struct Fp32 {
  using Storage = float;
  using Compute = float;
  __device__ static float load(float x) { return x; }
  __device__ static float store(float x) { return x; }
};
struct Fp16 {
  using Storage = uint16_t;
  using Compute = float;
  __device__ static float load(uint16_t x) { return half_bits_to_float(x); }
  __device__ static uint16_t store(float x) { return float_to_half_bits(x); }
};
struct Bf16 {
  using Storage = uint16_t;
  using Compute = float;
  __device__ static float load(uint16_t x) { return bf16_bits_to_float(x); }
  __device__ static uint16_t store(float x) { return float_to_bf16_bits(x); }
};
struct Fp64 {
  using Storage = double;
  using Compute = double;
  __device__ static double load(double x) { return x; }
  __device__ static double store(double x) { return x; }
};

// Blocks for `count` elements: a function of the count alone, never of the device.
unsigned blocks_for(size_t count, size_t max_blocks) {
  const size_t per_block = static_cast<size_t>(kThreads) * kPerThread;
  size_t blocks = (count + per_block - 1) / per_block;
  if (blocks < 1) blocks = 1;
  if (blocks > max_blocks) blocks = max_blocks;
  return static_cast<unsigned>(blocks);
}

// The block's sum in a fixed tree; the result is valid in thread 0.
template <typename T>
__device__ T block_sum(T value) {
  __shared__ T warp_sums[kThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) {
    value += __shfl_down_sync(0xffffffffu, value, offset);
  }
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int warp = static_cast<int>(threadIdx.x / 32);
  if (lane == 0) warp_sums[warp] = value;
  __syncthreads();
  if (warp == 0) {
    value = lane < kThreads / 32 ? warp_sums[lane] : T(0);
    for (int offset = 16; offset > 0; offset /= 2) {
      value += __shfl_down_sync(0xffffffffu, value, offset);
    }
  }
  return value;
}

// Pass 1: one partial per block, accumulated in the type's compute precision.
template <typename Type>
__global__ void __launch_bounds__(kThreads)
    block_squares(const typename Type::Storage* x, size_t count, double* block_partials) {
  using Compute = typename Type::Compute;
  Compute sum = 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    const Compute v = Type::load(x[i]);
    sum += v * v;
  }
  sum = block_sum(sum);
  if (threadIdx.x == 0) block_partials[blockIdx.x] = static_cast<double>(sum);
}

// Pass 2: one block adds the block partials in fp64, in a fixed order, to *out.
__global__ void __launch_bounds__(kThreads)
    add_block_partials(const double* block_partials, unsigned blocks, double* out) {
  double sum = 0;
  for (unsigned i = threadIdx.x; i < blocks; i += blockDim.x) sum += block_partials[i];
  sum = block_sum(sum);
  if (threadIdx.x == 0) *out += sum;
}

// FixedSquares::add_square and ::normalize, operation for operation.
__device__ void add_square(int64_t* slots, double square) {
  if (isnan(square)) {
    ++slots[kDigits + 1];
    return;
  }
  if (square >= 0x1p160) {
    ++slots[kDigits];
    return;
  }
  if (square < 0x1p-160) return;
  int exponent = 0;
  const double fraction = frexp(square, &exponent);
  auto mantissa = static_cast<uint64_t>(ldexp(fraction, 53));
  int shift = exponent - 53 - FixedSquares::kLowestExponent;
  if (shift < 0) {
    mantissa >>= -shift;
    shift = 0;
  }
  constexpr uint64_t kMask = 0xffffffffu;
  const int offset = shift % 32;
  const int digit = shift / 32;
  const uint64_t low = (mantissa & kMask) << offset;
  const uint64_t high = (mantissa >> 32) << offset;
  slots[digit] += static_cast<int64_t>(low & kMask);
  slots[digit + 1] += static_cast<int64_t>((low >> 32) + (high & kMask));
  slots[digit + 2] += static_cast<int64_t>(high >> 32);
}

__device__ void normalize(int64_t* slots) {
  for (int i = 0; i + 1 < kDigits; ++i) {
    slots[i + 1] += slots[i] >> 32;
    slots[i] &= 0xffffffff;
  }
}

// Each thread sums exactly, the block's threads meet in shared memory and each block adds
// its normalized digits to `out` — all integer additions, so the order does not matter.
template <typename Type>
__global__ void __launch_bounds__(kThreads)
    fixed_squares(const typename Type::Storage* x, size_t count, int64_t* out) {
  __shared__ unsigned long long block[kSlots];
  if (threadIdx.x < kSlots) block[threadIdx.x] = 0;
  __syncthreads();
  int64_t local[kSlots] = {};
  size_t n = 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    const double v = static_cast<double>(Type::load(x[i]));
    add_square(local, v * v);  // exact for fp32/fp16/bf16; one rounding for fp64, as on CPU
    if ((++n & 0xfffff) == 0) normalize(local);  // keep every digit far from overflow
  }
  normalize(local);
  for (int s = 0; s < kSlots; ++s) {
    if (local[s] != 0) atomicAdd(&block[s], static_cast<unsigned long long>(local[s]));
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t sum[kSlots];
    for (int s = 0; s < kSlots; ++s) sum[s] = static_cast<int64_t>(block[s]);
    normalize(sum);
    for (int s = 0; s < kSlots; ++s) {
      if (sum[s] != 0) {
        atomicAdd(reinterpret_cast<unsigned long long*>(out + s),
                  static_cast<unsigned long long>(sum[s]));
      }
    }
  }
}

// After every block: the canonical form the CPU leaves.
__global__ void normalize_slots(int64_t* slots) { normalize(slots); }

template <typename Type, typename Coefficient>
__global__ void __launch_bounds__(kThreads)
    scale_values(typename Type::Storage* x, size_t count, const Coefficient* coefficient) {
  using Compute = typename Type::Compute;
  const auto c = static_cast<Compute>(*coefficient);
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    x[i] = Type::store(Type::load(x[i]) * c);
  }
}

__device__ double fixed_value(const int64_t* slots) {
  if (slots[kDigits + 1] != 0) return __longlong_as_double(0x7ff8000000000000ll);  // NaN
  if (slots[kDigits] != 0) return __longlong_as_double(0x7ff0000000000000ll);      // +Inf
  int64_t n[kSlots];
  for (int s = 0; s < kSlots; ++s) n[s] = slots[s];
  normalize(n);
  double v = 0;
  for (int i = kDigits - 1; i >= 0; --i) {
    v += ldexp(static_cast<double>(n[i]), 32 * i + FixedSquares::kLowestExponent);
  }
  return v;
}

__global__ void finish_clip_kernel(const double* partials, const int64_t* fixed, bool deterministic,
                                   double max_norm, float* norm_out, float* coefficient_out,
                                   double* coefficient_fp64_out) {
  const double squares =
      deterministic ? fixed_value(fixed) + fixed_value(fixed + kSlots) : partials[0] + partials[1];
  const double norm = sqrt(squares);
  // NaN stays NaN (torch's clip_grad_norm_ without error_if_nonfinite); Inf gives 0.
  const double denominator = (norm < max_norm ? max_norm : norm) + 1e-6;
  const double coefficient = max_norm / denominator;
  *coefficient_out = static_cast<float>(coefficient);
  if (coefficient_fp64_out != nullptr) *coefficient_fp64_out = coefficient;
  if (norm_out != nullptr) *norm_out = static_cast<float>(norm);
}

Status launched(const char* operation) { return cuda_status(cudaGetLastError(), operation); }

Status not_float(const char* operation, DType dtype) {
  return invalid_argument(std::string(operation) + ": dtype " + std::string(dtype_name(dtype)) +
                          " is not a float type");
}

template <typename Type>
void launch_squares(const void* data, size_t count, double* partial_out, double* scratch,
                    cudaStream_t stream) {
  const unsigned blocks = blocks_for(count, kSumOfSquaresMaxBlocks);
  block_squares<Type><<<blocks, kThreads, 0, stream>>>(
      static_cast<const typename Type::Storage*>(data), count, scratch);
  add_block_partials<<<1, kThreads, 0, stream>>>(scratch, blocks, partial_out);
}

template <typename Type>
void launch_fixed(const void* data, size_t count, FixedSquares* out, cudaStream_t stream) {
  auto* slots = reinterpret_cast<int64_t*>(out);
  fixed_squares<Type><<<blocks_for(count, kSumOfSquaresMaxBlocks), kThreads, 0, stream>>>(
      static_cast<const typename Type::Storage*>(data), count, slots);
  normalize_slots<<<1, 1, 0, stream>>>(slots);
}

template <typename Type, typename Coefficient>
void launch_scale(void* data, size_t count, const Coefficient* coefficient, cudaStream_t stream) {
  scale_values<Type, Coefficient><<<blocks_for(count, kScaleMaxBlocks), kThreads, 0, stream>>>(
      static_cast<typename Type::Storage*>(data), count, coefficient);
}

template <typename Coefficient>
Status scale_any(DType dtype, void* data, size_t count, const Coefficient* coefficient,
                 cudaStream_t stream) {
  if (!dtype_is_floating(dtype)) return not_float("scale", dtype);
  if (count == 0) return Status::Ok();
  if (data == nullptr || coefficient == nullptr) {
    return invalid_argument("scale: null data or coefficient");
  }
  switch (dtype) {
    case DType::kFloat32: launch_scale<Fp32>(data, count, coefficient, stream); break;
    case DType::kFloat16: launch_scale<Fp16>(data, count, coefficient, stream); break;
    case DType::kBFloat16: launch_scale<Bf16>(data, count, coefficient, stream); break;
    case DType::kFloat64: launch_scale<Fp64>(data, count, coefficient, stream); break;
    default: return not_float("scale", dtype);
  }
  return launched("scale kernel");
}

}  // namespace

Status sum_of_squares(DType dtype, const void* data, size_t count, double* partial_out,
                      double* scratch, cudaStream_t stream) {
  if (!dtype_is_floating(dtype)) return not_float("sum_of_squares", dtype);
  if (count == 0) return Status::Ok();
  if (data == nullptr || partial_out == nullptr || scratch == nullptr) {
    return invalid_argument("sum_of_squares: null data, output or scratch");
  }
  switch (dtype) {
    case DType::kFloat32: launch_squares<Fp32>(data, count, partial_out, scratch, stream); break;
    case DType::kFloat16: launch_squares<Fp16>(data, count, partial_out, scratch, stream); break;
    case DType::kBFloat16: launch_squares<Bf16>(data, count, partial_out, scratch, stream); break;
    case DType::kFloat64: launch_squares<Fp64>(data, count, partial_out, scratch, stream); break;
    default: return not_float("sum_of_squares", dtype);
  }
  return launched("sum_of_squares kernel");
}

Status sum_of_squares(DType dtype, const void* data, size_t count, double* partial_out,
                      cudaStream_t stream) {
  if (!dtype_is_floating(dtype)) return not_float("sum_of_squares", dtype);
  if (count == 0) return Status::Ok();
  void* scratch = nullptr;
  HPS_RETURN_IF_ERROR(
      cuda_status(cudaMallocAsync(&scratch, kSumOfSquaresMaxBlocks * sizeof(double), stream),
                  "cudaMallocAsync"));
  const Status status =
      sum_of_squares(dtype, data, count, partial_out, static_cast<double*>(scratch), stream);
  const Status freed = cuda_status(cudaFreeAsync(scratch, stream), "cudaFreeAsync");
  return status.ok() ? freed : status;
}

Status sum_of_squares_fixed(DType dtype, const void* data, size_t count, FixedSquares* out,
                            cudaStream_t stream) {
  if (!dtype_is_floating(dtype)) return not_float("sum_of_squares_fixed", dtype);
  if (count == 0) return Status::Ok();
  if (data == nullptr || out == nullptr) {
    return invalid_argument("sum_of_squares_fixed: null data or output");
  }
  switch (dtype) {
    case DType::kFloat32: launch_fixed<Fp32>(data, count, out, stream); break;
    case DType::kFloat16: launch_fixed<Fp16>(data, count, out, stream); break;
    case DType::kBFloat16: launch_fixed<Bf16>(data, count, out, stream); break;
    case DType::kFloat64: launch_fixed<Fp64>(data, count, out, stream); break;
    default: return not_float("sum_of_squares_fixed", dtype);
  }
  return launched("sum_of_squares_fixed kernel");
}

Status scale(DType dtype, void* data, size_t count, const float* coefficient, cudaStream_t stream) {
  return scale_any(dtype, data, count, coefficient, stream);
}

Status scale(DType dtype, void* data, size_t count, const double* coefficient,
             cudaStream_t stream) {
  return scale_any(dtype, data, count, coefficient, stream);
}

Status finish_clip(const double* partials, const FixedSquares* fixed, bool deterministic,
                   double max_norm, float* norm_out, float* coefficient_out,
                   double* coefficient_fp64_out, cudaStream_t stream) {
  if (coefficient_out == nullptr || (deterministic ? fixed == nullptr : partials == nullptr)) {
    return invalid_argument("finish_clip: null partial sums or coefficient output");
  }
  finish_clip_kernel<<<1, 1, 0, stream>>>(partials, reinterpret_cast<const int64_t*>(fixed),
                                          deterministic, max_norm, norm_out, coefficient_out,
                                          coefficient_fp64_out);
  return launched("finish_clip kernel");
}

}  // namespace hps::cuda
