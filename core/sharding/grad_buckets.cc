#include "core/sharding/grad_buckets.h"

#include <algorithm>
#include <string>

namespace hps {

void GradBuckets::init(const LayoutPlan& plan, int32_t accumulation_steps) {
  const size_t n = plan.buffers().size();
  accumulation_steps_ = accumulation_steps;
  micro_batch_ = 0;
  checked_in_.assign(n, {});
  pending_.assign(n, 0);
  complete_.assign(n, 0);
  position_.assign(plan.params().size(), 0);
  has_trainable_ = false;
  order_.clear();
  next_ = 0;
  for (size_t b = 0; b < n; ++b) {
    const FlatBuffer& buf = plan.buffers()[b];
    has_trainable_ = has_trainable_ || buf.trainable;
    if (buf.trainable) order_.push_back(b);
    checked_in_[b].assign(buf.params.size(), 0);
    pending_[b] = buf.params.size();
    for (size_t k = 0; k < buf.params.size(); ++k) position_[buf.params[k]] = k;
  }
  // Latest-registered parameter first: a backward pass visits the model in reverse.
  auto last = [&](size_t b) {
    const auto& p = plan.buffers()[b].params;
    return *std::max_element(p.begin(), p.end());
  };
  std::sort(order_.begin(), order_.end(), [&](size_t a, size_t b) { return last(a) > last(b); });
}

StatusOr<bool> GradBuckets::check_in(const LayoutPlan& plan, size_t index) {
  const size_t b = plan.placement(index).buffer;
  if (micro_batch_ == accumulation_steps_) {
    return failed_precondition("engine: the gradient of '" + plan.params()[index].name +
                               "' checked in after the last micro-batch of the step (" +
                               std::to_string(accumulation_steps_) + " per step): call step()");
  }
  auto& flag = checked_in_[b][position_[index]];
  if (flag || complete_[b]) {
    return failed_precondition("engine: the gradient of '" + plan.params()[index].name +
                               "' checked in twice in one micro-batch" + still_due(plan));
  }
  flag = 1;
  return --pending_[b] == 0;
}

std::string GradBuckets::still_due(const LayoutPlan& plan) const {
  // The micro-batch ends when every trainable gradient has checked in once: those that have
  // not are what a second check-in usually means was missed.
  constexpr size_t kShown = 4;
  std::string names;
  size_t count = 0;
  for (size_t b : order_) {
    if (complete_[b]) continue;
    for (size_t k = 0; k < checked_in_[b].size(); ++k) {
      if (checked_in_[b][k]) continue;
      if (count++ < kShown)
        names +=
            (names.empty() ? "'" : ", '") + plan.params()[plan.buffers()[b].params[k]].name + "'";
    }
  }
  if (count == 0) return "";
  if (count > kShown) names += " and " + std::to_string(count - kShown) + " more";
  return " (micro-batch " + std::to_string(micro_batch_ + 1) + " of " +
         std::to_string(accumulation_steps_) + " has not had " + names + " checked in)";
}

void GradBuckets::started() {
  const size_t b = order_[next_];
  complete_[b] = 1;
  std::fill(checked_in_[b].begin(), checked_in_[b].end(), 0);
  pending_[b] = checked_in_[b].size();
  if (++next_ < order_.size()) return;
  next_ = 0;
  std::fill(complete_.begin(), complete_.end(), 0);
  ++micro_batch_;  // after the last micro-batch: == accumulation_steps_, the step is due
}

bool GradBuckets::between_steps() const {
  if (micro_batch_ != 0) return false;
  for (size_t b = 0; b < checked_in_.size(); ++b) {
    if (complete_[b] || pending_[b] != checked_in_[b].size()) return false;
  }
  return true;
}

Status GradBuckets::check_step_due() const {
  // Without a trainable parameter no gradient can check in: every step() is due.
  if (micro_batch_ == accumulation_steps_ || !has_trainable_) return Status::Ok();
  return failed_precondition(
      "engine: step() before backward finished: not every gradient checked in on the last "
      "micro-batch (" +
      std::to_string(accumulation_steps_) + " per step)");
}

}  // namespace hps
