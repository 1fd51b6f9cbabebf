// Topology and hybrid group handles.
#include <cstring>
#include <string>

#include "capi/src/error.h"
#include "capi/src/handles.h"

using hps::capi::guard;
using hps::capi::raw_enum;

namespace {

hps::StatusOr<std::array<hps::Axis, hps::kAxisCount>> parse_order(const char* order) {
  if (order == nullptr) return hps::kDefaultAxisOrder;
  std::array<hps::Axis, hps::kAxisCount> axes{};
  std::string_view rest(order);
  size_t n = 0;
  while (true) {
    const size_t comma = rest.find(',');
    std::string_view name = rest.substr(0, comma);
    if (n == axes.size()) {
      return hps::invalid_argument("axis order '" + std::string(order) +
                                   "' names more than 5 axes");
    }
    HPS_ASSIGN_OR_RETURN(axes[n], hps::axis_from_name(name));
    ++n;
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  if (n != axes.size()) {
    return hps::invalid_argument("axis order '" + std::string(order) +
                                 "' must name each of dp, pp, sharding, sep, mp once");
  }
  return axes;
}

hps::StatusOr<hps::Axis> to_axis(const hps_group_t& axis) {
  const int32_t raw = raw_enum(axis);
  if (raw < 0 || raw >= hps::kAxisCount) {
    return hps::invalid_argument("group " + std::to_string(raw) + " is not an axis (0=dp .. 4=mp)");
  }
  return static_cast<hps::Axis>(raw);
}

}  // namespace

extern "C" {

HPS_API hps_status_t hps_topology_create(int32_t dp, int32_t pp, int32_t sharding, int32_t sep,
                                         int32_t mp, const char* order, int32_t world_size,
                                         hps_topology_t** out_topology) {
  HPS_CHECK_ARG(out_topology);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(auto axes, parse_order(order));
    HPS_ASSIGN_OR_RETURN(hps::Topology t,
                         hps::Topology::create({dp, pp, sharding, sep, mp}, world_size, axes));
    *out_topology = new hps_topology{std::move(t)};
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_topology_destroy(hps_topology_t* topology) {
  if (hps::capi::left_to_parent(topology)) return HPS_STATUS_OK;
  return guard(__func__, [&]() -> hps::Status {
    delete topology;
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_topology_degree(const hps_topology_t* topology, hps_group_t axis,
                                         int32_t* out_degree) {
  HPS_CHECK_ARG(topology);
  HPS_CHECK_ARG(out_degree);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(hps::Axis a, to_axis(axis));
    *out_degree = topology->impl.degree(a);
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_topology_coordinate(const hps_topology_t* topology, int32_t rank,
                                             hps_group_t axis, int32_t* out_coordinate) {
  HPS_CHECK_ARG(topology);
  HPS_CHECK_ARG(out_coordinate);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(hps::Axis a, to_axis(axis));
    HPS_ASSIGN_OR_RETURN(hps::AxisArray c, topology->impl.coordinates(rank));
    *out_coordinate = c[static_cast<size_t>(a)];
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_topology_rank_of(const hps_topology_t* topology, int32_t dp, int32_t pp,
                                          int32_t sharding, int32_t sep, int32_t mp,
                                          int32_t* out_rank) {
  HPS_CHECK_ARG(topology);
  HPS_CHECK_ARG(out_rank);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(*out_rank, topology->impl.rank_of({dp, pp, sharding, sep, mp}));
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_topology_group_ranks(const hps_topology_t* topology, hps_group_t group,
                                              int32_t rank, int32_t* out_ranks, size_t capacity,
                                              size_t* out_count) {
  HPS_CHECK_ARG(topology);
  HPS_CHECK_ARG(out_count);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(hps::GroupKind kind, hps::group_kind_from_int(raw_enum(group)));
    // The group's size from the degrees, so a buffer too small (or a NULL one, to ask the
    // size) is answered without listing a group of up to 2^30 ranks.
    const hps::Topology& t = topology->impl;
    if (out_ranks == nullptr || capacity < static_cast<size_t>(t.world_size())) {
      HPS_RETURN_IF_ERROR(t.coordinates(rank).status());
      const int64_t size =
          kind == hps::GroupKind::kCheck           ? t.world_size() / t.degree(hps::Axis::kDp)
          : kind == hps::GroupKind::kShardingCheck ? t.world_size() / t.degree(hps::Axis::kSharding)
                                                   : t.degree(static_cast<hps::Axis>(kind));
      if (out_ranks == nullptr || capacity < static_cast<uint64_t>(size)) {
        *out_count = static_cast<size_t>(size);
        return hps::out_of_range("the group has " + std::to_string(size) +
                                 " ranks; the buffer holds " +
                                 std::to_string(out_ranks ? capacity : 0));
      }
    }
    hps::StatusOr<std::vector<int32_t>> ranks =
        kind == hps::GroupKind::kCheck ? topology->impl.check_group(rank)
        : kind == hps::GroupKind::kShardingCheck
            ? topology->impl.sharding_check_group(rank)
            : topology->impl.axis_group(static_cast<hps::Axis>(kind), rank);
    if (!ranks.ok()) return ranks.status();
    *out_count = ranks->size();
    if (out_ranks == nullptr || capacity < ranks->size()) {
      return hps::out_of_range("the group has " + std::to_string(ranks->size()) +
                               " ranks; the buffer holds " +
                               std::to_string(out_ranks ? capacity : 0));
    }
    std::memcpy(out_ranks, ranks->data(), ranks->size() * sizeof(int32_t));
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_topology_pipeline_neighbors(const hps_topology_t* topology, int32_t rank,
                                                     int32_t* out_prev, int32_t* out_next) {
  HPS_CHECK_ARG(topology);
  HPS_CHECK_ARG(out_prev);
  HPS_CHECK_ARG(out_next);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(int32_t prev, topology->impl.pipeline_prev(rank));
    HPS_ASSIGN_OR_RETURN(int32_t next, topology->impl.pipeline_next(rank));
    *out_prev = prev;
    *out_next = next;
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_hybrid_group_create(hps_comm_t* world, const hps_topology_t* topology,
                                             hps_hybrid_group_t** out_group) {
  HPS_CHECK_ARG(world);
  HPS_CHECK_ARG(topology);
  HPS_CHECK_ARG(out_group);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(auto group, hps::HybridGroup::create(world->impl, topology->impl));
    *out_group = new hps_hybrid_group{std::move(group)};
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_hybrid_group_destroy(hps_hybrid_group_t* group) {
  if (hps::capi::left_to_parent(group)) return HPS_STATUS_OK;
  return guard(__func__, [&]() -> hps::Status {
    delete group;
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_hybrid_group_comm(hps_hybrid_group_t* group, hps_group_t kind,
                                           hps_comm_t** out_comm) {
  HPS_CHECK_ARG(group);
  HPS_CHECK_ARG(out_comm);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(hps::GroupKind k, hps::group_kind_from_int(raw_enum(kind)));
    *out_comm = new hps_comm{group->impl->group(k)};
    return hps::Status::Ok();
  });
}

}  // extern "C"
