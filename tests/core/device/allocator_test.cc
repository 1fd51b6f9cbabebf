#include "core/device/allocator.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "core/device/cpu/allocator.h"
#include "core/device/cpu/stream.h"

namespace hps {
namespace {

TEST(CpuAllocator, AlignedAndUsable) {
  auto allocator = allocator_for(Device::cpu());
  ASSERT_TRUE(allocator.ok());
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{255}, size_t{256}, size_t{1} << 20}) {
    auto p = (*allocator)->allocate(bytes);
    ASSERT_TRUE(p.ok());
    EXPECT_NE(*p, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(*p) % kAllocationAlignment, 0u);
    std::memset(*p, 0xab, bytes);
    (*allocator)->deallocate(*p);
  }
  (*allocator)->deallocate(nullptr);
}

TEST(CpuAllocator, ImpossibleSizeIsOutOfMemory) {
  auto allocator = allocator_for(Device::cpu());
  ASSERT_TRUE(allocator.ok());
  EXPECT_EQ((*allocator)->allocate(std::numeric_limits<size_t>::max()).status().code(),
            StatusCode::kOutOfMemory);
  EXPECT_EQ((*allocator)->allocate(size_t{1} << 62).status().code(), StatusCode::kOutOfMemory);
}

// A stream-ordered free runs after the work queued before it: until then the block is
// neither cached nor handed out again, and afterwards the next allocate_async of its
// rounded size takes it from the cache.
TEST(CpuAllocator, AStreamOrderedFreeWaitsForTheWorkQueuedBeforeIt) {
  cpu::CpuAllocator allocator;
  cpu::CpuStream stream;
  auto block = allocator.allocate_async(1000, stream);
  ASSERT_TRUE(block.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(*block) % kAllocationAlignment, 0u);
  std::atomic<bool> release{false};
  std::atomic<bool> wrote{false};
  stream.enqueue([&, p = *block] {
    while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::memset(p, 0x5a, 1000);  // the last use, after the free was queued
    wrote = true;
  });
  allocator.deallocate_async(*block, stream);
  EXPECT_EQ(allocator.cached_bytes(), 0u) << "cached before the work queued before the free";
  auto other = allocator.allocate_async(1000, stream);
  ASSERT_TRUE(other.ok());
  EXPECT_NE(*other, *block) << "handed out again while its last user is queued";
  release = true;
  ASSERT_TRUE(stream.synchronize().ok());
  EXPECT_TRUE(wrote);
  EXPECT_EQ(allocator.cached_bytes(), 1024u);           // 1000 rounded to kAllocationAlignment
  auto again = allocator.allocate_async(1024, stream);  // the same rounded size
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *block) << "the cached block comes back";
  EXPECT_EQ(allocator.cached_bytes(), 0u);
  auto larger = allocator.allocate_async(2048, stream);
  ASSERT_TRUE(larger.ok());
  for (void* p : {*other, *again, *larger}) allocator.deallocate_async(p, stream);
  ASSERT_TRUE(stream.synchronize().ok());
  EXPECT_EQ(allocator.cached_bytes(), 1024u + 1024u + 2048u);
  allocator.deallocate_async(nullptr, stream);  // nothing
}

// The cache keeps at most kCachedBytesLimit; blocks beyond it go back to the system.
TEST(CpuAllocator, TheCacheIsBounded) {
  cpu::CpuAllocator allocator;
  cpu::CpuStream stream;
  constexpr size_t kBlock = size_t{48} << 20;
  const size_t blocks = cpu::CpuAllocator::kCachedBytesLimit / kBlock + 2;
  std::vector<void*> held;
  for (size_t i = 0; i < blocks; ++i) {
    auto p = allocator.allocate_async(kBlock, stream);
    ASSERT_TRUE(p.ok());
    held.push_back(*p);
  }
  for (void* p : held) allocator.deallocate_async(p, stream);
  ASSERT_TRUE(stream.synchronize().ok());
  EXPECT_EQ(allocator.cached_bytes(), cpu::CpuAllocator::kCachedBytesLimit / kBlock * kBlock);
}

// A block from allocate() freed in stream order, or a stream-ordered block freed at once,
// goes back to the system, never into the cache.
TEST(CpuAllocator, OnlyStreamOrderedBlocksAreCached) {
  cpu::CpuAllocator allocator;
  cpu::CpuStream stream;
  auto plain = allocator.allocate(4096);
  ASSERT_TRUE(plain.ok());
  allocator.deallocate_async(*plain, stream);
  auto ordered = allocator.allocate_async(4096, stream);
  ASSERT_TRUE(ordered.ok());
  allocator.deallocate(*ordered);
  ASSERT_TRUE(stream.synchronize().ok());
  EXPECT_EQ(allocator.cached_bytes(), 0u);
}

TEST(Allocator, UnknownDeviceIsRefused) {
  EXPECT_EQ(allocator_for({DeviceType::kCpu, 3}).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(allocator_for(Device::cuda(device_count(DeviceType::kCuda))).status().code(),
            StatusCode::kOutOfRange);
}

}  // namespace
}  // namespace hps
