// The avx2 variant of the CPU kernels (kernel_set.h): AVX2 with F16C conversions, for
// the functions of kernel_body.inc only (a target pragma around them, so nothing else in
// the process needs these instructions). kernel_set.cc calls into it only where the CPU
// and the OS support them.
#include "core/kernels/cpu/kernel_set.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "core/common/half.h"
#include "core/kernels/kernel_table.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,f16c")
#endif

namespace hps::cpu::avx2 {
#define HPS_KERNEL_ISA CpuIsa::kAvx2
#define HPS_KERNEL_AVX2 1
#include "core/kernels/cpu/kernel_body.inc"
}  // namespace hps::cpu::avx2

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace hps::cpu {
const CpuKernelSet* avx2_kernel_set() { return &avx2::kKernelSet; }
}  // namespace hps::cpu

#else

namespace hps::cpu {
const CpuKernelSet* avx2_kernel_set() { return nullptr; }  // not an x86-64 build
}  // namespace hps::cpu

#endif
