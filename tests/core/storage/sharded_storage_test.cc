// ShardedStorage: each role for the buffers it holds, aligned relative to the device
// address, zero-filled in stream order.
#include "core/storage/sharded_storage.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>

#include "core/device/cpu/stream.h"

namespace hps {
namespace {

TEST(ShardedStorage, RolesHoldTheirBuffersAlignedAndZeroed) {
  LayoutPlan plan;
  ASSERT_TRUE(plan.add({"w", {1000}, DType::kFloat32}).ok());
  ParamSpec frozen{"f", {10}, DType::kBFloat16};
  frozen.trainable = false;
  ASSERT_TRUE(plan.add(frozen).ok());
  ParamSpec half{"h", {77}, DType::kFloat16};
  half.unit = 1;
  ASSERT_TRUE(plan.add(half).ok());
  const uint64_t alignment = 4096;  // above the allocator's own 256
  ASSERT_TRUE(plan.seal(3, alignment).ok());
  cpu::CpuStream stream;
  auto all = [](const FlatBuffer&) { return true; };
  auto trainable = [](const FlatBuffer& b) { return b.trainable; };
  auto storage = ShardedStorage::create(
      plan, Device::cpu(),
      {{StorageRole::kParams, true, true, all}, {StorageRole::kGradShard, false, false, trainable}},
      stream);
  ASSERT_TRUE(storage.ok()) << storage.status().to_string();
  ASSERT_TRUE(stream.synchronize().ok());
  const ShardedStorage& s = **storage;
  uint64_t expected_bytes = 0;
  for (size_t b = 0; b < plan.buffers().size(); ++b) {
    const FlatBuffer& buf = plan.buffers()[b];
    ASSERT_TRUE(s.holds(StorageRole::kParams, b));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(s.get(StorageRole::kParams, b).get()) % alignment, 0u);
    EXPECT_EQ(s.count(StorageRole::kParams, b), buf.numel);
    EXPECT_EQ(s.dtype(StorageRole::kParams, b), buf.dtype);
    const auto* bytes = s.get<const uint8_t>(StorageRole::kParams, b).get();
    for (uint64_t i = 0; i < buf.numel * dtype_size(buf.dtype); ++i) ASSERT_EQ(bytes[i], 0) << i;
    EXPECT_EQ(s.holds(StorageRole::kGradShard, b), buf.trainable);
    if (buf.trainable) {
      EXPECT_EQ(s.count(StorageRole::kGradShard, b), buf.shard_numel);
      EXPECT_EQ(s.dtype(StorageRole::kGradShard, b), DType::kFloat32);
      EXPECT_EQ(reinterpret_cast<uintptr_t>(s.get(StorageRole::kGradShard, b).get()) % alignment,
                0u);
    }
    expected_bytes += buf.numel * dtype_size(buf.dtype);
  }
  EXPECT_GE(s.bytes(), expected_bytes);
  EXPECT_FALSE(s.holds(StorageRole::kExpAvg, 0)) << "a role not asked for is absent";
  EXPECT_FALSE(s.get(StorageRole::kExpAvg, 0));
  (*storage)->release(StorageRole::kParams);
  EXPECT_FALSE((*storage)->holds(StorageRole::kParams, 0));
  EXPECT_LT((*storage)->bytes(), expected_bytes);
}

TEST(ShardedStorage, RefusesAnUnsealedPlan) {
  LayoutPlan plan;
  ASSERT_TRUE(plan.add({"w", {4}, DType::kFloat32}).ok());
  cpu::CpuStream stream;
  EXPECT_EQ(ShardedStorage::create(plan, Device::cpu(), {}, stream).status().code(),
            StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace hps
