// An independent count of the CUDA runtime calls that can block the host, for tests that
// hold hpshard to zero host syncs per steady step without trusting hpshard's own counter
// (core/device/host_sync.h).
//
// How: hpshard links the CUDA runtime statically (cudart_static), so a call never crosses a
// shared-library boundary that LD_PRELOAD could interpose; and cudart reaches the driver
// through function pointers it looks up itself, so the driver cannot be interposed either.
// Instead the CMake target hps_cuda_sync_interposer carries the linker's --wrap options:
// in a binary linked with it, every reference to a wrapped function from any object linked
// into it — hpshard_core's objects, the test's own — resolves to a counting wrapper here,
// which then calls the real function. Objects inside a shared library (libhpshard.so) were
// resolved when that library was linked: link the test against hpshard_core, not the .so.
//
// Counted (each call, whatever it returns):
//   stream_synchronize  cudaStreamSynchronize(_ptsz)
//   event_synchronize   cudaEventSynchronize
//   device_synchronize  cudaDeviceSynchronize
//   blocking_copy       cudaMemcpy, cudaMemcpy2D/3D, cudaMemcpyPeer, cudaMemcpyTo/FromSymbol (and
//                       their _ptds forms)
//   blocking_memset     cudaMemset, cudaMemset2D/3D (and _ptds)
//   pageable_copy       cudaMemcpyAsync(_ptsz) with pageable (unregistered) host memory on
//                       either side: the runtime stages it through the host, or returns only
//                       when a copy into pageable memory has landed
//   free                cudaFree, cudaFreeHost (both wait for the device)
// Not counted: queries (cudaStreamQuery, cudaEventQuery), stream-ordered calls
// (cudaMemcpyAsync between device and pinned memory, cudaMemsetAsync, cudaMallocAsync,
// cudaFreeAsync, cudaStreamWaitEvent, launches).
//
// Use (CMake):  target_link_libraries(my_test PRIVATE hps_cuda_sync_interposer)
//   then in the test:
//     ASSERT_TRUE(hps::testing_util::cuda_sync_interposer_active());
//     hps::testing_util::cuda_sync_reset();
//     ... one steady step ...
//     const auto syncs = hps::testing_util::cuda_sync_counts();
//     EXPECT_EQ(syncs.total(), 0u) << syncs.describe();
// Linked without the --wrap options the binary does not link (the wrappers call __real_X).
// Without CUDA in the build the library still links: active() is false, counts stay 0.
#pragma once

#include <array>
#include <cstdint>
#include <string>

namespace hps::testing_util {

enum class CudaSyncKind : int {
  kStreamSynchronize = 0,
  kEventSynchronize = 1,
  kDeviceSynchronize = 2,
  kBlockingCopy = 3,
  kBlockingMemset = 4,
  kPageableCopy = 5,
  kFree = 6,
};
inline constexpr int kCudaSyncKinds = 7;

struct CudaSyncCounts {
  std::array<uint64_t, kCudaSyncKinds> calls{};
  uint64_t of(CudaSyncKind kind) const { return calls[static_cast<size_t>(kind)]; }
  uint64_t total() const;
  // "stream_synchronize=1 event_synchronize=0 ..." plus the callers of the latest counted
  // calls (return addresses, symbolized where the binary exports them).
  std::string describe() const;
};

// Whether this binary's references to every wrapped function really resolve to the
// wrappers (it was linked with the target's --wrap options). Calls nothing in CUDA.
bool cuda_sync_interposer_active();

// Calls counted in the whole process / on the calling thread since the last reset.
CudaSyncCounts cuda_sync_counts();
CudaSyncCounts cuda_sync_counts_thread();
// Resets the process-wide counts and the calling thread's.
void cuda_sync_reset();

}  // namespace hps::testing_util
