// Device-side building blocks of the CUDA kernel table (kernels/cuda/*.cu): element types,
// conversions that give the CPU's bits, 16-byte vector groups, block sums and the exact
// fixed-point squares. Every .cu file is compiled with --fmad=false, so each product rounds
// on its own as in the CPU kernels.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/common/half.h"
#include "core/kernels/cuda/launch.h"
#include "core/kernels/kernel_table.h"

namespace hps::cuda {

inline constexpr int kSlots = FixedSquares::kSlots;

// ---- conversions: 16-bit ones are core/common/half.h's (host/device), NaN payloads kept ----

// fp64 ⇄ fp32 as the host's conversions: rounded to nearest even, and a NaN quieted with
// its top payload bits kept (the GPU's own conversion would give the canonical NaN).
__device__ __forceinline__ float double_to_float(double d) {
  const auto x = static_cast<uint64_t>(__double_as_longlong(d));
  if ((x & 0x7fffffffffffffffull) > 0x7ff0000000000000ull) {
    const auto sign = static_cast<uint32_t>(x >> 32) & 0x80000000u;
    const auto payload = static_cast<uint32_t>((x >> 29) & 0x007fffffu);
    return __uint_as_float(sign | 0x7fc00000u | payload);
  }
  return __double2float_rn(d);
}

__device__ __forceinline__ double float_to_double(float f) {
  const uint32_t x = __float_as_uint(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) {
    const uint64_t sign = static_cast<uint64_t>(x & 0x80000000u) << 32;
    const uint64_t payload = static_cast<uint64_t>(x & 0x007fffffu) << 29;
    return __longlong_as_double(static_cast<long long>(sign | 0x7ff8000000000000ull | payload));
  }
  return static_cast<double>(f);
}

// ---- element types: how a stored value becomes the value it is computed in ----
// load(): the value in the type's compute precision (fp64 for fp64, else fp32); widen():
// as fp32. Both may lose a NaN's payload (arithmetic gives the canonical NaN anyway).
// exact() and store() give the host's bits (cpu::cast goes through fp32), for casts.

struct Fp32 {
  using Storage = float;
  using Compute = float;
  __device__ static float load(float x) { return x; }
  __device__ static float widen(float x) { return x; }
  __device__ static float exact(float x) { return x; }
  __device__ static float store(float x) { return x; }
};
struct Fp16 {
  using Storage = uint16_t;
  using Compute = float;
  __device__ static float load(uint16_t x) { return __half2float(__ushort_as_half(x)); }
  __device__ static float widen(uint16_t x) { return load(x); }
  __device__ static float exact(uint16_t x) { return half_bits_to_float(x); }
  __device__ static uint16_t store(float x) { return float_to_half_bits(x); }
};
struct Bf16 {
  using Storage = uint16_t;
  using Compute = float;
  __device__ static float load(uint16_t x) { return bf16_bits_to_float(x); }
  __device__ static float widen(uint16_t x) { return load(x); }
  __device__ static float exact(uint16_t x) { return bf16_bits_to_float(x); }
  __device__ static uint16_t store(float x) { return float_to_bf16_bits(x); }
};
struct Fp64 {
  using Storage = double;
  using Compute = double;
  __device__ static double load(double x) { return x; }
  __device__ static float widen(double x) { return __double2float_rn(x); }
  __device__ static float exact(double x) { return double_to_float(x); }
  __device__ static double store(float x) { return float_to_double(x); }
};

// Calls f(Type{}) with the element type of a float dtype; INVALID_ARGUMENT for the others.
template <typename F>
Status with_float_type(DType dtype, const char* operation, F&& f) {
  switch (dtype) {
    case DType::kFloat32: return f(Fp32{});
    case DType::kFloat16: return f(Fp16{});
    case DType::kBFloat16: return f(Bf16{});
    case DType::kFloat64: return f(Fp64{});
    default:
      return invalid_argument(std::string(operation) + ": dtype " + std::string(dtype_name(dtype)) +
                              " is not a float type");
  }
}

// ---- vector groups: W consecutive elements moved by 16-byte (or narrower) accesses ----

constexpr size_t group_alignment(size_t bytes) { return bytes < 16 ? bytes : 16; }

template <typename T, int W>
struct alignas(group_alignment(sizeof(T) * W)) Group {
  T v[W];
};

// Elements per group: one 16-byte load of the type.
template <typename T>
inline constexpr int kGroupOf = static_cast<int>(16 / sizeof(T));

// Whether `p` may be read or written as Group<T, W>.
template <typename T, int W>
inline bool group_aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % alignof(Group<T, W>) == 0;
}

template <int W, typename T>
__device__ __forceinline__ Group<T, W> load_group(const T* base, size_t i) {
  return *reinterpret_cast<const Group<T, W>*>(base + i);
}

template <int W, typename T>
__device__ __forceinline__ void store_group(T* base, size_t i, const Group<T, W>& g) {
  *reinterpret_cast<Group<T, W>*>(base + i) = g;
}

// ---- elementwise kernels ----

// Calls op.apply<W>(i) for every group of W elements (i = 0, W, 2W, ... below the last
// whole group) and op.apply<1>(i) for each element after them, grid-stride.
template <int W, typename Op>
__global__ void __launch_bounds__(kThreads) elementwise(size_t count, Op op) {
  const size_t groups = count / W;
  const size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t g = first; g < groups; g += stride) op.template apply<W>(g * W);
  if constexpr (W > 1) {
    if (first < count - groups * W) op.template apply<1>(groups * W + first);
  }
}

template <int W, typename Op>
Status launch_elementwise(cudaStream_t stream, size_t count, const Op& op, const char* name) {
  const unsigned blocks =
      grid_for(reinterpret_cast<const void*>(&elementwise<W, Op>), count / W + count % W, 1);
  elementwise<W, Op><<<blocks, kThreads, 0, stream>>>(count, op);
  return launched(name);
}

// ---- reductions ----

// The block's sum in a fixed tree (warp shuffles, then the warps' sums); valid in thread 0.
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

// A thread's float-mode sum of squares: fp32 chunks of at most kSquaresChunk elements
// added in fp64 (fp64 data in fp64 throughout), as cpu::sum_of_squares accumulates.
template <typename Compute>
struct SquaresAccumulator {
  Compute chunk = 0;
  unsigned in_chunk = 0;
  double total = 0;

  __device__ __forceinline__ void add(Compute x) {
    chunk += x * x;
    if constexpr (sizeof(Compute) == sizeof(float)) {
      if (++in_chunk == kSquaresChunk) flush();
    }
  }
  __device__ __forceinline__ void flush() {
    total += static_cast<double>(chunk);
    chunk = 0;
    in_chunk = 0;
  }
  __device__ __forceinline__ double finish() {
    flush();
    return total;
  }
};

// A thread's exact squares: its own digits, normalized often enough that none overflows.
struct FixedAccumulator {
  int64_t slots[kSlots] = {};
  unsigned added = 0;

  __device__ __forceinline__ void add(double x) {
    fixed_add_square(slots, x * x);  // exact for fp32/fp16/bf16 values; one rounding for fp64
    if (++added == (1u << 20)) {
      fixed_normalize(slots);
      added = 0;
    }
  }
};

// Adds every thread's digits into `out` (device memory): a block sum in shared memory,
// then one atomic per non-zero digit and block. Integer additions: the order does not
// matter, so the result is exact. `out` is normalized afterwards (normalize_slots).
__device__ inline void add_block_digits(FixedAccumulator& mine, int64_t* out) {
  __shared__ unsigned long long block[kSlots];
  if (threadIdx.x < kSlots) block[threadIdx.x] = 0;
  __syncthreads();
  fixed_normalize(mine.slots);
  for (int s = 0; s < kSlots; ++s) {
    if (mine.slots[s] != 0) {
      atomicAdd(&block[s], static_cast<unsigned long long>(mine.slots[s]));
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t sum[kSlots];
    for (int s = 0; s < kSlots; ++s) sum[s] = static_cast<int64_t>(block[s]);
    fixed_normalize(sum);
    for (int s = 0; s < kSlots; ++s) {
      if (sum[s] != 0) {
        atomicAdd(reinterpret_cast<unsigned long long*>(out + s),
                  static_cast<unsigned long long>(sum[s]));
      }
    }
  }
}

}  // namespace hps::cuda
