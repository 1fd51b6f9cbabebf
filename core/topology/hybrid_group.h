// The hybrid communicate group: one communicator for every group a rank belongs to —
// along each axis, the check group (same dp coordinate: the model replica) and the
// sharding check group (same sharding coordinate) — created collectively from the world.
#pragma once

#include <array>
#include <memory>

#include "core/comm/communicator.h"
#include "core/topology/topology.h"

namespace hps {

// Numeric values are the C API's hps_group_t; the first five equal Axis.
enum class GroupKind : int32_t {
  kDp = 0,
  kPp = 1,
  kSharding = 2,
  kSep = 3,
  kMp = 4,
  kCheck = 5,
  kShardingCheck = 6,
};
inline constexpr int kGroupKindCount = 7;
std::string_view group_kind_name(GroupKind kind);
StatusOr<GroupKind> group_kind_from_int(int32_t raw);

class HybridGroup {
 public:
  // Collective over `world` (whose size must equal the topology's world): every rank
  // creates every group in the same order; each keeps the communicators it belongs to.
  static StatusOr<std::unique_ptr<HybridGroup>> create(std::shared_ptr<Communicator> world,
                                                       const Topology& topology);

  const Topology& topology() const { return topology_; }
  int32_t rank() const { return world_->rank(); }
  std::shared_ptr<Communicator> world() const { return world_; }
  std::shared_ptr<Communicator> group(GroupKind kind) const {
    return groups_[static_cast<size_t>(kind)];
  }
  // The ranks (world numbering) of this rank's group of `kind`; its source is the first.
  StatusOr<std::vector<int32_t>> ranks(GroupKind kind) const;

 private:
  HybridGroup(std::shared_ptr<Communicator> world, Topology topology)
      : world_(std::move(world)), topology_(std::move(topology)) {}
  std::shared_ptr<Communicator> world_;
  Topology topology_;
  std::array<std::shared_ptr<Communicator>, kGroupKindCount> groups_;
};

}  // namespace hps
