#include "core/comm/reduce_ops.h"

#include <algorithm>
#include <cstdint>

#include "core/common/half.h"

namespace hps {
namespace {

template <typename T>
void reduce_typed(ReduceOp op, T* out, const T* a, const T* b, size_t n) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      for (size_t i = 0; i < n; ++i) out[i] = static_cast<T>(a[i] + b[i]);
      return;
    case ReduceOp::kMax:
      for (size_t i = 0; i < n; ++i) out[i] = std::max(a[i], b[i]);
      return;
    case ReduceOp::kMin:
      for (size_t i = 0; i < n; ++i) out[i] = std::min(a[i], b[i]);
      return;
  }
}

using Decode = float (*)(uint16_t);
using Encode = uint16_t (*)(float);

template <Decode decode, Encode encode>
void reduce_half(ReduceOp op, uint16_t* out, const uint16_t* a, const uint16_t* b, size_t n) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      for (size_t i = 0; i < n; ++i) out[i] = encode(decode(a[i]) + decode(b[i]));
      return;
    case ReduceOp::kMax:
      for (size_t i = 0; i < n; ++i) out[i] = encode(std::max(decode(a[i]), decode(b[i])));
      return;
    case ReduceOp::kMin:
      for (size_t i = 0; i < n; ++i) out[i] = encode(std::min(decode(a[i]), decode(b[i])));
      return;
  }
}

template <typename T>
void average_typed(T* buffer, size_t n, int32_t divisor) {
  for (size_t i = 0; i < n; ++i) buffer[i] = static_cast<T>(buffer[i] / static_cast<T>(divisor));
}

template <Decode decode, Encode encode>
void average_half(uint16_t* buffer, size_t n, int32_t divisor) {
  const float d = static_cast<float>(divisor);
  for (size_t i = 0; i < n; ++i) buffer[i] = encode(decode(buffer[i]) / d);
}

}  // namespace

void reduce_elements(DType dtype, ReduceOp op, void* out, const void* a, const void* b,
                     size_t count) {
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

void finish_average(DType dtype, void* buffer, size_t count, int32_t divisor) {
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
