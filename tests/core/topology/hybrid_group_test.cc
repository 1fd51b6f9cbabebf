// Hybrid groups with 8 thread-ranks: each group's communicator reduces over exactly the
// ranks the topology formula names.
#include "core/topology/hybrid_group.h"

#include <gtest/gtest.h>

#include "core/common/config.h"
#include "tests/core/comm/comm_test_util.h"

namespace hps {
namespace {

void check_layout(const AxisArray& degrees) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  const int32_t world = degrees[0] * degrees[1] * degrees[2] * degrees[3] * degrees[4];
  auto topology = Topology::create(degrees, world);
  ASSERT_TRUE(topology.ok());
  testing_util::run_ranks(world, [&](int32_t rank, Communicator& comm) {
    // The helper owns `comm`; share it without taking ownership.
    std::shared_ptr<Communicator> world_comm(&comm, [](Communicator*) {});
    auto hg = HybridGroup::create(world_comm, *topology);
    ASSERT_TRUE(hg.ok()) << hg.status().to_string();
    for (int32_t k = 0; k < kGroupKindCount; ++k) {
      const auto kind = static_cast<GroupKind>(k);
      auto group = (*hg)->group(kind);
      auto expected = (*hg)->ranks(kind);
      ASSERT_TRUE(expected.ok());
      ASSERT_EQ(group->size(), static_cast<int32_t>(expected->size())) << group_kind_name(kind);
      EXPECT_EQ(group->name(), group_kind_name(kind));
      // Sum of 2^rank over the group identifies its members exactly.
      int64_t mine = int64_t{1} << rank, sum = 0, want = 0;
      for (int32_t m : *expected) want += int64_t{1} << m;
      ASSERT_TRUE((*group->all_reduce(&mine, &sum, 1, DType::kInt64, ReduceOp::kSum))->wait().ok());
      EXPECT_EQ(sum, want) << group_kind_name(kind) << " of rank " << rank;
      // This rank's position in the group and the group's source rank.
      EXPECT_EQ((*expected)[static_cast<size_t>(group->rank())], rank);
      int64_t source = rank;
      ASSERT_TRUE((*group->broadcast(&source, 1, DType::kInt64, 0))->wait().ok());
      EXPECT_EQ(source, expected->front());
    }
  });
}

TEST(HybridGroup, Dp2Pp2Sharding2) { check_layout({2, 2, 2, 1, 1}); }
TEST(HybridGroup, Sharding2Mp2Sep2) { check_layout({1, 1, 2, 2, 2}); }
TEST(HybridGroup, Dp2Sharding2Mp2) { check_layout({2, 1, 2, 1, 2}); }

TEST(HybridGroup, WorldMustMatchTheTopology) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  auto topology = Topology::create({2, 1, 1, 1, 1}, 2);
  testing_util::run_ranks(1, [&](int32_t, Communicator& comm) {
    std::shared_ptr<Communicator> w(&comm, [](Communicator*) {});
    EXPECT_EQ(HybridGroup::create(w, *topology).status().code(), StatusCode::kInvalidArgument);
  });
  EXPECT_EQ(group_kind_from_int(7).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hps
