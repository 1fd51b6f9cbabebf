#include "core/topology/hybrid_group.h"

#include <string>

namespace hps {
namespace {

constexpr GroupKind kAllGroupKinds[] = {
    GroupKind::kDp, GroupKind::kPp,    GroupKind::kSharding,     GroupKind::kSep,
    GroupKind::kMp, GroupKind::kCheck, GroupKind::kShardingCheck};

// Every group of `kind`, ordered by first rank: the order all ranks create them in.
std::vector<std::vector<int32_t>> all_groups(const Topology& t, GroupKind kind) {
  if (static_cast<int32_t>(kind) < kAxisCount) {
    return t.all_axis_groups(static_cast<Axis>(kind));
  }
  std::vector<std::vector<int32_t>> groups;
  std::vector<bool> placed(static_cast<size_t>(t.world_size()), false);
  for (int32_t r = 0; r < t.world_size(); ++r) {
    if (placed[static_cast<size_t>(r)]) continue;
    auto g =
        kind == GroupKind::kCheck ? t.check_group(r).value() : t.sharding_check_group(r).value();
    for (int32_t m : g) placed[static_cast<size_t>(m)] = true;
    groups.push_back(std::move(g));
  }
  return groups;
}

}  // namespace

std::string_view group_kind_name(GroupKind kind) {
  switch (kind) {
    case GroupKind::kCheck: return "check";
    case GroupKind::kShardingCheck: return "sharding_check";
    default: return axis_name(static_cast<Axis>(kind));
  }
}

StatusOr<GroupKind> group_kind_from_int(int32_t raw) {
  if (raw < 0 || raw >= kGroupKindCount) {
    return invalid_argument("unknown group " + std::to_string(raw) +
                            " (0=dp, 1=pp, 2=sharding, 3=sep, 4=mp, 5=check, 6=sharding_check)");
  }
  return static_cast<GroupKind>(raw);
}

StatusOr<std::unique_ptr<HybridGroup>> HybridGroup::create(std::shared_ptr<Communicator> world,
                                                           const Topology& topology) {
  if (!world) return invalid_argument("hybrid group: the world communicator is null");
  if (world->size() != topology.world_size()) {
    return invalid_argument("hybrid group: the world has " + std::to_string(world->size()) +
                            " ranks but the topology " + topology.to_string() + " needs " +
                            std::to_string(topology.world_size()));
  }
  std::unique_ptr<HybridGroup> hg(new HybridGroup(world, topology));
  for (GroupKind kind : kAllGroupKinds) {
    for (const auto& ranks : all_groups(topology, kind)) {
      HPS_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> c,
                           world->split(ranks, std::string(group_kind_name(kind))));
      if (c) {
        c->set_topology_axis(std::string(group_kind_name(kind)));
        hg->groups_[static_cast<size_t>(kind)] = std::move(c);
      }
    }
    if (!hg->groups_[static_cast<size_t>(kind)]) {
      return internal_error("hybrid group: rank " + std::to_string(world->rank()) + " is in no " +
                            std::string(group_kind_name(kind)) + " group");
    }
  }
  return hg;
}

StatusOr<std::vector<int32_t>> HybridGroup::ranks(GroupKind kind) const {
  const int32_t r = rank();
  switch (kind) {
    case GroupKind::kCheck: return topology_.check_group(r);
    case GroupKind::kShardingCheck: return topology_.sharding_check_group(r);
    default: return topology_.axis_group(static_cast<Axis>(kind), r);
  }
}

}  // namespace hps
