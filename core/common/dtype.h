// The element types hpshard moves and reduces.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "core/common/status.h"

namespace hps {

// Numeric values equal the C API's hps_dtype_t.
enum class DType : int32_t {
  kFloat32 = 0,
  kFloat64 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
  kInt32 = 4,
  kInt64 = 5,
  kUInt8 = 6,
};

inline constexpr DType kAllDTypes[] = {DType::kFloat32,  DType::kFloat64, DType::kFloat16,
                                       DType::kBFloat16, DType::kInt32,   DType::kInt64,
                                       DType::kUInt8};

// Converts a raw value (from the C API, a file, a peer) into a DType, or says why not.
StatusOr<DType> dtype_from_int(int32_t raw);
// "float32" (also "fp32", "f32"), "bfloat16" ("bf16"), ... → DType.
StatusOr<DType> dtype_from_name(std::string_view name);

size_t dtype_size(DType dtype);
std::string_view dtype_name(DType dtype);
bool dtype_is_floating(DType dtype);

}  // namespace hps
