// The baseline variant of the CPU kernels (kernel_set.h): the build's default instruction
// set (SSE2 on x86-64); runs everywhere.
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "core/common/half.h"
#include "core/kernels/cpu/kernel_set.h"
#include "core/kernels/kernel_table.h"

namespace hps::cpu {
namespace baseline {
#define HPS_KERNEL_ISA CpuIsa::kBaseline
#define HPS_KERNEL_AVX2 0
#include "core/kernels/cpu/kernel_body.inc"
}  // namespace baseline

const CpuKernelSet* baseline_kernel_set() { return &baseline::kKernelSet; }

}  // namespace hps::cpu
