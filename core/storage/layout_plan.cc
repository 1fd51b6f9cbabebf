#include "core/storage/layout_plan.h"

#include <limits>
#include <tuple>

namespace hps {
namespace {

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
  if (spec.name.empty()) return invalid_argument("a parameter needs a name");
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

Status LayoutPlan::seal(int32_t degree, uint64_t alignment_bytes) {
  if (sealed_) return failed_precondition("the layout plan is sealed already");
  if (degree < 1) return invalid_argument("sharding degree must be at least 1");
  if (alignment_bytes == 0 || (alignment_bytes & (alignment_bytes - 1)) != 0) {
    return invalid_argument("alignment must be a power of two");
  }
  // Buffers in (trainable, dtype, unit) order — frozen parameters never share a buffer
  // with trained ones; parameters in registration order within each.
  using Key = std::tuple<bool, int32_t, int32_t>;
  auto key_of = [](const ParamSpec& p) {
    return Key{!p.trainable, static_cast<int32_t>(p.dtype), p.unit};
  };
  std::map<Key, size_t> index;
  for (const auto& p : params_) index.emplace(key_of(p), 0);
  buffers_.clear();
  for (auto& [key, b] : index) {
    b = buffers_.size();
    buffers_.push_back(
        {static_cast<DType>(std::get<1>(key)), std::get<2>(key), !std::get<0>(key), 0, 0, {}});
  }
  placements_.assign(params_.size(), {});
  for (size_t i = 0; i < params_.size(); ++i) {
    const size_t b = index.at(key_of(params_[i]));
    FlatBuffer& buf = buffers_[b];
    const uint64_t align = std::max<uint64_t>(1, alignment_bytes / dtype_size(buf.dtype));
    const uint64_t offset = round_up(buf.numel, align);
    placements_[i] = {b, offset, params_[i].numel()};
    buf.numel = offset + params_[i].numel();
    buf.params.push_back(i);
  }
  for (auto& buf : buffers_) {
    const uint64_t align = std::max<uint64_t>(1, alignment_bytes / dtype_size(buf.dtype));
    buf.numel = round_up(std::max<uint64_t>(buf.numel, 1), align * static_cast<uint64_t>(degree));
    buf.shard_numel = buf.numel / static_cast<uint64_t>(degree);
  }
  degree_ = degree;
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
        (p.shared_not_first ? 8u : 0u));
  }
  return h;
}

}  // namespace hps
