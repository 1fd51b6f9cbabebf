#include "core/sharding/stage3_schedule.h"

#include <algorithm>
#include <string>

namespace hps {

void Stage3Schedule::init(const LayoutPlan& plan, int32_t accumulation_steps,
                          int32_t prefetch_window) {
  const size_t n = plan.buffers().size();
  accumulation_steps_ = accumulation_steps;
  window_ = prefetch_window;
  units_.clear();
  checked_in_.assign(n, {});
  pending_.assign(n, 0);
  reduced_.assign(n, 0);
  position_in_buffer_.assign(plan.params().size(), 0);
  for (size_t b = 0; b < n; ++b) {
    const FlatBuffer& buf = plan.buffers()[b];
    checked_in_[b].assign(buf.params.size(), 0);
    pending_[b] = buf.trainable ? buf.params.size() : 0;
    for (size_t k = 0; k < buf.params.size(); ++k) position_in_buffer_[buf.params[k]] = k;
    units_[buf.unit].push_back(b);
  }
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
  for (size_t k = position + 1; k < order_.size(); ++k) {
    if (live_units() >= window_) break;
    for (size_t b : units_.at(order_[k])) {
      if (!is_live(b)) ahead.push_back(b);
    }
  }
  return ahead;
}

bool Stage3Schedule::gathered_next(int32_t unit) const {
  return !recording_ && cursor_ < order_.size() && order_[cursor_] == unit;
}

StatusOr<bool> Stage3Schedule::check_in(const LayoutPlan& plan, size_t index) {
  const size_t b = plan.placement(index).buffer;
  auto& flag = checked_in_[b][position_in_buffer_[index]];
  if (flag || reduced_[b]) {
    return failed_precondition("engine: the gradient of '" + plan.params()[index].name +
                               "' checked in twice in one micro-batch");
  }
  flag = 1;
  return --pending_[b] == 0;
}

void Stage3Schedule::buffer_reduced(const LayoutPlan& plan, size_t b) {
  reduced_[b] = 1;
  std::fill(checked_in_[b].begin(), checked_in_[b].end(), 0);
  pending_[b] = checked_in_[b].size();
  for (size_t k = 0; k < reduced_.size(); ++k) {
    if (plan.buffers()[k].trainable && !reduced_[k]) return;
  }
  std::fill(reduced_.begin(), reduced_.end(), 0);
  // The last micro-batch leaves the step due (micro_batch_ == accumulation_steps_).
  ++micro_batch_;
}

Status Stage3Schedule::check_step_due() const {
  if (micro_batch_ == accumulation_steps_) return Status::Ok();
  return failed_precondition(
      "engine: step() before backward finished: not every gradient checked in on the last "
      "micro-batch (" +
      std::to_string(accumulation_steps_) + " per step)");
}

void Stage3Schedule::stepped() {
  micro_batch_ = 0;
  recording_ = false;
  cursor_ = 0;
}

}  // namespace hps
