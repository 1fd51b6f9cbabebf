// Element type conversion between the float dtypes (fp32, fp64, fp16, bf16), round to
// nearest even (core/common/half.h).
#pragma once

#include <cstddef>

#include "core/common/dtype.h"

namespace hps::cpu {

// out[i] = in[i] converted from `from` to `to`; both must be float dtypes.
void cast(DType from, const void* in, DType to, void* out, size_t count);

}  // namespace hps::cpu
