// LayoutPlan: alignment, equal shards, bucket caps, the clip spans of each shard.
#include "core/storage/layout_plan.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/kernels/norm.h"

namespace hps {
namespace {

TEST(LayoutPlan, AlignedShardedAndDeterministic) {
  LayoutPlan plan;
  ASSERT_TRUE(plan.add({"a", {10}, DType::kFloat32}).ok());
  ASSERT_TRUE(plan.add({"b", {70}, DType::kFloat32}).ok());
  ParamSpec c{"c", {5}, DType::kFloat64};
  ASSERT_TRUE(plan.add(c).ok());
  ASSERT_TRUE(plan.seal(3, 256).ok());
  ASSERT_EQ(plan.buffers().size(), 2u);  // fp32 and fp64
  const auto& f32 = plan.buffers()[0];
  EXPECT_EQ(plan.placement(0).offset, 0u);
  EXPECT_EQ(plan.placement(1).offset, 64u) << "each parameter starts on a 256-byte boundary";
  EXPECT_EQ(f32.numel % (64u * 3u), 0u) << "padded to alignment x degree";
  EXPECT_EQ(f32.shard_numel * 3, f32.numel);
  // 64 + 70 elements padded to 192: shards of 64. b = [64, 134) lies in ranks 1 and 2.
  EXPECT_EQ(f32.numel, 192u);
  EXPECT_EQ(plan.local_part(1, 0), (std::pair<uint64_t, uint64_t>{0, 0}));
  EXPECT_EQ(plan.local_part(1, 1), (std::pair<uint64_t, uint64_t>{0, 64}));
  EXPECT_EQ(plan.local_part(1, 2), (std::pair<uint64_t, uint64_t>{64, 70}));
  EXPECT_EQ(plan.local_part(0, 2), (std::pair<uint64_t, uint64_t>{0, 0}));
  LayoutPlan same;
  ASSERT_TRUE(same.add({"a", {10}, DType::kFloat32}).ok());
  ASSERT_TRUE(same.add({"b", {70}, DType::kFloat32}).ok());
  ASSERT_TRUE(same.add(c).ok());
  EXPECT_EQ(same.fingerprint(), plan.fingerprint());
  EXPECT_EQ(plan.add({"late", {1}, DType::kFloat32}).code(), StatusCode::kFailedPrecondition);
  LayoutPlan bad;
  EXPECT_EQ(bad.add({"neg", {-1}, DType::kFloat32}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.add({"huge", {1 << 30, 1 << 30}, DType::kFloat32}).code(),
            StatusCode::kInvalidArgument);
  // Names go into a JSON manifest: UTF-8 only.
  const Status latin1 = bad.add({"caf\xe9", {1}, DType::kFloat32});
  EXPECT_EQ(latin1.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(latin1.message().find("not valid UTF-8"), std::string::npos) << latin1.message();
  EXPECT_TRUE(bad.add({"caf\xc3\xa9", {1}, DType::kFloat32}).ok());
}

// Shapes from outside are checked with checked arithmetic and refused naming the
// parameter; a refused add leaves the plan as it was.
TEST(LayoutPlan, HostileShapesAreRefusedNamingTheParameter) {
  LayoutPlan plan;
  ASSERT_TRUE(plan.add({"ok", {4}, DType::kFloat32}).ok());
  const int64_t big = int64_t{1} << 40;
  const std::vector<std::pair<ParamSpec, std::string>> bad = {
      {{"neg", {3, -1}, DType::kFloat32}, "'neg' has a negative dimension"},
      {{"wraps", {big, big, big}, DType::kFloat32}, "'wraps': its element count overflows"},
      {{"huge", {int64_t{1} << 30, int64_t{1} << 19}, DType::kFloat32}, "'huge' is too large"},
      {{"", {4}, DType::kFloat32}, "parameter name is empty"},
      {{"ok", {4}, DType::kFloat32}, "'ok' is registered twice"},
  };
  for (const auto& [spec, message] : bad) {
    Status s = plan.add(spec);
    EXPECT_NE(s.code(), StatusCode::kOk) << spec.name;
    EXPECT_NE(s.message().find(message), std::string::npos) << s.to_string();
  }
  ParamSpec negative_unit{"u", {4}, DType::kFloat32};
  negative_unit.unit = -1;
  EXPECT_NE(plan.add(negative_unit).message().find("unit must be >= 0"), std::string::npos);
  ASSERT_EQ(plan.params().size(), 1u);
  // The largest parameters allowed, more of them in one unit than one buffer can index.
  LayoutPlan crowded;
  const int64_t largest = int64_t{1} << 48;
  for (int i = 0; i < 257; ++i) {
    ASSERT_TRUE(crowded.add({"p" + std::to_string(i), {largest}, DType::kFloat32}).ok());
  }
  Status s = crowded.seal(2, 256);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("too large for one flat buffer"), std::string::npos) << s.to_string();
  EXPECT_FALSE(crowded.sealed());
}

TEST(LayoutPlan, AlignmentMustBeAPowerOfTwoWithinTheCap) {
  for (uint64_t bad : {uint64_t{0}, uint64_t{3}, uint64_t{1} << 63, kMaxAlignmentBytes * 2}) {
    LayoutPlan plan;
    ASSERT_TRUE(plan.add({"a", {10}, DType::kFloat32}).ok());
    const Status s = plan.seal(2, bad);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("alignment_bytes"), std::string::npos) << s.message();
    EXPECT_FALSE(plan.sealed());
  }
  LayoutPlan plan;
  ASSERT_TRUE(plan.add({"a", {10}, DType::kFloat32}).ok());
  ASSERT_TRUE(plan.seal(2, kMaxAlignmentBytes).ok());
  EXPECT_EQ(plan.buffers()[0].numel % (kMaxAlignmentBytes / 4 * 2), 0u);
}

// A unit larger than the cap is cut into buckets, in registration order, each at most the
// cap (a parameter above the cap alone in its bucket), so its reductions can start while
// its backward goes on.
TEST(LayoutPlan, BucketCapSplitsAUnitInRegistrationOrder) {
  LayoutPlan plan;
  const std::vector<int64_t> sizes = {1000, 1000, 1000, 5000, 10, 10, 1000};
  for (size_t i = 0; i < sizes.size(); ++i) {
    ASSERT_TRUE(plan.add({"p" + std::to_string(i), {sizes[i]}, DType::kFloat32}).ok());
  }
  ParamSpec other{"other_unit", {100}, DType::kFloat32};
  other.unit = 1;
  ASSERT_TRUE(plan.add(other).ok());
  const uint64_t cap = 8192;  // 2048 floats
  ASSERT_TRUE(plan.seal(2, 256, cap).ok());
  // Unit 0: {p0, p1} {p2} {p3} {p4, p5, p6}? p2 + p3 exceed; p3 alone; then p4..p6 fit.
  std::vector<std::vector<size_t>> unit0;
  for (const FlatBuffer& b : plan.buffers()) {
    if (b.unit == 0) unit0.push_back(b.params);
  }
  ASSERT_EQ(unit0.size(), 4u);
  EXPECT_EQ(unit0[0], (std::vector<size_t>{0, 1}));
  EXPECT_EQ(unit0[1], (std::vector<size_t>{2}));
  EXPECT_EQ(unit0[2], (std::vector<size_t>{3}));
  EXPECT_EQ(unit0[3], (std::vector<size_t>{4, 5, 6}));
  for (const FlatBuffer& b : plan.buffers()) {
    uint64_t used = 0;
    for (size_t i : b.params) used = plan.placement(i).offset + plan.placement(i).numel;
    if (b.params.size() > 1) {
      EXPECT_LE(used * 4, cap);
    }
  }
  // Without a cap: one buffer per unit.
  LayoutPlan uncapped;
  for (size_t i = 0; i < sizes.size(); ++i) {
    ASSERT_TRUE(uncapped.add({"p" + std::to_string(i), {sizes[i]}, DType::kFloat32}).ok());
  }
  ASSERT_TRUE(uncapped.seal(2, 256).ok());
  EXPECT_EQ(uncapped.buffers().size(), 1u);
}

// Every element of every rank's shard lies in exactly one span, and the span's treatment
// is its parameter's: counted in D, in N or not at all; scaled by the clip or not; decayed
// or not (with and without clipping).
TEST(LayoutPlan, ShardSpansFollowTheClipAndDecayFlagsOfEveryElement) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    LayoutPlan plan;
    const int n = 1 + static_cast<int>(rng() % 8);
    for (int i = 0; i < n; ++i) {
      ParamSpec p{
          "p" + std::to_string(i), {1 + static_cast<int64_t>(rng() % 300)}, DType::kFloat32};
      p.need_clip = rng() % 3 != 0;
      p.is_distributed = rng() % 2 == 0;
      p.shared_not_first = rng() % 5 == 0;
      p.weight_decay = rng() % 3 != 0;
      ASSERT_TRUE(plan.add(p).ok());
    }
    const int32_t degree = 1 + static_cast<int32_t>(rng() % 4);
    ASSERT_TRUE(plan.seal(degree, 64).ok());
    const FlatBuffer& buf = plan.buffers()[0];
    for (int32_t r = 0; r < degree; ++r) {
      const auto [begin, end] = plan.shard(0, r);
      const auto spans = plan.shard_spans(0, r, true);
      ASSERT_FALSE(spans.empty());
      EXPECT_EQ(spans.front().begin, 0u);
      EXPECT_EQ(spans.back().end, end - begin);
      const auto plain = plan.shard_spans(0, r, false);
      ASSERT_FALSE(plain.empty());
      EXPECT_EQ(plain.front().begin, 0u);
      EXPECT_EQ(plain.back().end, end - begin);
      for (size_t k = 1; k < spans.size(); ++k) EXPECT_EQ(spans[k].begin, spans[k - 1].end);
      for (size_t k = 1; k < plain.size(); ++k) {
        EXPECT_EQ(plain[k].begin, plain[k - 1].end);
        EXPECT_NE(plain[k].decayed, plain[k - 1].decayed) << "equal neighbours are one span";
      }
      for (size_t i : buf.params) {
        const Placement& pl = plan.placement(i);
        const ParamSpec& p = plan.params()[i];
        const int partial = (!p.need_clip || p.shared_not_first)
                                ? -1
                                : (p.is_distributed ? kClipPartialD : kClipPartialN);
        for (uint64_t e = pl.offset; e < pl.offset + pl.numel; ++e) {
          if (e < begin || e >= end) continue;
          const uint64_t local = e - begin;
          auto it = std::find_if(spans.begin(), spans.end(), [&](const ShardSpan& s) {
            return s.begin <= local && local < s.end;
          });
          ASSERT_NE(it, spans.end());
          EXPECT_EQ(it->partial, partial) << p.name << " element " << e;
          EXPECT_EQ(it->clipped, p.need_clip) << p.name << " element " << e;
          EXPECT_EQ(it->decayed, p.weight_decay) << p.name << " element " << e;
          auto in_plain = std::find_if(plain.begin(), plain.end(), [&](const ShardSpan& s) {
            return s.begin <= local && local < s.end;
          });
          ASSERT_NE(in_plain, plain.end());
          EXPECT_EQ(in_plain->partial, -1);
          EXPECT_FALSE(in_plain->clipped);
          EXPECT_EQ(in_plain->decayed, p.weight_decay) << p.name << " element " << e;
        }
      }
    }
  }
}

}  // namespace
}  // namespace hps
