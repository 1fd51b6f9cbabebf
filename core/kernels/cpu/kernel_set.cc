// Picks the CPU kernels' variant (kernel_set.h): the best one the CPU and the OS support.
#include "core/kernels/cpu/kernel_set.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include <atomic>
#include <utility>

namespace hps::cpu {

// kernels_<isa>.cc: null where the build has no such variant.
const CpuKernelSet* baseline_kernel_set();
const CpuKernelSet* avx2_kernel_set();
const CpuKernelSet* avx512_kernel_set();

namespace {

// What the kernels care about, from CPUID, counting a vector extension only when the OS
// saves its registers (XCR0).
struct Features {
  bool avx2 = false, f16c = false, fma = false, avx512f = false, avx512bw = false, avx512vl = false,
       avx512dq = false, avx512bf16 = false;
};

#if defined(__x86_64__)
uint64_t xcr0() {
  uint32_t low = 0, high = 0;
  __asm__ volatile("xgetbv" : "=a"(low), "=d"(high) : "c"(0));
  return (static_cast<uint64_t>(high) << 32) | low;
}
#endif

Features read_features() {
  Features x;
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(1, &a, &b, &c, &d) == 0) return x;
  const bool osxsave = (c >> 27) & 1u;
  const uint64_t state = osxsave ? xcr0() : 0;
  const bool ymm = (state & 0x6u) == 0x6u;    // SSE and AVX state
  const bool zmm = (state & 0xe6u) == 0xe6u;  // and the opmask and upper ZMM state
  const bool avx = ymm && ((c >> 28) & 1u);
  x.fma = avx && ((c >> 12) & 1u);
  x.f16c = avx && ((c >> 29) & 1u);
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return x;
  const unsigned leaf7_subleaves = a;
  x.avx2 = avx && ((b >> 5) & 1u);
  x.avx512f = zmm && ((b >> 16) & 1u);
  x.avx512dq = x.avx512f && ((b >> 17) & 1u);
  x.avx512bw = x.avx512f && ((b >> 30) & 1u);
  x.avx512vl = x.avx512f && ((b >> 31) & 1u);
  if (leaf7_subleaves >= 1 && __get_cpuid_count(7, 1, &a, &b, &c, &d) != 0) {
    x.avx512bf16 = x.avx512f && ((a >> 5) & 1u);
  }
#endif
  return x;
}

const Features& features() {
  static const Features f = read_features();
  return f;
}

const CpuKernelSet* compiled(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kBaseline: return baseline_kernel_set();
    case CpuIsa::kAvx2: return avx2_kernel_set();
    case CpuIsa::kAvx512: return avx512_kernel_set();
  }
  return nullptr;
}

bool cpu_runs(CpuIsa isa) {
  const Features& f = features();
  switch (isa) {
    case CpuIsa::kBaseline: return true;
    case CpuIsa::kAvx2: return f.avx2 && f.f16c;
    case CpuIsa::kAvx512:
      return f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.avx2 && f.f16c;
  }
  return false;
}

std::atomic<const CpuKernelSet*>& selected() {
  static std::atomic<const CpuKernelSet*> set{compiled(best_cpu_isa())};
  return set;
}

}  // namespace

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kBaseline: return "baseline";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
  }
  return "unknown";
}

StatusOr<CpuIsa> cpu_isa_from_name(std::string_view name) {
  for (CpuIsa isa : kAllCpuIsas) {
    if (name == cpu_isa_name(isa)) return isa;
  }
  return invalid_argument("cpu kernels: '" + std::string(name) +
                          "' is not an instruction set (baseline, avx2 or avx512)");
}

bool cpu_isa_supported(CpuIsa isa) { return compiled(isa) != nullptr && cpu_runs(isa); }

CpuIsa best_cpu_isa() {
  for (CpuIsa isa : {CpuIsa::kAvx512, CpuIsa::kAvx2}) {
    if (cpu_isa_supported(isa)) return isa;
  }
  return CpuIsa::kBaseline;
}

std::string cpu_feature_text() {
  const Features& f = features();
  const std::pair<const char*, bool> named[] = {
      {"avx2", f.avx2},         {"f16c", f.f16c},
      {"fma", f.fma},           {"avx512f", f.avx512f},
      {"avx512bw", f.avx512bw}, {"avx512vl", f.avx512vl},
      {"avx512dq", f.avx512dq}, {"avx512bf16", f.avx512bf16}};
  std::string text;
  for (const auto& [name, present] : named) {
    if (present) text += (text.empty() ? "" : " ") + std::string(name);
  }
  return text.empty() ? "none of avx2 f16c fma avx512*" : text;
}

StatusOr<const CpuKernelSet*> cpu_kernel_set(CpuIsa isa) {
  const CpuKernelSet* set = compiled(isa);
  if (set == nullptr) {
    return failed_precondition(std::string("cpu kernels: this build has no ") + cpu_isa_name(isa) +
                               " variant");
  }
  return set;
}

const CpuKernelSet& active_cpu_kernels() { return *selected().load(std::memory_order_acquire); }

Status select_cpu_kernels(CpuIsa isa) {
  if (!cpu_isa_supported(isa)) {
    return failed_precondition(std::string("cpu kernels: this CPU cannot run the ") +
                               cpu_isa_name(isa) + " variant (it has: " + cpu_feature_text() + ")");
  }
  selected().store(compiled(isa), std::memory_order_release);
  return Status::Ok();
}

}  // namespace hps::cpu
