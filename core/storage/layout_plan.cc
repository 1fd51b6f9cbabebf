#include "core/storage/layout_plan.h"

#include <algorithm>
#include <limits>
#include <tuple>

#include "core/common/env.h"
#include "core/kernels/norm.h"

namespace hps {
namespace {

// Elements in one flat buffer, at most: far below 2^64 so that offsets, byte counts of
// 8-byte elements and the padding arithmetic never overflow.
constexpr uint64_t kMaxBufferElements = uint64_t{1} << 56;

uint64_t round_up(uint64_t v, uint64_t m) { return (v + m - 1) / m * m; }

}  // namespace

uint64_t ParamSpec::numel() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

Status LayoutPlan::add(ParamSpec spec) {
  if (sealed_)
    return failed_precondition("parameter '" + spec.name +
                               "' registered after the plan was sealed");
  // A checkpoint's manifest (JSON: UTF-8) names it; messages and tools show it.
  HPS_RETURN_IF_ERROR(check_shown_name(spec.name, "parameter name", kMaxParamNameBytes));
  for (const auto& p : params_) {
    if (p.name == spec.name)
      return already_exists("parameter '" + spec.name + "' is registered twice");
  }
  uint64_t n = 1;
  for (int64_t d : spec.shape) {
    if (d < 0) return invalid_argument("parameter '" + spec.name + "' has a negative dimension");
    if (d != 0 && n > std::numeric_limits<uint64_t>::max() / 2 / static_cast<uint64_t>(d)) {
      return invalid_argument("parameter '" + spec.name + "': its element count overflows");
    }
    n *= static_cast<uint64_t>(d);
  }
  if (n > (uint64_t{1} << 48))
    return invalid_argument("parameter '" + spec.name + "' is too large");
  if (spec.unit < 0) return invalid_argument("parameter '" + spec.name + "': unit must be >= 0");
  params_.push_back(std::move(spec));
  return Status::Ok();
}

Status LayoutPlan::seal(int32_t degree, uint64_t alignment_bytes, uint64_t bucket_bytes) {
  if (sealed_) return failed_precondition("the layout plan is sealed already");
  if (degree < 1) return invalid_argument("sharding degree must be at least 1");
  if (alignment_bytes == 0 || (alignment_bytes & (alignment_bytes - 1)) != 0 ||
      alignment_bytes > kMaxAlignmentBytes) {
    return invalid_argument("alignment_bytes must be a power of two from 1 to " +
                            std::to_string(kMaxAlignmentBytes) + ", not " +
                            std::to_string(alignment_bytes));
  }
  // Buffers in (trainable, dtype, unit, bucket) order — frozen parameters never share a
  // buffer with trained ones; parameters in registration order within each.
  using Group = std::tuple<bool, int32_t, int32_t>;
  auto group_of = [](const ParamSpec& p) {
    return Group{!p.trainable, static_cast<int32_t>(p.dtype), p.unit};
  };
  // Each group's parameters cut into buckets by the cap, in registration order.
  std::map<Group, std::vector<std::vector<size_t>>> groups;
  std::map<Group, uint64_t> filled;  // elements in the group's last bucket so far
  for (size_t i = 0; i < params_.size(); ++i) {
    const Group g = group_of(params_[i]);
    auto& buckets = groups[g];
    const uint64_t element = dtype_size(params_[i].dtype);
    const uint64_t align = std::max<uint64_t>(1, alignment_bytes / element);
    const uint64_t start = buckets.empty() ? 0 : round_up(filled[g], align);
    const bool full = bucket_bytes > 0 && !buckets.empty() && !buckets.back().empty() &&
                      (start + params_[i].numel()) * element > bucket_bytes;
    if (buckets.empty() || full) {
      buckets.emplace_back();
      filled[g] = 0;
    }
    buckets.back().push_back(i);
    filled[g] = round_up(filled[g], align) + params_[i].numel();
    if (filled[g] > kMaxBufferElements) {
      return invalid_argument("parameters of unit " + std::to_string(params_[i].unit) +
                              " are too large for one flat buffer (at '" + params_[i].name +
                              "'): set a bucket size cap");
    }
  }
  buffers_.clear();
  placements_.assign(params_.size(), {});
  for (const auto& [group, buckets] : groups) {
    for (size_t k = 0; k < buckets.size(); ++k) {
      FlatBuffer buf{static_cast<DType>(std::get<1>(group)),
                     std::get<2>(group),
                     !std::get<0>(group),
                     0,
                     0,
                     {},
                     static_cast<int32_t>(k)};
      const uint64_t align = std::max<uint64_t>(1, alignment_bytes / dtype_size(buf.dtype));
      for (size_t i : buckets[k]) {
        const uint64_t offset = round_up(buf.numel, align);
        placements_[i] = {buffers_.size(), offset, params_[i].numel()};
        buf.numel = offset + params_[i].numel();
        buf.params.push_back(i);
      }
      buf.numel = round_up(std::max<uint64_t>(buf.numel, 1), align * static_cast<uint64_t>(degree));
      buf.shard_numel = buf.numel / static_cast<uint64_t>(degree);
      buffers_.push_back(std::move(buf));
    }
  }
  degree_ = degree;
  alignment_bytes_ = alignment_bytes;
  sealed_ = true;
  return Status::Ok();
}

std::pair<uint64_t, uint64_t> LayoutPlan::shard(size_t b, int32_t rank) const {
  const uint64_t s = buffers_[b].shard_numel;
  return {s * static_cast<uint64_t>(rank), s * static_cast<uint64_t>(rank + 1)};
}

std::pair<uint64_t, uint64_t> LayoutPlan::local_part(size_t param, int32_t rank) const {
  const Placement& p = placements_[param];
  const auto [begin, end] = shard(p.buffer, rank);
  const uint64_t lo = std::max(begin, p.offset), hi = std::min(end, p.offset + p.numel);
  if (lo >= hi) return {0, 0};
  return {lo - p.offset, hi - p.offset};
}

std::vector<ShardSpan> LayoutPlan::shard_spans(size_t b, int32_t rank, bool clip) const {
  const auto [shard_begin, shard_end] = shard(b, rank);
  const uint64_t length = shard_end - shard_begin;
  std::vector<ShardSpan> spans;
  for (size_t i : buffers_[b].params) {
    const auto [lo, hi] = local_part(i, rank);
    if (lo == hi) continue;
    const ParamSpec& p = params_[i];
    const int partial = (!clip || !p.need_clip || p.shared_not_first)
                            ? -1
                            : (p.is_distributed ? kClipPartialD : kClipPartialN);
    const bool clipped = clip && p.need_clip;
    const uint64_t begin = placements_[i].offset + lo - shard_begin;
    const uint64_t end = placements_[i].offset + hi - shard_begin;
    if (!spans.empty() && spans.back().partial == partial && spans.back().clipped == clipped &&
        spans.back().decayed == p.weight_decay) {
      spans.back().end = end;  // the padding between them joins too
      continue;
    }
    if (!spans.empty()) spans.back().end = begin;  // padding before this one joins the last
    spans.push_back({spans.empty() ? 0 : begin, end, partial, clipped, p.weight_decay});
  }
  if (spans.empty()) return {{0, length, -1, false, true}};  // padding only
  spans.back().end = length;
  return spans;
}

uint64_t LayoutPlan::fingerprint() const {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix(params_.size());
  for (const auto& p : params_) {
    for (char c : p.name) mix(static_cast<uint8_t>(c));
    mix(p.shape.size());
    for (int64_t d : p.shape) mix(static_cast<uint64_t>(d));
    mix(static_cast<uint64_t>(p.dtype));
    mix(static_cast<uint64_t>(p.unit));
    mix((p.trainable ? 1u : 0u) | (p.is_distributed ? 2u : 0u) | (p.need_clip ? 4u : 0u) |
        (p.shared_not_first ? 8u : 0u) | (p.weight_decay ? 0u : 16u));
  }
  return h;
}

}  // namespace hps
