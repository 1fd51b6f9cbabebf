// The CPU kernels' instruction-set variants. One source (kernels/cpu/kernel_body.inc) is
// compiled once per instruction set (kernels_<isa>.cc); the variant a process uses is picked
// at first use from what the CPU and the OS support, the best first. Every variant gives
// the same bits for the same inputs: elementwise kernels follow the scalar references
// (core/common/half.h conversions, no fused multiply-adds), and reductions add their
// lanes in an order that does not depend on the vector width.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/common/dtype.h"
#include "core/common/status.h"
#include "core/kernels/optimizer.h"

namespace hps::cpu {

enum class CpuIsa : int32_t {
  kBaseline = 0,  // x86-64 (SSE2), or the build's default elsewhere
  kAvx2 = 1,      // AVX2 with F16C conversions
  kAvx512 = 2,    // AVX-512 F, BW, VL and DQ with F16C conversions
};
inline constexpr CpuIsa kAllCpuIsas[] = {CpuIsa::kBaseline, CpuIsa::kAvx2, CpuIsa::kAvx512};

// "baseline", "avx2", "avx512": what the bench prints and --isa takes.
const char* cpu_isa_name(CpuIsa isa);
// INVALID_ARGUMENT naming the text when it is none of the names.
StatusOr<CpuIsa> cpu_isa_from_name(std::string_view name);
// Whether this build has the variant and this CPU and OS can run it.
bool cpu_isa_supported(CpuIsa isa);
// The best variant this CPU runs.
CpuIsa best_cpu_isa();
// The instruction-set extensions the kernels care about, as this CPU reports them
// ("avx2 f16c fma avx512f ..."), for benchmark headers.
std::string cpu_feature_text();

// One variant's kernels (the contracts are those of the functions of the same name in
// norm.h, cast.h and optimizer.h).
struct CpuKernelSet {
  CpuIsa isa;
  double (*sum_of_squares)(DType dtype, const void* data, size_t count);
  void (*scale)(DType dtype, void* data, size_t count, double coefficient);
  void (*cast)(DType from, const void* in, DType to, void* out, size_t count);
  void (*accumulate)(float* dst, DType src_dtype, const void* src, size_t count);
  // The unscale pass without the exact squares (norm.cc adds those): returns false when
  // `check_finite` and a result is Inf or NaN; adds the fp32-chunked squares to *partial
  // when it is given.
  bool (*unscale)(DType src_dtype, const void* src, float* dst, size_t count, float factor,
                  bool check_finite, double* partial);
  void (*sgd)(float* param, const float* grad, float* momentum_buffer, size_t count,
              const SgdHyper& h, const float* clip_coefficient, float grad_scale, bool first_step);
  void (*adamw)(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, size_t count,
                const AdamWHyper& h, AdamWConstants constants, const float* clip_coefficient,
                float grad_scale);
};

// The variant `isa` as compiled; its kernels may be called only where cpu_isa_supported(isa).
// FAILED_PRECONDITION when this build lacks it.
StatusOr<const CpuKernelSet*> cpu_kernel_set(CpuIsa isa);
// The variant in use: best_cpu_isa() unless select_cpu_kernels() chose another.
const CpuKernelSet& active_cpu_kernels();
// Makes `isa` the variant in use (benchmarks compare variants). FAILED_PRECONDITION when
// this CPU cannot run it. Call it before kernels run: a kernel already running finishes on
// the variant it started with.
Status select_cpu_kernels(CpuIsa isa);

}  // namespace hps::cpu
