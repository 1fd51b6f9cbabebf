// The gradient buckets' bookkeeping: reductions start in one order on every rank (the
// bucket of the latest-registered parameter first) whatever order the gradients check in,
// a bucket complete before its turn is held, and the micro-batch ends only when every
// trainable bucket's reduction started.
#include "core/sharding/grad_buckets.h"

#include <gtest/gtest.h>

#include <vector>

namespace hps {
namespace {

// Unit 0: "a" (fp32) and "b" (bf16), two buckets; unit 1: "c" and "d" (fp32, 256 bytes
// each, a bucket each under a 256-byte cap) and a frozen "e".
LayoutPlan two_units() {
  LayoutPlan plan;
  ParamSpec a{"a", {8}};
  ParamSpec b{"b", {8}, DType::kBFloat16};
  ParamSpec c{"c", {64}};
  c.unit = 1;
  ParamSpec d{"d", {64}};
  d.unit = 1;
  ParamSpec e{"e", {8}};
  e.unit = 1;
  e.trainable = false;
  for (const ParamSpec& p : {a, b, c, d, e}) EXPECT_TRUE(plan.add(p).ok());
  EXPECT_TRUE(plan.seal(2, 256, 256).ok());
  return plan;
}

size_t bucket(const LayoutPlan& plan, size_t param) { return plan.placement(param).buffer; }

// Checks in `params` in that order; returns the buckets whose reductions started, in the
// order they started.
std::vector<size_t> check_in(const LayoutPlan& plan, GradBuckets& buckets,
                             const std::vector<size_t>& params) {
  std::vector<size_t> started;
  for (size_t p : params) {
    auto complete = buckets.check_in(plan, p);
    EXPECT_TRUE(complete.ok()) << complete.status().to_string();
    EXPECT_TRUE(*complete) << "every bucket here holds one trainable parameter";
    EXPECT_TRUE(buckets.checked_in(bucket(plan, p)));
    while (buckets.next_ready()) {
      started.push_back(buckets.next());
      buckets.started();
    }
  }
  return started;
}

TEST(GradBuckets, ReductionsStartInOneOrderWhateverTheCheckInOrder) {
  const LayoutPlan plan = two_units();
  ASSERT_EQ(plan.buffers().size(), 5u);
  const std::vector<size_t> expected = {bucket(plan, 3), bucket(plan, 2), bucket(plan, 1),
                                        bucket(plan, 0)};
  const std::vector<std::vector<size_t>> orders = {
      {3, 2, 1, 0}, {0, 1, 2, 3}, {2, 3, 0, 1}, {1, 3, 0, 2}};
  for (const auto& order : orders) {
    GradBuckets buckets;
    buckets.init(plan, 2);
    for (int32_t micro = 0; micro < 2; ++micro) {
      EXPECT_EQ(buckets.first_micro_batch(), micro == 0);
      EXPECT_EQ(buckets.last_micro_batch(), micro == 1);
      EXPECT_EQ(check_in(plan, buckets, order), expected) << "order starting " << order[0];
      for (size_t p = 0; p < 4; ++p) EXPECT_FALSE(buckets.checked_in(bucket(plan, p)));
    }
    EXPECT_TRUE(buckets.check_step_due().ok());
    buckets.stepped();
    EXPECT_TRUE(buckets.between_steps());
  }
}

TEST(GradBuckets, ABucketHeldForItsTurnIsNotDueAndRefusesASecondCheckIn) {
  const LayoutPlan plan = two_units();
  GradBuckets buckets;
  buckets.init(plan, 1);
  // Forward order: "a" completes first, and waits for the three buckets ahead of it.
  EXPECT_TRUE(check_in(plan, buckets, {0}).empty());
  EXPECT_TRUE(buckets.checked_in(bucket(plan, 0)));
  EXPECT_FALSE(buckets.complete(bucket(plan, 0))) << "held: its reduction has not started";
  EXPECT_FALSE(buckets.between_steps());
  EXPECT_EQ(buckets.check_step_due().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(buckets.check_in(plan, 0).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(check_in(plan, buckets, {3}), std::vector<size_t>{bucket(plan, 3)});
  EXPECT_TRUE(buckets.complete(bucket(plan, 3)));
  EXPECT_EQ(buckets.check_in(plan, 3).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(check_in(plan, buckets, {1, 2}),
            (std::vector<size_t>{bucket(plan, 2), bucket(plan, 1), bucket(plan, 0)}));
  EXPECT_TRUE(buckets.check_step_due().ok());
}

}  // namespace
}  // namespace hps
