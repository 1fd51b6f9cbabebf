#include "core/kernels/cast.h"

#include <cstdint>
#include <cstring>

#include "core/common/half.h"

namespace hps::cpu {
namespace {

float load(DType d, const void* p, size_t i) {
  switch (d) {
    case DType::kFloat32: return static_cast<const float*>(p)[i];
    case DType::kFloat64: return static_cast<float>(static_cast<const double*>(p)[i]);
    case DType::kFloat16: return half_bits_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::kBFloat16: return bf16_bits_to_float(static_cast<const uint16_t*>(p)[i]);
    default: return 0;
  }
}

void store(DType d, void* p, size_t i, float v) {
  switch (d) {
    case DType::kFloat32: static_cast<float*>(p)[i] = v; return;
    case DType::kFloat64: static_cast<double*>(p)[i] = v; return;
    case DType::kFloat16: static_cast<uint16_t*>(p)[i] = float_to_half_bits(v); return;
    case DType::kBFloat16: static_cast<uint16_t*>(p)[i] = float_to_bf16_bits(v); return;
    default: return;
  }
}

}  // namespace

void cast(DType from, const void* in, DType to, void* out, size_t count) {
  if (from == to) {
    std::memmove(out, in, count * dtype_size(from));
    return;
  }
  if (from == DType::kBFloat16 && to == DType::kFloat32) {  // the hot path of mixed precision
    const auto* x = static_cast<const uint16_t*>(in);
    auto* y = static_cast<float*>(out);
#pragma omp simd
    for (size_t i = 0; i < count; ++i) y[i] = bf16_bits_to_float(x[i]);
    return;
  }
  for (size_t i = 0; i < count; ++i) store(to, out, i, load(from, in, i));
}

}  // namespace hps::cpu
