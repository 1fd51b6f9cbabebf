#include "core/comm/reduce_ops.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/common/half.h"

namespace hps {
namespace {

// Inlined into each of the public functions' target clones below, so every clone gets its
// own vectorised copy.
#define HPS_INLINE __attribute__((always_inline)) inline

// MAX and MIN propagate NaN (as torch.maximum / torch.minimum): a NaN on any rank is the
// result whatever the transport's order of operands (std::max keeps its first argument
// when the other is NaN, so the result depended on which rank held it).
template <typename T>
HPS_INLINE T max_of(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    return (a > b || a != a) ? a : b;
  } else {
    return a < b ? b : a;
  }
}

template <typename T>
HPS_INLINE T min_of(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    return (a < b || a != a) ? a : b;
  } else {
    return b < a ? b : a;
  }
}

// Integer sums wrap around (two's complement, as NCCL's): added as unsigned, whose overflow
// is defined, where a signed overflow would be undefined.
template <typename T>
HPS_INLINE T add(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  } else {
    return a + b;
  }
}

template <typename T>
HPS_INLINE void reduce_typed(ReduceOp op, T* out, const T* a, const T* b, size_t n) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      for (size_t i = 0; i < n; ++i) out[i] = add(a[i], b[i]);
      return;
    case ReduceOp::kMax:
      for (size_t i = 0; i < n; ++i) out[i] = max_of(a[i], b[i]);
      return;
    case ReduceOp::kMin:
      for (size_t i = 0; i < n; ++i) out[i] = min_of(a[i], b[i]);
      return;
  }
}

using Decode = float (*)(uint16_t);
using Encode = uint16_t (*)(float);

template <Decode decode, Encode encode>
HPS_INLINE void reduce_half(ReduceOp op, uint16_t* out, const uint16_t* a, const uint16_t* b,
                            size_t n) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      for (size_t i = 0; i < n; ++i) out[i] = encode(decode(a[i]) + decode(b[i]));
      return;
    case ReduceOp::kMax:
      for (size_t i = 0; i < n; ++i) out[i] = encode(max_of(decode(a[i]), decode(b[i])));
      return;
    case ReduceOp::kMin:
      for (size_t i = 0; i < n; ++i) out[i] = encode(min_of(decode(a[i]), decode(b[i])));
      return;
  }
}

template <typename T>
HPS_INLINE void average_typed(T* buffer, size_t n, int32_t divisor) {
  for (size_t i = 0; i < n; ++i) buffer[i] = static_cast<T>(buffer[i] / static_cast<T>(divisor));
}

template <Decode decode, Encode encode>
HPS_INLINE void average_half(uint16_t* buffer, size_t n, int32_t divisor) {
  const float d = static_cast<float>(divisor);
  for (size_t i = 0; i < n; ++i) buffer[i] = encode(decode(buffer[i]) / d);
}

// Blocks keep the running result in L1 while every input streams past it once.
constexpr size_t kBlock = 2048;

template <typename T>
HPS_INLINE void reduce_many_typed(ReduceOp op, T* out, const void* const* inputs, int32_t n,
                                  size_t count) {
  for (size_t b = 0; b < count; b += kBlock) {
    const size_t len = std::min(kBlock, count - b);
    const T* first = static_cast<const T*>(inputs[0]) + b;
    if (n == 1) {
      if (out + b != first) std::copy(first, first + len, out + b);
      continue;
    }
    reduce_typed(op, out + b, first, static_cast<const T*>(inputs[1]) + b, len);
    for (int32_t q = 2; q < n; ++q) {
      reduce_typed(op, out + b, out + b, static_cast<const T*>(inputs[q]) + b, len);
    }
    if (op == ReduceOp::kAvg) average_typed(out + b, len, n);
  }
}

template <Decode decode, Encode encode>
HPS_INLINE void reduce_many_half(ReduceOp op, uint16_t* out, const void* const* inputs, int32_t n,
                                 size_t count) {
  float acc[kBlock];
  for (size_t b = 0; b < count; b += kBlock) {
    const size_t len = std::min(kBlock, count - b);
    const auto* first = static_cast<const uint16_t*>(inputs[0]) + b;
    for (size_t i = 0; i < len; ++i) acc[i] = decode(first[i]);
    for (int32_t q = 1; q < n; ++q) {
      const auto* in = static_cast<const uint16_t*>(inputs[q]) + b;
      switch (op) {
        case ReduceOp::kSum:
        case ReduceOp::kAvg:
          for (size_t i = 0; i < len; ++i) acc[i] += decode(in[i]);
          break;
        case ReduceOp::kMax:
          for (size_t i = 0; i < len; ++i) acc[i] = max_of(acc[i], decode(in[i]));
          break;
        case ReduceOp::kMin:
          for (size_t i = 0; i < len; ++i) acc[i] = min_of(acc[i], decode(in[i]));
          break;
      }
    }
    // The mean from the fp32 sum, rounded once: finite wherever the mean fits.
    if (op == ReduceOp::kAvg) {
      const float d = static_cast<float>(n);
      for (size_t i = 0; i < len; ++i) out[b + i] = encode(acc[i] / d);
    } else {
      for (size_t i = 0; i < len; ++i) out[b + i] = encode(acc[i]);
    }
  }
}

}  // namespace

// AVX2 clones where the processor has it, chosen once at load time (as for the optimizer
// and norm kernels); element-wise, so every clone gives the same bits.
#define HPS_REDUCE_CLONES __attribute__((target_clones("avx2", "default")))

HPS_REDUCE_CLONES void reduce_elements(DType dtype, ReduceOp op, void* out, const void* a,
                                       const void* b, size_t count) {
  switch (dtype) {
    case DType::kFloat32:
      reduce_typed(op, static_cast<float*>(out), static_cast<const float*>(a),
                   static_cast<const float*>(b), count);
      return;
    case DType::kFloat64:
      reduce_typed(op, static_cast<double*>(out), static_cast<const double*>(a),
                   static_cast<const double*>(b), count);
      return;
    case DType::kInt32:
      reduce_typed(op, static_cast<int32_t*>(out), static_cast<const int32_t*>(a),
                   static_cast<const int32_t*>(b), count);
      return;
    case DType::kInt64:
      reduce_typed(op, static_cast<int64_t*>(out), static_cast<const int64_t*>(a),
                   static_cast<const int64_t*>(b), count);
      return;
    case DType::kUInt8:
      reduce_typed(op, static_cast<uint8_t*>(out), static_cast<const uint8_t*>(a),
                   static_cast<const uint8_t*>(b), count);
      return;
    case DType::kFloat16:
      reduce_half<half_bits_to_float, float_to_half_bits>(op, static_cast<uint16_t*>(out),
                                                          static_cast<const uint16_t*>(a),
                                                          static_cast<const uint16_t*>(b), count);
      return;
    case DType::kBFloat16:
      reduce_half<bf16_bits_to_float, float_to_bf16_bits>(op, static_cast<uint16_t*>(out),
                                                          static_cast<const uint16_t*>(a),
                                                          static_cast<const uint16_t*>(b), count);
      return;
  }
}

HPS_REDUCE_CLONES void reduce_many(DType dtype, ReduceOp op, void* out, const void* const* inputs,
                                   int32_t n, size_t count) {
  switch (dtype) {
    case DType::kFloat32: reduce_many_typed(op, static_cast<float*>(out), inputs, n, count); return;
    case DType::kFloat64:
      reduce_many_typed(op, static_cast<double*>(out), inputs, n, count);
      return;
    case DType::kInt32: reduce_many_typed(op, static_cast<int32_t*>(out), inputs, n, count); return;
    case DType::kInt64: reduce_many_typed(op, static_cast<int64_t*>(out), inputs, n, count); return;
    case DType::kUInt8: reduce_many_typed(op, static_cast<uint8_t*>(out), inputs, n, count); return;
    case DType::kFloat16:
      reduce_many_half<half_bits_to_float, float_to_half_bits>(op, static_cast<uint16_t*>(out),
                                                               inputs, n, count);
      return;
    case DType::kBFloat16:
      reduce_many_half<bf16_bits_to_float, float_to_bf16_bits>(op, static_cast<uint16_t*>(out),
                                                               inputs, n, count);
      return;
  }
}

HPS_REDUCE_CLONES void widen_half(DType dtype, const void* in, float* out, size_t count) {
  const auto* h = static_cast<const uint16_t*>(in);
  if (dtype == DType::kBFloat16) {
    for (size_t i = 0; i < count; ++i) out[i] = bf16_bits_to_float(h[i]);
  } else {
    for (size_t i = 0; i < count; ++i) out[i] = half_bits_to_float(h[i]);
  }
}

HPS_REDUCE_CLONES void narrow_half(DType dtype, const float* sum, void* out, size_t count,
                                   int32_t divisor) {
  auto* h = static_cast<uint16_t*>(out);
  const float d = static_cast<float>(divisor);
  if (dtype == DType::kBFloat16) {
    if (divisor == 1) {
      for (size_t i = 0; i < count; ++i) h[i] = float_to_bf16_bits(sum[i]);
    } else {
      for (size_t i = 0; i < count; ++i) h[i] = float_to_bf16_bits(sum[i] / d);
    }
  } else if (divisor == 1) {
    for (size_t i = 0; i < count; ++i) h[i] = float_to_half_bits(sum[i]);
  } else {
    for (size_t i = 0; i < count; ++i) h[i] = float_to_half_bits(sum[i] / d);
  }
}

HPS_REDUCE_CLONES void finish_average(DType dtype, void* buffer, size_t count, int32_t divisor) {
  switch (dtype) {
    case DType::kFloat32: average_typed(static_cast<float*>(buffer), count, divisor); return;
    case DType::kFloat64: average_typed(static_cast<double*>(buffer), count, divisor); return;
    case DType::kInt32: average_typed(static_cast<int32_t*>(buffer), count, divisor); return;
    case DType::kInt64: average_typed(static_cast<int64_t*>(buffer), count, divisor); return;
    case DType::kUInt8: average_typed(static_cast<uint8_t*>(buffer), count, divisor); return;
    case DType::kFloat16:
      average_half<half_bits_to_float, float_to_half_bits>(static_cast<uint16_t*>(buffer), count,
                                                           divisor);
      return;
    case DType::kBFloat16:
      average_half<bf16_bits_to_float, float_to_bf16_bits>(static_cast<uint16_t*>(buffer), count,
                                                           divisor);
      return;
  }
}

}  // namespace hps
