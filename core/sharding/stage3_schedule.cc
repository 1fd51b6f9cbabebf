#include "core/sharding/stage3_schedule.h"

#include <algorithm>
#include <string>

namespace hps {

void Stage3Schedule::init(const LayoutPlan& plan, int32_t prefetch_window) {
  window_ = prefetch_window;
  units_.clear();
  for (size_t b = 0; b < plan.buffers().size(); ++b) units_[plan.buffers()[b].unit].push_back(b);
}

StatusOr<const std::vector<size_t>*> Stage3Schedule::unit_buffers(int32_t unit) const {
  auto it = units_.find(unit);
  if (it == units_.end()) {
    return not_found("engine: no parameters belong to unit " + std::to_string(unit));
  }
  return &it->second;
}

std::vector<size_t> Stage3Schedule::on_gather(int32_t unit,
                                              const std::function<bool(size_t)>& live) {
  if (recording_) {
    order_.push_back(unit);
    return {};
  }
  const bool in_order = cursor_ < order_.size() && order_[cursor_] == unit;
  const size_t position = in_order ? cursor_ : order_.size();
  ++cursor_;
  return ahead_from(position + 1, live);
}

std::vector<size_t> Stage3Schedule::on_step(const std::function<bool(size_t)>& live) const {
  if (recording_) return {};
  return ahead_from(0, live);
}

std::vector<size_t> Stage3Schedule::ahead_from(size_t first,
                                               const std::function<bool(size_t)>& live) const {
  // Units ahead in the recorded order, while fewer than `window` units hold live buffers
  // (counting what this call schedules).
  std::vector<size_t> ahead;
  auto is_live = [&](size_t b) {
    return live(b) || std::find(ahead.begin(), ahead.end(), b) != ahead.end();
  };
  auto live_units = [&] {
    int32_t count = 0;
    for (const auto& [id, buffers] : units_) {
      count += std::any_of(buffers.begin(), buffers.end(), is_live) ? 1 : 0;
    }
    return count;
  };
  for (size_t k = first; k < order_.size(); ++k) {
    if (live_units() >= window_) break;
    for (size_t b : units_.at(order_[k])) {
      if (!is_live(b)) ahead.push_back(b);
    }
  }
  return ahead;
}

int32_t Stage3Schedule::live_units(const std::function<bool(size_t)>& live) const {
  int32_t count = 0;
  for (const auto& [id, buffers] : units_) {
    count += std::any_of(buffers.begin(), buffers.end(), live) ? 1 : 0;
  }
  return count;
}

int32_t Stage3Schedule::unit_to_drop(int32_t except, const std::function<bool(size_t)>& live,
                                     const std::function<bool(size_t)>& busy) const {
  int32_t chosen = -1;
  size_t chosen_distance = 0;
  for (const auto& [id, buffers] : units_) {
    if (id == except || !std::any_of(buffers.begin(), buffers.end(), live) ||
        std::any_of(buffers.begin(), buffers.end(), busy)) {
      continue;
    }
    // How far ahead of the cursor the order gathers it next (not again this step: farthest).
    size_t distance = order_.size() + 1;
    for (size_t k = cursor_; k < order_.size(); ++k) {
      if (order_[k] == id) {
        distance = k - cursor_;
        break;
      }
    }
    if (chosen < 0 || distance > chosen_distance) {
      chosen = id;
      chosen_distance = distance;
    }
  }
  return chosen;
}

bool Stage3Schedule::gathered_next(int32_t unit) const {
  return !recording_ && cursor_ < order_.size() && order_[cursor_] == unit;
}

void Stage3Schedule::stepped() {
  recording_ = false;
  cursor_ = 0;
}

}  // namespace hps
