#include "core/kernels/cast.h"

#include "core/kernels/cpu/kernel_set.h"

namespace hps::cpu {

// The vectorised kernels are those of the instruction-set variant in use (kernel_set.h).
void cast(DType from, const void* in, DType to, void* out, size_t count) {
  active_cpu_kernels().cast(from, in, to, out, count);
}

void accumulate(float* dst, DType src_dtype, const void* src, size_t count) {
  active_cpu_kernels().accumulate(dst, src_dtype, src, count);
}

}  // namespace hps::cpu
