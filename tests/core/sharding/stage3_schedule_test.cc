// Stage 3's host-side schedule: the gather order recorded on the first step, prefetch within
// the window as the next step proceeds, the keep-live test of release(), and the next
// step's first units named at step() so their all-gathers start right after their updates.
#include "core/sharding/stage3_schedule.h"

#include <gtest/gtest.h>

#include <set>

namespace hps {
namespace {

// Four units of two buffers each (weight and bias), registered in unit order.
LayoutPlan four_units() {
  LayoutPlan plan;
  for (int32_t u = 0; u < 4; ++u) {
    ParamSpec w{"l" + std::to_string(u) + ".w", {8, 8}};
    w.unit = u;
    EXPECT_TRUE(plan.add(w).ok());
    // A frozen bias: a second flat buffer of the same unit.
    ParamSpec b{"l" + std::to_string(u) + ".b", {8}};
    b.unit = u;
    b.trainable = false;
    EXPECT_TRUE(plan.add(b).ok());
  }
  EXPECT_TRUE(plan.seal(2).ok());
  return plan;
}

std::set<int32_t> units_of(const LayoutPlan& plan, const std::vector<size_t>& buffers) {
  std::set<int32_t> units;
  for (size_t b : buffers) units.insert(plan.buffers()[b].unit);
  return units;
}

// The forward then the backward of the four units, as the engine sees them.
const int32_t kOrder[] = {0, 1, 2, 3, 3, 2, 1, 0};

TEST(Stage3Schedule, PrefetchesAheadInTheRecordedOrderWithinTheWindow) {
  const LayoutPlan plan = four_units();
  Stage3Schedule s;
  s.init(plan, 2);
  ASSERT_EQ(plan.buffers().size(), 8u);
  std::set<size_t> live;
  auto is_live = [&](size_t b) { return live.count(b) > 0; };
  // The first step records: nothing ahead, nothing at step().
  for (int32_t u : kOrder) EXPECT_TRUE(s.on_gather(u, is_live).empty());
  EXPECT_TRUE(s.on_step(is_live).empty());
  s.stepped();
  // step(): the next step's first two units (the window), both buffers of each.
  const auto first = s.on_step(is_live);
  EXPECT_EQ(units_of(plan, first), (std::set<int32_t>{0, 1}));
  EXPECT_EQ(first.size(), 4u);
  for (size_t b : first) live.insert(b);
  // gather(0) finds 0 and 1 live: the window is full, nothing more.
  EXPECT_TRUE(s.on_gather(0, is_live).empty());
  for (size_t b : *s.unit_buffers(0).value()) live.erase(b);  // release(0)
  // gather(1): unit 2 next.
  EXPECT_EQ(units_of(plan, s.on_gather(1, is_live)), (std::set<int32_t>{2}));
}

TEST(Stage3Schedule, StepPrefetchCountsWhatIsLiveAndAWiderWindow) {
  const LayoutPlan plan = four_units();
  Stage3Schedule s;
  s.init(plan, 3);
  std::set<size_t> live;
  auto is_live = [&](size_t b) { return live.count(b) > 0; };
  for (int32_t u : kOrder) s.on_gather(u, is_live);
  s.stepped();
  EXPECT_EQ(units_of(plan, s.on_step(is_live)), (std::set<int32_t>{0, 1, 2}));
  // A unit still live (say the framework kept unit 3) takes a place in the window.
  for (size_t b : *s.unit_buffers(3).value()) live.insert(b);
  EXPECT_EQ(units_of(plan, s.on_step(is_live)), (std::set<int32_t>{0, 1}));
}

TEST(Stage3Schedule, TheLastForwardUnitIsGatheredNextForItsBackward) {
  const LayoutPlan plan = four_units();
  Stage3Schedule s;
  s.init(plan, 2);
  auto none = [](size_t) { return false; };
  for (int32_t u : kOrder) s.on_gather(u, none);
  s.stepped();
  for (int32_t u : {0, 1, 2, 3}) {
    s.on_gather(u, none);
    EXPECT_EQ(s.gathered_next(u), u == 3) << "unit " << u;
  }
}

}  // namespace
}  // namespace hps
