// The counting wrappers behind cuda_sync_interposer.h. Each __wrap_X is what a reference to
// X resolves to in a binary linked with --wrap=X (the options travel with the CMake target);
// __real_X is the runtime's own X.
#include "tests/support/cuda_sync_interposer.h"

#include <dlfcn.h>

#include <atomic>
#include <cstdio>

#include "core/common/config.h"

#if HPS_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace hps::testing_util {
namespace {

std::atomic<uint64_t> g_counts[kCudaSyncKinds];
thread_local std::array<uint64_t, kCudaSyncKinds> t_counts{};

// The callers of the latest counted calls, for describe().
constexpr size_t kCallers = 8;
std::atomic<const void*> g_callers[kCallers];
std::atomic<size_t> g_next_caller{0};

[[maybe_unused]] void record(CudaSyncKind kind, const void* caller) {
  const auto k = static_cast<size_t>(kind);
  g_counts[k].fetch_add(1, std::memory_order_relaxed);
  ++t_counts[k];
  g_callers[g_next_caller.fetch_add(1, std::memory_order_relaxed) % kCallers].store(
      caller, std::memory_order_relaxed);
}

const char* const kNames[kCudaSyncKinds] = {"stream_synchronize",
                                            "event_synchronize",
                                            "device_synchronize",
                                            "blocking_copy",
                                            "blocking_memset",
                                            "pageable_copy",
                                            "free"};

}  // namespace

uint64_t CudaSyncCounts::total() const {
  uint64_t sum = 0;
  for (const uint64_t c : calls) sum += c;
  return sum;
}

std::string CudaSyncCounts::describe() const {
  std::string text;
  for (int k = 0; k < kCudaSyncKinds; ++k) {
    text += std::string(k == 0 ? "" : " ") + kNames[k] + "=" + std::to_string(calls[k]);
  }
  text += "; latest callers:";
  for (size_t i = 0; i < kCallers; ++i) {
    const void* caller = g_callers[i].load(std::memory_order_relaxed);
    if (caller == nullptr) continue;
    Dl_info info{};
    char line[512];
    if (dladdr(caller, &info) != 0 && info.dli_sname != nullptr) {
      std::snprintf(line, sizeof line, " %s+%#lx", info.dli_sname,
                    static_cast<unsigned long>(static_cast<const char*>(caller) -
                                               static_cast<const char*>(info.dli_saddr)));
    } else {
      std::snprintf(line, sizeof line, " %p", caller);
    }
    text += line;
  }
  return text;
}

CudaSyncCounts cuda_sync_counts() {
  CudaSyncCounts c;
  for (int k = 0; k < kCudaSyncKinds; ++k) c.calls[k] = g_counts[k].load();
  return c;
}

CudaSyncCounts cuda_sync_counts_thread() {
  CudaSyncCounts c;
  c.calls = t_counts;
  return c;
}

void cuda_sync_reset() {
  for (auto& c : g_counts) c.store(0);
  for (auto& c : g_callers) c.store(nullptr);
  t_counts = {};
}

}  // namespace hps::testing_util

#if HPS_HAVE_CUDA

using hps::testing_util::CudaSyncKind;

namespace {

// Whether `p` is host memory the runtime does not know (pageable).
bool pageable(const void* p) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
    (void)cudaGetLastError();  // not the caller's error
    return false;
  }
  return attributes.type == cudaMemoryTypeUnregistered;
}

bool stages_through_host(void* dst, const void* src, cudaMemcpyKind kind) {
  switch (kind) {
    case cudaMemcpyHostToDevice: return pageable(src);
    case cudaMemcpyDeviceToHost: return pageable(dst);
    case cudaMemcpyDeviceToDevice: return false;
    default: return pageable(src) || pageable(dst);
  }
}

}  // namespace

// The per-thread-default-stream forms, which cuda_runtime_api.h declares only when that mode
// is on.
extern "C" {
cudaError_t cudaStreamSynchronize_ptsz(cudaStream_t stream);
cudaError_t cudaMemcpy_ptds(void* dst, const void* src, size_t count, cudaMemcpyKind kind);
cudaError_t cudaMemcpy2D_ptds(void* dst, size_t dpitch, const void* src, size_t spitch,
                              size_t width, size_t height, cudaMemcpyKind kind);
cudaError_t cudaMemcpy3D_ptds(const cudaMemcpy3DParms* p);
cudaError_t cudaMemcpyToSymbol_ptds(const void* symbol, const void* src, size_t count,
                                    size_t offset, cudaMemcpyKind kind);
cudaError_t cudaMemcpyFromSymbol_ptds(void* dst, const void* symbol, size_t count, size_t offset,
                                      cudaMemcpyKind kind);
cudaError_t cudaMemset_ptds(void* p, int value, size_t count);
cudaError_t cudaMemset2D_ptds(void* p, size_t pitch, int value, size_t width, size_t height);
cudaError_t cudaMemset3D_ptds(cudaPitchedPtr p, int value, cudaExtent extent);
cudaError_t cudaMemcpyAsync_ptsz(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                                 cudaStream_t stream);
}

// A wrapper that counts every call of `name` as `kind`.
#define HPS_COUNTED(name, kind, params, args)                                   \
  extern "C" cudaError_t __real_##name params;                                  \
  extern "C" cudaError_t __wrap_##name params {                                 \
    hps::testing_util::record(CudaSyncKind::kind, __builtin_return_address(0)); \
    return __real_##name args;                                                  \
  }

HPS_COUNTED(cudaStreamSynchronize, kStreamSynchronize, (cudaStream_t s), (s))
HPS_COUNTED(cudaStreamSynchronize_ptsz, kStreamSynchronize, (cudaStream_t s), (s))
HPS_COUNTED(cudaEventSynchronize, kEventSynchronize, (cudaEvent_t e), (e))
HPS_COUNTED(cudaDeviceSynchronize, kDeviceSynchronize, (), ())
HPS_COUNTED(cudaMemcpy, kBlockingCopy, (void* d, const void* s, size_t n, cudaMemcpyKind k),
            (d, s, n, k))
HPS_COUNTED(cudaMemcpy_ptds, kBlockingCopy, (void* d, const void* s, size_t n, cudaMemcpyKind k),
            (d, s, n, k))
HPS_COUNTED(cudaMemcpy2D, kBlockingCopy,
            (void* d, size_t dp, const void* s, size_t sp, size_t w, size_t h, cudaMemcpyKind k),
            (d, dp, s, sp, w, h, k))
HPS_COUNTED(cudaMemcpy2D_ptds, kBlockingCopy,
            (void* d, size_t dp, const void* s, size_t sp, size_t w, size_t h, cudaMemcpyKind k),
            (d, dp, s, sp, w, h, k))
HPS_COUNTED(cudaMemcpy3D, kBlockingCopy, (const cudaMemcpy3DParms* p), (p))
HPS_COUNTED(cudaMemcpy3D_ptds, kBlockingCopy, (const cudaMemcpy3DParms* p), (p))
HPS_COUNTED(cudaMemcpyPeer, kBlockingCopy, (void* d, int dd, const void* s, int sd, size_t n),
            (d, dd, s, sd, n))
HPS_COUNTED(cudaMemcpyToSymbol, kBlockingCopy,
            (const void* y, const void* s, size_t n, size_t o, cudaMemcpyKind k), (y, s, n, o, k))
HPS_COUNTED(cudaMemcpyToSymbol_ptds, kBlockingCopy,
            (const void* y, const void* s, size_t n, size_t o, cudaMemcpyKind k), (y, s, n, o, k))
HPS_COUNTED(cudaMemcpyFromSymbol, kBlockingCopy,
            (void* d, const void* y, size_t n, size_t o, cudaMemcpyKind k), (d, y, n, o, k))
HPS_COUNTED(cudaMemcpyFromSymbol_ptds, kBlockingCopy,
            (void* d, const void* y, size_t n, size_t o, cudaMemcpyKind k), (d, y, n, o, k))
HPS_COUNTED(cudaMemset, kBlockingMemset, (void* p, int v, size_t n), (p, v, n))
HPS_COUNTED(cudaMemset_ptds, kBlockingMemset, (void* p, int v, size_t n), (p, v, n))
HPS_COUNTED(cudaMemset2D, kBlockingMemset, (void* p, size_t pitch, int v, size_t w, size_t h),
            (p, pitch, v, w, h))
HPS_COUNTED(cudaMemset2D_ptds, kBlockingMemset, (void* p, size_t pitch, int v, size_t w, size_t h),
            (p, pitch, v, w, h))
HPS_COUNTED(cudaMemset3D, kBlockingMemset, (cudaPitchedPtr p, int v, cudaExtent e), (p, v, e))
HPS_COUNTED(cudaMemset3D_ptds, kBlockingMemset, (cudaPitchedPtr p, int v, cudaExtent e), (p, v, e))
HPS_COUNTED(cudaFree, kFree, (void* p), (p))
HPS_COUNTED(cudaFreeHost, kFree, (void* p), (p))

// Asynchronous copies count only when pageable host memory makes them block.
#define HPS_COUNTED_ASYNC(name)                                                            \
  extern "C" cudaError_t __real_##name(void* d, const void* s, size_t n, cudaMemcpyKind k, \
                                       cudaStream_t stream);                               \
  extern "C" cudaError_t __wrap_##name(void* d, const void* s, size_t n, cudaMemcpyKind k, \
                                       cudaStream_t stream) {                              \
    if (n > 0 && stages_through_host(d, s, k)) {                                           \
      hps::testing_util::record(CudaSyncKind::kPageableCopy, __builtin_return_address(0)); \
    }                                                                                      \
    return __real_##name(d, s, n, k, stream);                                              \
  }
HPS_COUNTED_ASYNC(cudaMemcpyAsync)
HPS_COUNTED_ASYNC(cudaMemcpyAsync_ptsz)

// Every wrapped function (the list CMakeLists.txt's --wrap options must match).
// clang-format off
#define HPS_WRAPPED(X) \
  X(cudaStreamSynchronize) \
  X(cudaStreamSynchronize_ptsz) \
  X(cudaEventSynchronize) \
  X(cudaDeviceSynchronize) \
  X(cudaMemcpy) \
  X(cudaMemcpy_ptds) \
  X(cudaMemcpy2D) \
  X(cudaMemcpy2D_ptds) \
  X(cudaMemcpy3D) \
  X(cudaMemcpy3D_ptds) \
  X(cudaMemcpyPeer) \
  X(cudaMemcpyToSymbol) \
  X(cudaMemcpyToSymbol_ptds) \
  X(cudaMemcpyFromSymbol) \
  X(cudaMemcpyFromSymbol_ptds) \
  X(cudaMemset) \
  X(cudaMemset_ptds) \
  X(cudaMemset2D) \
  X(cudaMemset2D_ptds) \
  X(cudaMemset3D) \
  X(cudaMemset3D_ptds) \
  X(cudaFree) \
  X(cudaFreeHost) \
  X(cudaMemcpyAsync) \
  X(cudaMemcpyAsync_ptsz)
// clang-format on
#define HPS_PAIR(name) \
  {reinterpret_cast<const void*>(&name), reinterpret_cast<const void*>(&__wrap_##name)},

namespace hps::testing_util {

bool cuda_sync_interposer_active() {
  // Under --wrap=X a reference to X from this object resolves to __wrap_X: the addresses
  // agree exactly when the binary was linked with every option.
  const void* pairs[][2] = {HPS_WRAPPED(HPS_PAIR)};
  for (const auto& pair : pairs) {
    if (pair[0] != pair[1]) return false;
  }
  return true;
}

}  // namespace hps::testing_util

#else  // no CUDA in this build: nothing to wrap

namespace hps::testing_util {
bool cuda_sync_interposer_active() { return false; }
}  // namespace hps::testing_util

#endif
