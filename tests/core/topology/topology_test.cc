// Topology arithmetic against the rank formula of DESIGN.md, computed here directly.
#include "core/topology/topology.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <set>
#include <vector>

namespace hps {
namespace {

AxisArray degrees(int32_t dp, int32_t pp, int32_t sharding, int32_t sep, int32_t mp) {
  return {dp, pp, sharding, sep, mp};
}

// rank = ((((d·P + p)·S + s)·E + e)·M + m)
int32_t formula_rank(const AxisArray& deg, const AxisArray& c) {
  return (((c[0] * deg[1] + c[1]) * deg[2] + c[2]) * deg[3] + c[3]) * deg[4] + c[4];
}

void check_against_formula(const AxisArray& deg) {
  const int32_t world = deg[0] * deg[1] * deg[2] * deg[3] * deg[4];
  auto topo = Topology::create(deg, world);
  ASSERT_TRUE(topo.ok()) << topo.status().to_string();
  std::set<int32_t> seen;
  AxisArray c{};
  for (c[0] = 0; c[0] < deg[0]; ++c[0])
    for (c[1] = 0; c[1] < deg[1]; ++c[1])
      for (c[2] = 0; c[2] < deg[2]; ++c[2])
        for (c[3] = 0; c[3] < deg[3]; ++c[3])
          for (c[4] = 0; c[4] < deg[4]; ++c[4]) {
            const int32_t r = formula_rank(deg, c);
            ASSERT_EQ(*topo->rank_of(c), r);
            ASSERT_EQ(*topo->coordinates(r), c);
            seen.insert(r);
            for (Axis a : kDefaultAxisOrder) {
              // The group along `a`: vary coordinate a, keep the others.
              std::vector<int32_t> expected;
              AxisArray v = c;
              for (int32_t k = 0; k < deg[static_cast<size_t>(a)]; ++k) {
                v[static_cast<size_t>(a)] = k;
                expected.push_back(formula_rank(deg, v));
              }
              ASSERT_EQ(*topo->axis_group(a, r), expected) << axis_name(a) << " rank " << r;
            }
            // check group: same dp coordinate; sharding check group: same sharding coordinate.
            std::vector<int32_t> same_dp, same_sharding;
            for (int32_t q = 0; q < world; ++q) {
              const AxisArray qc = *topo->coordinates(q);
              if (qc[0] == c[0]) same_dp.push_back(q);
              if (qc[2] == c[2]) same_sharding.push_back(q);
            }
            ASSERT_EQ(*topo->check_group(r), same_dp);
            ASSERT_EQ(*topo->sharding_check_group(r), same_sharding);
            AxisArray prev = c, next = c;
            prev[1] = (c[1] + deg[1] - 1) % deg[1];
            next[1] = (c[1] + 1) % deg[1];
            ASSERT_EQ(*topo->pipeline_prev(r), formula_rank(deg, prev));
            ASSERT_EQ(*topo->pipeline_next(r), formula_rank(deg, next));
          }
  EXPECT_EQ(static_cast<int32_t>(seen.size()), world);
  for (Axis a : kDefaultAxisOrder) {
    auto groups = topo->all_axis_groups(a);
    const int32_t d = topo->degree(a);
    ASSERT_EQ(static_cast<int32_t>(groups.size()), world / d);
    std::set<int32_t> covered;
    int32_t last_source = -1;
    for (const auto& g : groups) {
      ASSERT_EQ(static_cast<int32_t>(g.size()), d);
      ASSERT_GT(g.front(), last_source) << "groups are ordered by their source rank";
      last_source = g.front();
      covered.insert(g.begin(), g.end());
    }
    EXPECT_EQ(static_cast<int32_t>(covered.size()), world) << "every rank in one group";
  }
}

TEST(Topology, Dp2Pp2) { check_against_formula(degrees(2, 2, 1, 1, 1)); }
TEST(Topology, Sharding2Mp2) { check_against_formula(degrees(1, 1, 2, 1, 2)); }
TEST(Topology, Dp2Sharding2Mp2) { check_against_formula(degrees(2, 1, 2, 1, 2)); }
TEST(Topology, EveryAxisAtOnce) { check_against_formula(degrees(2, 3, 2, 1, 2)); }
TEST(Topology, OddDegrees) { check_against_formula(degrees(3, 1, 1, 5, 1)); }

// Every axis order: the groups (listed from their members, not by a walk of the world) equal
// the ranks found by comparing every rank's coordinates, in ascending order.
TEST(Topology, GroupsInEveryAxisOrderEqualACoordinateScan) {
  std::array<Axis, kAxisCount> order = kDefaultAxisOrder;
  std::sort(order.begin(), order.end());
  const AxisArray deg = degrees(2, 3, 2, 1, 2);
  const int32_t world = 24;
  int orders = 0;
  do {
    auto topo = Topology::create(deg, world, order);
    ASSERT_TRUE(topo.ok()) << topo.status().to_string();
    for (int32_t r = 0; r < world; ++r) {
      const AxisArray c = *topo->coordinates(r);
      auto scan = [&](auto keeps) {
        std::vector<int32_t> out;
        for (int32_t q = 0; q < world; ++q) {
          if (keeps(*topo->coordinates(q))) out.push_back(q);
        }
        return out;
      };
      for (Axis a : kDefaultAxisOrder) {
        const size_t i = static_cast<size_t>(a);
        ASSERT_EQ(*topo->axis_group(a, r), scan([&](const AxisArray& q) {
          for (size_t k = 0; k < kAxisCount; ++k)
            if (k != i && q[k] != c[k]) return false;
          return true;
        }));
      }
      ASSERT_EQ(*topo->check_group(r), scan([&](const AxisArray& q) { return q[0] == c[0]; }));
      ASSERT_EQ(*topo->sharding_check_group(r),
                scan([&](const AxisArray& q) { return q[2] == c[2]; }));
    }
    ++orders;
  } while (std::next_permutation(order.begin(), order.end()));
  EXPECT_EQ(orders, 120);
}

// A group of a few ranks in a world of 2^30 is listed at once (it walked every rank: minutes
// under AddressSanitizer, for a query the C API answers on any input).
TEST(Topology, ASmallGroupOfAHugeWorldIsListedWithoutWalkingTheWorld) {
  auto topo = Topology::create(degrees(1 << 27, 1, 2, 1, 4), 1 << 30);
  ASSERT_TRUE(topo.ok()) << topo.status().to_string();
  const auto start = std::chrono::steady_clock::now();
  const int32_t last = (1 << 30) - 1;
  EXPECT_EQ(*topo->axis_group(Axis::kMp, last),
            (std::vector<int32_t>{last - 3, last - 2, last - 1, last}));
  EXPECT_EQ(*topo->axis_group(Axis::kSharding, 0), (std::vector<int32_t>{0, 4}));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1));
}

TEST(Topology, CustomOrderPutsItsLastAxisFastest) {
  const std::array<Axis, kAxisCount> order = {Axis::kPp, Axis::kMp, Axis::kDp, Axis::kSep,
                                              Axis::kSharding};
  auto topo = Topology::create(degrees(2, 2, 2, 1, 1), 8, order);
  ASSERT_TRUE(topo.ok());
  EXPECT_EQ(*topo->axis_group(Axis::kSharding, 0), (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(*topo->axis_group(Axis::kDp, 0), (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(*topo->axis_group(Axis::kPp, 0), (std::vector<int32_t>{0, 4}));
  EXPECT_EQ(topo->to_string(), "pp2 x mp1 x dp2 x sep1 x sharding2 (world 8)");
}

TEST(Topology, BadInputIsRefused) {
  EXPECT_EQ(Topology::create(degrees(2, 2, 1, 1, 1), 8).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(Topology::create(degrees(0, 2, 1, 1, 1), 0).status().code(),
            StatusCode::kInvalidArgument);
  const std::array<Axis, kAxisCount> twice = {Axis::kDp, Axis::kDp, Axis::kSharding, Axis::kSep,
                                              Axis::kMp};
  auto dup = Topology::create(degrees(1, 1, 1, 1, 1), 1, twice);
  EXPECT_EQ(dup.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(dup.status().message().find("'dp' twice"), std::string::npos);
  auto topo = Topology::create(degrees(2, 1, 2, 1, 1), 4);
  ASSERT_TRUE(topo.ok());
  EXPECT_EQ(topo->coordinates(4).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(topo->axis_group(Axis::kDp, -1).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(topo->rank_of({0, 0, 2, 0, 0}).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(axis_from_name("tp").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(*axis_from_name("sharding"), Axis::kSharding);
}

}  // namespace
}  // namespace hps
