// Element type conversion between the float dtypes (fp32, fp64, fp16, bf16), round to
// nearest even (core/common/half.h).
#pragma once

#include <cstddef>

#include "core/common/dtype.h"

namespace hps::cpu {

// out[i] = in[i] converted from `from` to `to` through fp32 (fp64 ⇄ fp32 rounds once; fp64
// → fp16 / bf16 twice), NaN payloads as core/common/half.h keeps them; both must be float
// dtypes (otherwise nothing is written).
void cast(DType from, const void* in, DType to, void* out, size_t count);
// dst[i] += src[i] converted to fp32 (src a float dtype).
void accumulate(float* dst, DType src_dtype, const void* src, size_t count);

}  // namespace hps::cpu
