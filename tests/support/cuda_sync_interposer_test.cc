// The host-sync interposer itself: linked the way a test links it, every wrapped runtime
// function resolves to its counting wrapper, and calls count per kind, per thread and per
// process. HostCounting/* runs everywhere (label cpp: without a device the runtime's calls
// fail fast, and they are counted all the same); Device/* drives hpshard's own CUDA code on
// a GPU (label gpu; Skipped without one) and sees its synchronising calls, and none from
// the kernel table.
#include "tests/support/cuda_sync_interposer.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "core/common/config.h"
#include "core/device/buffer.h"
#include "core/device/stream.h"
#include "core/kernels/kernel_table.h"

#if HPS_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace hps {
namespace {

using testing_util::cuda_sync_counts;
using testing_util::cuda_sync_counts_thread;
using testing_util::cuda_sync_interposer_active;
using testing_util::cuda_sync_reset;
using testing_util::CudaSyncKind;

#if !HPS_HAVE_CUDA

TEST(HostCounting, InactiveWithoutCuda) {
  EXPECT_FALSE(cuda_sync_interposer_active());
  EXPECT_EQ(cuda_sync_counts().total(), 0u);
}

#else

TEST(HostCounting, EveryWrappedFunctionResolvesToItsWrapper) {
  EXPECT_TRUE(cuda_sync_interposer_active())
      << "this binary was not linked with hps_cuda_sync_interposer's --wrap options";
}

TEST(HostCounting, CountsEachKindOnTheCallingThreadAndInTheProcess) {
  cuda_sync_reset();
  int a = 1, b = 2;
  // Harmless arguments: on a GPU these succeed at once; without one they fail at once.
  (void)cudaStreamSynchronize(nullptr);
  (void)cudaDeviceSynchronize();
  (void)cudaMemcpy(&a, &b, 0, cudaMemcpyHostToHost);
  (void)cudaMemset(nullptr, 0, 0);
  (void)cudaFree(nullptr);
  (void)cudaGetLastError();
  const auto mine = cuda_sync_counts_thread();
  EXPECT_EQ(mine.of(CudaSyncKind::kStreamSynchronize), 1u);
  EXPECT_EQ(mine.of(CudaSyncKind::kDeviceSynchronize), 1u);
  EXPECT_EQ(mine.of(CudaSyncKind::kBlockingCopy), 1u);
  EXPECT_EQ(mine.of(CudaSyncKind::kBlockingMemset), 1u);
  EXPECT_EQ(mine.of(CudaSyncKind::kFree), 1u);
  EXPECT_EQ(mine.total(), 5u) << mine.describe();

  // Another thread's calls count for the process, not for this thread.
  std::thread other([] {
    (void)cudaStreamSynchronize(nullptr);
    (void)cudaStreamSynchronize(nullptr);
  });
  other.join();
  EXPECT_EQ(cuda_sync_counts_thread().of(CudaSyncKind::kStreamSynchronize), 1u);
  EXPECT_EQ(cuda_sync_counts().of(CudaSyncKind::kStreamSynchronize), 3u);
  EXPECT_EQ(cuda_sync_counts().total(), 7u);
  EXPECT_NE(cuda_sync_counts().describe().find("stream_synchronize=3"), std::string::npos);

  cuda_sync_reset();
  EXPECT_EQ(cuda_sync_counts().total(), 0u);
  EXPECT_EQ(cuda_sync_counts_thread().total(), 0u);
}

class Device : public testing::Test {
 protected:
  void SetUp() override {
    if (device_count(DeviceType::kCuda) == 0) {
      GTEST_SKIP() << "no usable CUDA device (no driver or GPU on this machine)";
    }
    ASSERT_TRUE(cuda_sync_interposer_active());
  }
};

TEST_F(Device, SeesHpshardsOwnSynchronisingCallsAndNoneFromTheKernels) {
  const auto gpu = hps::Device::cuda(0);
  auto stream = std::move(create_stream(gpu)).value();
  const Kernels& kernels = *kernels_for(DeviceType::kCuda).value();
  auto data = std::move(DeviceBuffer::allocate(gpu, (1 << 20) * sizeof(float))).value();
  auto partial = std::move(DeviceBuffer::allocate(gpu, sizeof(double))).value();
  ASSERT_TRUE(stream->synchronize().ok());

  cuda_sync_reset();
  // Kernels, stream-ordered memset and scratch memory: nothing blocks the host.
  ASSERT_TRUE(stream->memset_async(partial.data().get(), 0, sizeof(double)).ok());
  ASSERT_TRUE(kernels.fill(*stream, DType::kFloat32, data.data(), 1 << 20, 0.5).ok());
  ASSERT_TRUE(kernels
                  .sum_of_squares(*stream, DType::kFloat32, data.data<const void>(), 1 << 20,
                                  partial.data<double>())
                  .ok());
  EXPECT_EQ(cuda_sync_counts().total(), 0u) << cuda_sync_counts().describe();

  // copy_to_host: a device-to-host copy into pageable memory and an event wait.
  double norm = 0;
  ASSERT_TRUE(copy_to_host(*stream, &norm, partial.data().get(), sizeof norm).ok());
  EXPECT_EQ(norm, 0.25 * (1 << 20));
  auto counts = cuda_sync_counts();
  EXPECT_EQ(counts.of(CudaSyncKind::kPageableCopy), 1u) << counts.describe();
  EXPECT_EQ(counts.of(CudaSyncKind::kEventSynchronize), 1u) << counts.describe();

  ASSERT_TRUE(stream->synchronize().ok());
  data.reset();  // cudaFree
  counts = cuda_sync_counts();
  EXPECT_EQ(counts.of(CudaSyncKind::kStreamSynchronize), 1u) << counts.describe();
  EXPECT_EQ(counts.of(CudaSyncKind::kFree), 1u) << counts.describe();
}

#endif  // HPS_HAVE_CUDA

}  // namespace
}  // namespace hps
