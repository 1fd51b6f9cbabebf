#include "core/device/allocator.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>

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

TEST(Allocator, UnknownDeviceIsRefused) {
  EXPECT_EQ(allocator_for({DeviceType::kCpu, 3}).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(allocator_for(Device::cuda(device_count(DeviceType::kCuda))).status().code(),
            StatusCode::kOutOfRange);
}

}  // namespace
}  // namespace hps
