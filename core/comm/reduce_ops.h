// Element-wise reductions used by the CPU collectives. fp16 and bf16 are reduced in
// fp32 (and rounded once per step); the rest in their own type.
#pragma once

#include <cstddef>

#include "core/comm/communicator.h"

namespace hps {

// out[i] = op(a[i], b[i]) for i < count; out may alias a or b. kAvg reduces as kSum
// (the division by the group size is finish_average's).
void reduce_elements(DType dtype, ReduceOp op, void* out, const void* a, const void* b,
                     size_t count);
// out[i] = op(inputs[0][i], ..., inputs[n-1][i]), applied in input order, so every rank
// that reduces the same inputs gets the same bits; kAvg: that sum divided by n (integers:
// truncating). fp16 / bf16 accumulate in fp32 and round once (kAvg: the mean). out may
// alias inputs[0].
void reduce_many(DType dtype, ReduceOp op, void* out, const void* const* inputs, int32_t n,
                 size_t count);
// buffer[i] /= divisor (integers: truncating division).
void finish_average(DType dtype, void* buffer, size_t count, int32_t divisor);
// out[i] = the float16 or bfloat16 (`dtype`) bits `in[i]` as fp32.
void widen_half(DType dtype, const void* in, float* out, size_t count);
// out[i] = sum[i] / divisor rounded to `dtype` (float16 or bfloat16) bits: one rounding.
void narrow_half(DType dtype, const float* sum, void* out, size_t count, int32_t divisor);

}  // namespace hps
