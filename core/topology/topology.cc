#include "core/topology/topology.h"

#include <algorithm>

namespace hps {

std::string_view axis_name(Axis axis) {
  switch (axis) {
    case Axis::kDp: return "dp";
    case Axis::kPp: return "pp";
    case Axis::kSharding: return "sharding";
    case Axis::kSep: return "sep";
    case Axis::kMp: return "mp";
  }
  return "unknown";
}

StatusOr<Axis> axis_from_name(std::string_view name) {
  for (Axis a : kDefaultAxisOrder) {
    if (axis_name(a) == name) return a;
  }
  return invalid_argument("unknown axis '" + std::string(name) + "' (dp, pp, sharding, sep, mp)");
}

StatusOr<Topology> Topology::create(const AxisArray& degrees, int32_t world_size,
                                    const std::array<Axis, kAxisCount>& order) {
  std::array<int, kAxisCount> seen{};
  for (Axis a : order) {
    const auto i = static_cast<int32_t>(a);
    if (i < 0 || i >= kAxisCount) {
      return invalid_argument("axis order holds an unknown axis value " + std::to_string(i));
    }
    if (++seen[static_cast<size_t>(i)] > 1) {
      return invalid_argument("axis order names '" + std::string(axis_name(a)) + "' twice");
    }
  }
  int64_t product = 1;
  for (Axis a : kDefaultAxisOrder) {
    const int32_t d = degrees[index(a)];
    if (d < 1) {
      return invalid_argument("degree of " + std::string(axis_name(a)) + " is " +
                              std::to_string(d) + "; every degree must be at least 1");
    }
    product *= d;
    if (product > (int64_t{1} << 30)) return invalid_argument("degrees multiply past 2^30 ranks");
  }
  if (product != world_size) {
    return invalid_argument("degrees multiply to " + std::to_string(product) +
                            " but the world size is " + std::to_string(world_size));
  }
  Topology t;
  t.degrees_ = degrees;
  t.order_ = order;
  t.world_size_ = world_size;
  return t;
}

Status Topology::check_rank(int32_t rank) const {
  if (rank < 0 || rank >= world_size_) {
    return out_of_range("rank " + std::to_string(rank) + " is outside the world of " +
                        std::to_string(world_size_));
  }
  return Status::Ok();
}

StatusOr<AxisArray> Topology::coordinates(int32_t rank) const {
  HPS_RETURN_IF_ERROR(check_rank(rank));
  AxisArray c{};
  int32_t rest = rank;
  for (auto it = order_.rbegin(); it != order_.rend(); ++it) {  // last axis fastest
    const int32_t d = degrees_[index(*it)];
    c[index(*it)] = rest % d;
    rest /= d;
  }
  return c;
}

StatusOr<int32_t> Topology::rank_of(const AxisArray& coordinates) const {
  int32_t rank = 0;
  for (Axis a : order_) {
    const int32_t d = degrees_[index(a)];
    const int32_t c = coordinates[index(a)];
    if (c < 0 || c >= d) {
      return out_of_range("coordinate " + std::to_string(c) + " on " + std::string(axis_name(a)) +
                          " is outside its degree " + std::to_string(d));
    }
    rank = rank * d + c;
  }
  return rank;
}

std::vector<int32_t> Topology::ranks_matching(int32_t rank,
                                              const std::array<bool, kAxisCount>& fixed) const {
  // The members only, not a walk of the world: the free axes' coordinates counted through with
  // the last axis of order_ fastest, as rank_of weighs them, give ascending ranks.
  AxisArray c = coordinates(rank).value();
  std::vector<size_t> free;
  size_t members = 1;
  for (Axis a : order_) {
    if (fixed[index(a)]) continue;
    free.push_back(index(a));
    c[index(a)] = 0;
    members *= static_cast<size_t>(degrees_[index(a)]);
  }
  std::vector<int32_t> out;
  out.reserve(members);
  for (;;) {
    out.push_back(rank_of(c).value());
    size_t i = free.size();
    for (; i > 0; --i) {
      const size_t k = free[i - 1];
      if (++c[k] < degrees_[k]) break;
      c[k] = 0;
    }
    if (i == 0) return out;
  }
}

StatusOr<std::vector<int32_t>> Topology::axis_group(Axis axis, int32_t rank) const {
  HPS_RETURN_IF_ERROR(check_rank(rank));
  std::array<bool, kAxisCount> fixed;
  fixed.fill(true);
  fixed[index(axis)] = false;
  // Ascending rank order is the order along `axis`: the other coordinates are fixed.
  return ranks_matching(rank, fixed);
}

std::vector<std::vector<int32_t>> Topology::all_axis_groups(Axis axis) const {
  std::vector<std::vector<int32_t>> groups;
  std::vector<bool> placed(static_cast<size_t>(world_size_), false);
  for (int32_t r = 0; r < world_size_; ++r) {
    if (placed[static_cast<size_t>(r)]) continue;
    auto g = axis_group(axis, r).value();
    for (int32_t m : g) placed[static_cast<size_t>(m)] = true;
    groups.push_back(std::move(g));
  }
  return groups;
}

StatusOr<std::vector<int32_t>> Topology::check_group(int32_t rank) const {
  HPS_RETURN_IF_ERROR(check_rank(rank));
  std::array<bool, kAxisCount> fixed{};
  fixed[index(Axis::kDp)] = true;
  return ranks_matching(rank, fixed);
}

StatusOr<std::vector<int32_t>> Topology::sharding_check_group(int32_t rank) const {
  HPS_RETURN_IF_ERROR(check_rank(rank));
  std::array<bool, kAxisCount> fixed{};
  fixed[index(Axis::kSharding)] = true;
  return ranks_matching(rank, fixed);
}

StatusOr<int32_t> Topology::pipeline_prev(int32_t rank) const {
  HPS_ASSIGN_OR_RETURN(AxisArray c, coordinates(rank));
  const int32_t p = degree(Axis::kPp);
  c[index(Axis::kPp)] = (c[index(Axis::kPp)] + p - 1) % p;
  return rank_of(c);
}

StatusOr<int32_t> Topology::pipeline_next(int32_t rank) const {
  HPS_ASSIGN_OR_RETURN(AxisArray c, coordinates(rank));
  const int32_t p = degree(Axis::kPp);
  c[index(Axis::kPp)] = (c[index(Axis::kPp)] + 1) % p;
  return rank_of(c);
}

std::string Topology::to_string() const {
  std::string s;
  for (Axis a : order_) {
    if (!s.empty()) s += " x ";
    s += std::string(axis_name(a)) + std::to_string(degree(a));
  }
  return s + " (world " + std::to_string(world_size_) + ")";
}

}  // namespace hps
