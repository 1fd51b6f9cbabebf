// CUDA streams, events and allocator. Label gpu: skipped with a reason where no CUDA
// device is usable; run on every machine that has one.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <numeric>
#include <thread>
#include <vector>

#include "core/common/config.h"
#include "core/device/allocator.h"
#include "core/device/host_sync.h"
#include "core/device/stream.h"
#if HPS_HAVE_CUDA
#include "core/device/cuda/stream.h"
#endif

namespace hps {
namespace {

class CudaStreamTest : public testing::Test {
 protected:
  void SetUp() override {
    if (device_count(DeviceType::kCuda) == 0) {
      GTEST_SKIP() << "no usable CUDA device (or hpshard built without CUDA)";
    }
  }
};

TEST_F(CudaStreamTest, RoundTripThroughDeviceMemoryWithoutHostSyncsUntilAsked) {
  const Device gpu = Device::cuda(0);
  auto stream = std::move(create_stream(gpu)).value();
  auto other = std::move(create_stream(gpu)).value();
  auto event = std::move(create_event(gpu)).value();
  auto allocator = std::move(allocator_for(gpu)).value();
  const size_t n = 1 << 20;
  std::vector<float> host(n), back(n, 0.0f);
  std::iota(host.begin(), host.end(), 0.0f);
  void* device_buffer = std::move(allocator->allocate(n * sizeof(float))).value();
  host_sync_reset();
  ASSERT_TRUE(stream->memcpy_async(device_buffer, host.data(), n * sizeof(float)).ok());
  ASSERT_TRUE(event->record(*stream).ok());
  ASSERT_TRUE(other->wait(*event).ok());
  ASSERT_TRUE(other->memcpy_async(back.data(), device_buffer, n * sizeof(float)).ok());
  EXPECT_EQ(host_sync_count_thread(), 0u);
  ASSERT_TRUE(other->synchronize().ok());
  EXPECT_EQ(host_sync_count_thread(), 1u);
  EXPECT_TRUE(*event->query());
  EXPECT_EQ(back, host);
  allocator->deallocate(device_buffer);
}

TEST_F(CudaStreamTest, NeverRecordedAndDeviceMismatchAreRefused) {
  auto stream = std::move(create_stream(Device::cuda(0))).value();
  auto event = std::move(create_event(Device::cuda(0))).value();
  auto cpu_event = std::move(create_event(Device::cpu())).value();
  EXPECT_EQ(stream->wait(*event).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(event->synchronize().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(cpu_event->record(*stream).code(), StatusCode::kInvalidArgument);
}

#if HPS_HAVE_CUDA
// A timed wait on a CUDA event (the polling Event::wait_for) says false while a host function
// holds the stream, then true once it lets go; no host sync counted.
TEST_F(CudaStreamTest, WaitForEndsAtItsTimeoutOrWhenTheEventCompletes) {
  using namespace std::chrono_literals;
  const Device gpu = Device::cuda(0);
  auto stream = std::move(create_stream(gpu)).value();
  auto event = std::move(create_event(gpu)).value();
  std::atomic<bool> release{false};
  auto hold = [](void* flag) {
    while (!static_cast<std::atomic<bool>*>(flag)->load()) std::this_thread::sleep_for(1ms);
  };
  ASSERT_EQ(cudaLaunchHostFunc(static_cast<cuda::CudaStream&>(*stream).native(), hold, &release),
            cudaSuccess);
  ASSERT_TRUE(event->record(*stream).ok());
  host_sync_reset();
  const auto start = std::chrono::steady_clock::now();
  auto pending = event->wait_for(30ms);
  ASSERT_TRUE(pending.ok()) << pending.status().to_string();
  EXPECT_FALSE(*pending);
  EXPECT_GE(std::chrono::steady_clock::now() - start, 30ms);
  release = true;
  auto done = event->wait_for(60s);
  ASSERT_TRUE(done.ok()) << done.status().to_string();
  EXPECT_TRUE(*done);
  EXPECT_EQ(host_sync_count_thread(), 0u);
  ASSERT_TRUE(stream->synchronize().ok());
}
#endif

TEST_F(CudaStreamTest, Properties) {
  auto p = device_properties(Device::cuda(0));
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_GT(p->total_memory_bytes, 0u);
  EXPECT_GT(p->compute_capability_major, 0);
  EXPECT_GT(p->multiprocessor_count, 0);
}

}  // namespace
}  // namespace hps
