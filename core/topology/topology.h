// The hybrid-parallel topology: axes dp, pp, sharding, sep, mp; rank ↔ coordinates;
// the rank lists of every group. Pure arithmetic: communicators are built from these
// lists by the communication layer, in the order all_groups() gives on every rank.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/common/status.h"

namespace hps {

// Numeric values are the C API's axis values.
enum class Axis : int32_t { kDp = 0, kPp = 1, kSharding = 2, kSep = 3, kMp = 4 };
inline constexpr int kAxisCount = 5;
inline constexpr std::array<Axis, kAxisCount> kDefaultAxisOrder = {
    Axis::kDp, Axis::kPp, Axis::kSharding, Axis::kSep, Axis::kMp};

std::string_view axis_name(Axis axis);  // "dp", "pp", "sharding", "sep", "mp"
StatusOr<Axis> axis_from_name(std::string_view name);

// Per-axis values, indexed by Axis.
using AxisArray = std::array<int32_t, kAxisCount>;

class Topology {
 public:
  // `degrees` by axis (each ≥ 1); `order` lists each axis exactly once, slowest first.
  // The degrees must multiply to `world_size`.
  static StatusOr<Topology> create(const AxisArray& degrees, int32_t world_size,
                                   const std::array<Axis, kAxisCount>& order = kDefaultAxisOrder);

  int32_t world_size() const { return world_size_; }
  int32_t degree(Axis axis) const { return degrees_[index(axis)]; }
  const std::array<Axis, kAxisCount>& order() const { return order_; }

  // Row-major over `order`, last axis fastest.
  StatusOr<AxisArray> coordinates(int32_t rank) const;
  StatusOr<int32_t> rank_of(const AxisArray& coordinates) const;

  // The ranks that share every coordinate but `axis`'s with `rank`, ordered along `axis`.
  StatusOr<std::vector<int32_t>> axis_group(Axis axis, int32_t rank) const;
  // Every group along `axis`, ordered by their first rank: the order in which all ranks
  // create them collectively.
  std::vector<std::vector<int32_t>> all_axis_groups(Axis axis) const;
  // The model replica of `rank`: every rank with its dp coordinate.
  StatusOr<std::vector<int32_t>> check_group(int32_t rank) const;
  // Every rank with `rank`'s sharding coordinate.
  StatusOr<std::vector<int32_t>> sharding_check_group(int32_t rank) const;
  // Pipeline neighbours (wrapping around the pp group).
  StatusOr<int32_t> pipeline_prev(int32_t rank) const;
  StatusOr<int32_t> pipeline_next(int32_t rank) const;

  std::string to_string() const;  // "dp2 x pp1 x sharding2 x sep1 x mp2 (world 8)"

 private:
  static size_t index(Axis axis) { return static_cast<size_t>(axis); }
  Status check_rank(int32_t rank) const;
  // Ranks whose coordinates on `fixed_axes` equal `rank`'s, ascending.
  std::vector<int32_t> ranks_matching(int32_t rank,
                                      const std::array<bool, kAxisCount>& fixed) const;

  AxisArray degrees_{};
  std::array<Axis, kAxisCount> order_ = kDefaultAxisOrder;
  int32_t world_size_ = 1;
};

}  // namespace hps
