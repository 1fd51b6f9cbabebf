// Hybrid clipping against a brute-force norm of the whole unsharded model, over every
// combination of dp, sharding, mp and pp (2-way each, up to three at once: 8 thread-
// ranks), with mixed dtypes, need_clip = false and a pipeline-shared parameter.
#include "core/clip/hybrid_clip.h"

#include <gtest/gtest.h>

#include <barrier>
#include <bit>
#include <cmath>
#include <map>
#include <mutex>

#include "core/common/config.h"
#include "core/device/cpu/stream.h"
#include "core/device/host_sync.h"
#include "core/topology/hybrid_group.h"
#include "tests/core/comm/comm_test_util.h"

namespace hps {
namespace {

using testing_util::Buffer;

// The model: parameter p has `size` elements, a dtype, flags and a pipeline stage.
struct Param {
  size_t size;
  DType dtype;
  bool is_distributed;
  bool need_clip;
};
const std::vector<Param> kModel = {
    {96, DType::kFloat32, true, true},   {40, DType::kBFloat16, false, true},
    {64, DType::kFloat16, true, true},   {33, DType::kFloat64, false, true},
    {24, DType::kFloat32, false, false}, {80, DType::kFloat32, false, true},
    {48, DType::kFloat64, true, true},   {20, DType::kBFloat16, true, true},
};
constexpr size_t kShared = 1;  // parameter 1 also lives on the last stage, flagged shared_not_first

double gradient(size_t p, size_t i) {
  return std::sin(static_cast<double>(p * 31 + i) * 0.37) * (1.0 + static_cast<double>(p));
}

// The value as the parameter's dtype holds it.
double quantized(size_t p, size_t i) {
  Buffer b(kModel[p].dtype, 1);
  b.set(0, gradient(p, i));
  return b.at(0);
}

double brute_force_norm() {
  double squares = 0;
  for (size_t p = 0; p < kModel.size(); ++p) {
    if (!kModel[p].need_clip) continue;
    for (size_t i = 0; i < kModel[p].size; ++i) squares += quantized(p, i) * quantized(p, i);
  }
  return std::sqrt(squares);
}

// [begin, end) of part k of n of [0, size).
std::pair<size_t, size_t> part(size_t size, int32_t k, int32_t n) {
  const size_t base = size / n, extra = size % n;
  const size_t begin = k * base + std::min<size_t>(k, extra);
  return {begin, begin + base + (static_cast<size_t>(k) < extra ? 1 : 0)};
}

struct LocalGradient {
  size_t param;
  size_t begin;  // global element index of local element 0
  bool shared_not_first;
  Buffer values;
};

// This rank's gradients: its pipeline stage's parameters, split over mp when
// distributed, then over sharding.
std::vector<LocalGradient> local_gradients(const Topology& t, int32_t rank) {
  const AxisArray c = *t.coordinates(rank);
  const int32_t stages = t.degree(Axis::kPp);
  std::vector<LocalGradient> out;
  for (size_t p = 0; p < kModel.size(); ++p) {
    const int32_t stage = static_cast<int32_t>(p % static_cast<size_t>(stages));
    const bool copy = p == kShared && stages > 1 && c[1] == stages - 1 && stage != c[1];
    if (stage != c[1] && !copy) continue;
    auto [b, e] = kModel[p].is_distributed ? part(kModel[p].size, c[4], t.degree(Axis::kMp))
                                           : std::pair<size_t, size_t>{0, kModel[p].size};
    auto [sb, se] = part(e - b, c[2], t.degree(Axis::kSharding));
    LocalGradient g{p, b + sb, copy, Buffer(kModel[p].dtype, se - sb)};
    for (size_t i = 0; i < se - sb; ++i) g.values.set(i, gradient(p, b + sb + i));
    out.push_back(std::move(g));
  }
  return out;
}

struct Layout {
  AxisArray degrees;
  std::string name;
};

std::vector<Layout> all_layouts() {
  std::vector<Layout> layouts;
  const char* names[] = {"dp", "pp", "sharding", "sep", "mp"};
  const int axes[] = {0, 1, 2, 4};  // dp, pp, sharding, mp
  for (int mask = 0; mask < 16; ++mask) {
    if (__builtin_popcount(static_cast<unsigned>(mask)) > 3) continue;
    Layout l{{1, 1, 1, 1, 1}, ""};
    for (int k = 0; k < 4; ++k) {
      if (mask & (1 << k)) {
        l.degrees[static_cast<size_t>(axes[k])] = 2;
        l.name += std::string(l.name.empty() ? "" : "x") + names[axes[k]] + "2";
      }
    }
    if (l.name.empty()) l.name = "single";
    layouts.push_back(l);
  }
  return layouts;
}

// Runs the clip on every rank of `layout`; returns rank 0's norm and checks every rank's
// clipped gradients against coefficient × original.
float run_layout(const Layout& layout, bool deterministic, double max_norm) {
  const int32_t world = layout.degrees[0] * layout.degrees[1] * layout.degrees[2] *
                        layout.degrees[3] * layout.degrees[4];
  auto topology = *Topology::create(layout.degrees, world);
  std::vector<float> norms(static_cast<size_t>(world), -1.0f);
  const double expected = brute_force_norm();
  const double coefficient = max_norm / (std::max(expected, max_norm) + 1e-6);
  testing_util::run_ranks(world, [&](int32_t rank, Communicator& comm) {
    std::shared_ptr<Communicator> w(&comm, [](Communicator*) {});
    auto hg_or = HybridGroup::create(w, topology);
    ASSERT_TRUE(hg_or.ok()) << hg_or.status().to_string();
    auto hg = std::move(hg_or).value();
    auto clip = HybridClip::create(hg->group(GroupKind::kSharding), hg->group(GroupKind::kMp),
                                   hg->group(GroupKind::kPp), {max_norm, deterministic});
    ASSERT_TRUE(clip.ok()) << clip.status().to_string();
    auto grads = local_gradients(topology, rank);
    for (auto& g : grads) {
      ClipTensor t{g.values.data(),           g.values.count,
                   kModel[g.param].dtype,     kModel[g.param].is_distributed,
                   kModel[g.param].need_clip, g.shared_not_first};
      ASSERT_TRUE((*clip)->add_tensor(t).ok());
    }
    const Status sealed = (*clip)->seal();
    ASSERT_TRUE(sealed.ok()) << layout.name << " rank " << rank << ": " << sealed.to_string();
    auto stream = std::move(create_stream(Device::cpu())).value();
    host_sync_reset();
    ASSERT_TRUE((*clip)->run(*stream, &norms[static_cast<size_t>(rank)]).ok());
    EXPECT_EQ(host_sync_count_thread(), 0u) << "the clip must not block the host";
    ASSERT_TRUE(stream->synchronize().ok());
    for (auto& g : grads) {
      const Param& p = kModel[g.param];
      for (size_t i = 0; i < g.values.count; ++i) {
        const double original = quantized(g.param, g.begin + i);
        Buffer want(p.dtype, 1);
        want.set(0, p.need_clip ? (p.dtype == DType::kFloat64
                                       ? original * coefficient
                                       : static_cast<double>(static_cast<float>(original) *
                                                             static_cast<float>(coefficient)))
                                : original);
        // The runtime's coefficient comes from its own (fp32-chunked) norm: allow its
        // last bits, and one rounding of the gradient's dtype.
        const double rel = p.dtype == DType::kBFloat16  ? 8e-3
                           : p.dtype == DType::kFloat16 ? 1e-3
                                                        : 2e-6;
        ASSERT_NEAR(g.values.at(i), want.at(0), std::fabs(want.at(0)) * rel + 1e-30)
            << layout.name << " rank " << rank << " param " << g.param << " element " << i;
      }
    }
  });
  for (float n : norms) EXPECT_EQ(std::bit_cast<uint32_t>(n), std::bit_cast<uint32_t>(norms[0]));
  EXPECT_NEAR(norms[0], expected, expected * 2e-6) << layout.name;
  return norms[0];
}

class HybridClipTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  }
};

TEST_F(HybridClipTest, EveryLayoutMatchesTheBruteForceNorm) {
  for (const Layout& l : all_layouts()) {
    SCOPED_TRACE(l.name);
    run_layout(l, /*deterministic=*/false, 1.0);
  }
}

TEST_F(HybridClipTest, DeterministicModeIsBitwiseEqualAcrossLayouts) {
  std::map<std::string, uint32_t> bits;
  for (const Layout& l : all_layouts()) {
    SCOPED_TRACE(l.name);
    bits[l.name] = std::bit_cast<uint32_t>(run_layout(l, /*deterministic=*/true, 1.0));
  }
  for (const auto& [name, b] : bits) EXPECT_EQ(b, bits.at("single")) << name;
}

TEST_F(HybridClipTest, ANormBelowMaxLeavesGradientsAlmostUnchanged) {
  run_layout({{1, 1, 2, 1, 2}, "sharding2xmp2"}, false, 1e6);
}

// Single-rank edge cases: all-zero, NaN and Inf gradients (torch's clip_grad_norm_
// without error_if_nonfinite: NaN propagates, Inf gives a zero coefficient).
float clip_single(std::vector<float>& values, bool deterministic = false) {
  auto clip =
      std::move(HybridClip::create(nullptr, nullptr, nullptr, {1.0, deterministic})).value();
  EXPECT_TRUE(clip->add_tensor({values.data(), values.size(), DType::kFloat32}).ok());
  EXPECT_TRUE(clip->seal().ok());
  auto stream = std::move(create_stream(Device::cpu())).value();
  float norm = -1;
  EXPECT_TRUE(clip->run(*stream, &norm).ok());
  EXPECT_TRUE(stream->synchronize().ok());
  return norm;
}

TEST(HybridClipEdges, ZeroNanAndInfGradients) {
  for (bool deterministic : {false, true}) {
    std::vector<float> zeros(100, 0.0f);
    EXPECT_EQ(clip_single(zeros, deterministic), 0.0f);
    for (float z : zeros) EXPECT_EQ(z, 0.0f);

    std::vector<float> with_nan = {1.0f, NAN, 2.0f};
    EXPECT_TRUE(std::isnan(clip_single(with_nan, deterministic)));
    EXPECT_TRUE(std::isnan(with_nan[0]) && std::isnan(with_nan[2]));

    std::vector<float> with_inf = {3.0f, INFINITY, -4.0f};
    EXPECT_TRUE(std::isinf(clip_single(with_inf, deterministic)));
    EXPECT_EQ(with_inf[0], 0.0f);
    EXPECT_EQ(with_inf[2], -0.0f);
    EXPECT_TRUE(std::isnan(with_inf[1])) << "inf * 0, as torch computes it";
  }
}

TEST(HybridClipEdges, CoefficientStaysOnTheDeviceForAFusedOptimizer) {
  std::vector<float> g = {3.0f, 4.0f};  // norm 5
  auto clip = std::move(HybridClip::create(nullptr, nullptr, nullptr, {1.0, false})).value();
  ASSERT_TRUE(clip->add_tensor({g.data(), g.size(), DType::kFloat32}).ok());
  ASSERT_TRUE(clip->seal().ok());
  auto stream = std::move(create_stream(Device::cpu())).value();
  ASSERT_TRUE(clip->run(*stream, nullptr, /*scale=*/false).ok());
  ASSERT_TRUE(stream->synchronize().ok());
  EXPECT_EQ(g[0], 3.0f) << "scale = false leaves the gradients";
  EXPECT_FLOAT_EQ(*clip->coefficient(), static_cast<float>(1.0 / (5.0 + 1e-6)));
}

TEST(HybridClipEdges, BadInputIsRefusedAndChangesNothing) {
  EXPECT_EQ(HybridClip::create(nullptr, nullptr, nullptr, {0.0, false}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(HybridClip::create(nullptr, nullptr, nullptr, {-1.0, false}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(HybridClip::create(nullptr, nullptr, nullptr, {NAN, false}).status().code(),
            StatusCode::kInvalidArgument);
  auto clip = std::move(HybridClip::create(nullptr, nullptr, nullptr, {1.0, false})).value();
  int32_t ints[4] = {1, 2, 3, 4};
  EXPECT_EQ(clip->add_tensor({ints, 4, DType::kInt32}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(clip->add_tensor({nullptr, 4, DType::kFloat32}).code(), StatusCode::kInvalidArgument);
  // Not aligned to its elements: the kernels load whole elements.
  alignas(8) unsigned char raw[64] = {};
  const Status unaligned = clip->add_tensor({raw + 1, 2, DType::kFloat32});
  EXPECT_EQ(unaligned.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(unaligned.message().find("not aligned"), std::string::npos) << unaligned.message();
  EXPECT_EQ(clip->tensor_count(), 0u);
  // Memory registered twice, or shared by two gradients, would be counted and scaled twice.
  float grads[8] = {};
  ASSERT_TRUE(clip->add_tensor({grads, 4, DType::kFloat32}).ok());
  const Status twice = clip->add_tensor({grads, 4, DType::kFloat32});
  EXPECT_EQ(twice.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(twice.message().find("tensor 1 overlaps tensor 0"), std::string::npos)
      << twice.message();
  EXPECT_EQ(clip->add_tensor({grads + 3, 2, DType::kFloat32}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(clip->add_tensor({grads, 8, DType::kBFloat16}).code(), StatusCode::kInvalidArgument);
  // Adjacent is not overlapping; an empty gradient overlaps nothing.
  EXPECT_TRUE(clip->add_tensor({grads + 4, 4, DType::kFloat32}).ok());
  EXPECT_TRUE(clip->add_tensor({grads, 0, DType::kFloat32}).ok());
  EXPECT_EQ(clip->tensor_count(), 3u);
  auto stream = std::move(create_stream(Device::cpu())).value();
  EXPECT_EQ(clip->run(*stream, nullptr).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(clip->seal().ok());
  float f = 1;
  EXPECT_EQ(clip->add_tensor({&f, 1, DType::kFloat32}).code(), StatusCode::kFailedPrecondition);
}

TEST_F(HybridClipTest, MismatchedFlagsAcrossMpRanksAreRefusedWithNoGradientChanged) {
  testing_util::run_ranks(2, [](int32_t rank, Communicator& comm) {
    std::shared_ptr<Communicator> mp(&comm, [](Communicator*) {});
    auto clip = std::move(HybridClip::create(nullptr, mp, nullptr, {1.0, false})).value();
    std::vector<float> g = {30.0f, 40.0f};
    ASSERT_TRUE(
        clip->add_tensor({g.data(), g.size(), DType::kFloat32, /*is_distributed=*/rank == 0}).ok());
    Status s = clip->seal();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
    EXPECT_NE(s.message().find("is_distributed"), std::string::npos);
    auto stream = std::move(create_stream(Device::cpu())).value();
    EXPECT_EQ(clip->run(*stream, nullptr).code(), StatusCode::kFailedPrecondition);
    EXPECT_EQ(g[0], 30.0f);
  });
}

// pp 2 x mp 2: only pp stage 0's mp group registers different flags. Every rank's seal is
// refused at once (pp stage 1's ranks sealed, then waited in their first run() for the pp
// peers that had stopped), and the groups stay usable: the next clip on them runs.
TEST_F(HybridClipTest, AMismatchOnOneMpGroupIsRefusedOnEveryRank) {
  auto topology = *Topology::create({1, 2, 1, 1, 2}, 4);
  testing_util::run_ranks(4, [&](int32_t rank, Communicator& comm) {
    std::shared_ptr<Communicator> w(&comm, [](Communicator*) {});
    auto hg = std::move(HybridGroup::create(w, topology)).value();
    auto mp = hg->group(GroupKind::kMp), pp = hg->group(GroupKind::kPp);
    std::vector<float> g = {30.0f, 40.0f};
    {
      auto clip = std::move(HybridClip::create(nullptr, mp, pp, {1.0, false})).value();
      ASSERT_TRUE(clip->add_tensor({g.data(), g.size(), DType::kFloat32,
                                    /*is_distributed=*/rank != 0})
                      .ok());
      const Status s = clip->seal();
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << "rank " << rank << ": " << s.to_string();
      const bool found = topology.coordinates(rank)->at(static_cast<size_t>(Axis::kPp)) == 0;
      EXPECT_NE(s.message().find(found ? "is_distributed" : "seal refused on every rank"),
                std::string::npos)
          << s.to_string();
    }
    auto clip = std::move(HybridClip::create(nullptr, mp, pp, {1.0, false})).value();
    ASSERT_TRUE(clip->add_tensor({g.data(), g.size(), DType::kFloat32, true}).ok());
    ASSERT_TRUE(clip->seal().ok());
    auto stream = std::move(create_stream(Device::cpu())).value();
    float norm = 0;
    ASSERT_TRUE(clip->run(*stream, &norm).ok());
    ASSERT_TRUE(stream->synchronize().ok());
    EXPECT_NEAR(norm, 100.0f, 1e-3f);  // 2 mp parts of [30, 40] on each of 2 stages
  });
}

// A reduction that fails after run() returned (here: the ranks disagree on the mode, so
// the all-reduce is refused) is the stream's error at synchronize(), on every rank: the
// norm of that run is one rank's partial and must not pass for the model's.
TEST_F(HybridClipTest, AReductionThatFailsAfterRunIsTheStreamsErrorOnEveryRank) {
  testing_util::run_ranks(2, [](int32_t rank, Communicator& comm) {
    std::shared_ptr<Communicator> sharding(&comm, [](Communicator*) {});
    auto clip = std::move(HybridClip::create(sharding, nullptr, nullptr,
                                             {1.0, /*deterministic=*/rank == 0}))
                    .value();
    std::vector<float> g(4, 1.0f + static_cast<float>(rank));
    ASSERT_TRUE(clip->add_tensor({g.data(), g.size(), DType::kFloat32}).ok());
    ASSERT_TRUE(clip->seal().ok());
    auto stream = std::move(create_stream(Device::cpu())).value();
    ASSERT_TRUE(clip->run(*stream, nullptr).ok()) << "the failure comes later, in stream order";
    const Status s = stream->synchronize();
    EXPECT_FALSE(s.ok()) << "rank " << rank << ": a clip over one rank's partial reported OK";
    EXPECT_NE(s.message().find("all_reduce"), std::string::npos) << s.to_string();
    EXPECT_TRUE(stream->synchronize().ok()) << "reported once";
    const Status next = clip->run(*stream, nullptr);
    EXPECT_EQ(next.code(), StatusCode::kAborted) << "the communicator failed: " << next.to_string();
  });
}

// A failure crosses a clip's groups. sharding 2 x mp 2, one rank gone before a run: its
// sharding peer's reduction with it fails, and that peer must not send the mp reduction what
// the failed one left, or the rank sharing no group with the gone one takes a wrong norm
// (and scales its gradients by it) with nothing reported: its run is the stream's error.
TEST_F(HybridClipTest, ARankSharingNoGroupWithARankThatLeftFailsItsRun) {
  auto topology = *Topology::create({1, 1, 2, 1, 2}, 4);
  constexpr int32_t kGone = 3;
  std::barrier first_run_done(4);
  testing_util::run_ranks(4, [&](int32_t rank, Communicator& comm) {
    std::shared_ptr<Communicator> w(&comm, [](Communicator*) {});
    auto hg = std::move(HybridGroup::create(w, topology)).value();
    auto clip = std::move(HybridClip::create(hg->group(GroupKind::kSharding),
                                             hg->group(GroupKind::kMp), nullptr, {1.0, false}))
                    .value();
    std::vector<float> g(64, 1.0f);
    ASSERT_TRUE(clip->add_tensor({g.data(), g.size(), DType::kFloat32, true}).ok());
    ASSERT_TRUE(clip->seal().ok());
    auto stream = std::move(create_stream(Device::cpu())).value();
    float norm = 0;
    ASSERT_TRUE(clip->run(*stream, &norm).ok());
    ASSERT_TRUE(stream->synchronize().ok());
    first_run_done.arrive_and_wait();
    if (rank == kGone) {
      w->abort();  // its connections end, as when its process dies
      return;
    }
    const Status run = clip->run(*stream, &norm);
    const Status s = run.ok() ? stream->synchronize() : run;
    EXPECT_FALSE(s.ok()) << "rank " << rank << " took the norm " << norm;
    EXPECT_NE(s.code(), StatusCode::kTimeout) << "rank " << rank << ": " << s.to_string();
  });
}

// Ranks that meet at a clip's reduction with another collective of the same size are
// refused on both (it carries its tag): an engine's clip against a standalone clip, and a
// standalone clip against a caller's untagged all-reduce of two doubles. Without the tag the
// first two exchanged partial sums and each returned a norm built from the other's.
TEST_F(HybridClipTest, ARankAtAnotherCollectiveOfTheSameSizeIsRefused) {
  for (const bool against_user : {false, true}) {
    SCOPED_TRACE(against_user ? "against an untagged all-reduce" : "against an engine's clip");
    testing_util::run_ranks(2, [&](int32_t rank, Communicator& comm) {
      std::shared_ptr<Communicator> sharding(&comm, [](Communicator*) {});
      auto stream = std::move(create_stream(Device::cpu())).value();
      std::vector<float> g(4, 1.0f);
      ClipOptions options{1.0, false, rank == 0 ? kClipTag : kEngineClipTag};
      auto clip = std::move(HybridClip::create(sharding, nullptr, nullptr, options)).value();
      ASSERT_TRUE(clip->add_tensor({g.data(), g.size(), DType::kFloat32}).ok());
      ASSERT_TRUE(clip->seal().ok());
      Status s;
      if (rank == 1 && against_user) {
        double partials[2] = {1.0, 2.0};
        auto work = comm.all_reduce(partials, partials, 2, DType::kFloat64, ReduceOp::kSum);
        ASSERT_TRUE(work.ok());
        s = (*work)->wait();
      } else {
        ASSERT_TRUE(clip->run(*stream, nullptr).ok());
        s = stream->synchronize();
      }
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << "rank " << rank << ": " << s.to_string();
      if (rank == 0) {
        EXPECT_NE(s.message().find("(a standalone clip's norm)"), std::string::npos) << s.message();
      }
    });
  }
}

// Destroying a clip right after run() waits for the queued kernels (they use its state and
// the gradients): no use after free (this test is what ASan checks), and the run completed.
TEST(HybridClipEdges, DestroyingAClipRightAfterRunWaitsForItsWork) {
  for (int i = 0; i < 20; ++i) {
    auto stream = std::move(create_stream(Device::cpu())).value();
    std::vector<std::vector<float>> grads(16, std::vector<float>(4096, 1.0f));
    {
      auto clip =
          std::move(HybridClip::create(nullptr, nullptr, nullptr, {1.0, i % 2 == 1})).value();
      for (auto& g : grads)
        ASSERT_TRUE(clip->add_tensor({g.data(), g.size(), DType::kFloat32}).ok());
      ASSERT_TRUE(clip->seal().ok());
      ASSERT_TRUE(clip->run(*stream, nullptr).ok());
    }
    // norm = sqrt(16 · 4096) = 256: every gradient was scaled by 1 / (256 + 1e-6).
    EXPECT_FLOAT_EQ(grads.back().back(), static_cast<float>(1.0 / (256.0 + 1e-6)));
    ASSERT_TRUE(stream->synchronize().ok());
  }
}

TEST(FixedSquares, OrderAndSplitDoNotChangeTheBits) {
  std::vector<double> values;
  for (int i = 0; i < 10000; ++i) values.push_back(std::ldexp(std::sin(i * 1.3), (i % 40) - 20));
  FixedSquares forward, backward, halves_a, halves_b;
  for (double v : values) forward.add_square(v * v);
  for (auto it = values.rbegin(); it != values.rend(); ++it) backward.add_square(*it * *it);
  for (size_t i = 0; i < values.size(); ++i) {
    (i % 2 ? halves_a : halves_b).add_square(values[i] * values[i]);
  }
  halves_a.merge(halves_b);
  EXPECT_EQ(std::bit_cast<uint64_t>(forward.value()), std::bit_cast<uint64_t>(backward.value()));
  EXPECT_EQ(std::bit_cast<uint64_t>(forward.value()), std::bit_cast<uint64_t>(halves_a.value()));
  double plain = 0;
  for (double v : values) plain += v * v;
  EXPECT_NEAR(forward.value(), plain, plain * 1e-12);
}

}  // namespace
}  // namespace hps
