#include "core/common/dtype.h"

#include <string>

namespace hps {

StatusOr<DType> dtype_from_int(int32_t raw) {
  for (DType d : kAllDTypes) {
    if (static_cast<int32_t>(d) == raw) return d;
  }
  return invalid_argument("unknown dtype value " + std::to_string(raw) +
                          " (known: 0=float32 .. 6=uint8)");
}

StatusOr<DType> dtype_from_name(std::string_view name) {
  struct Alias {
    std::string_view name;
    DType dtype;
  };
  static constexpr Alias kAliases[] = {
      {"fp32", DType::kFloat32}, {"f32", DType::kFloat32},   {"fp64", DType::kFloat64},
      {"f64", DType::kFloat64},  {"fp16", DType::kFloat16},  {"f16", DType::kFloat16},
      {"half", DType::kFloat16}, {"bf16", DType::kBFloat16}, {"i32", DType::kInt32},
      {"i64", DType::kInt64},    {"u8", DType::kUInt8},
  };
  for (DType d : kAllDTypes) {
    if (dtype_name(d) == name) return d;
  }
  for (const Alias& a : kAliases) {
    if (a.name == name) return a.dtype;
  }
  return invalid_argument("unknown dtype name '" + std::string(name) + "'");
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kFloat64: return 8;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kUInt8: return 1;
  }
  return 0;
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
  }
  return "unknown";
}

bool dtype_is_floating(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat64 || dtype == DType::kFloat16 ||
         dtype == DType::kBFloat16;
}

}  // namespace hps
