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
  for (size_t b = 0; b < n; ++b) {
    const FlatBuffer& buf = plan.buffers()[b];
    has_trainable_ = has_trainable_ || buf.trainable;
    checked_in_[b].assign(buf.params.size(), 0);
    pending_[b] = buf.params.size();
    for (size_t k = 0; k < buf.params.size(); ++k) position_[buf.params[k]] = k;
  }
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
                               "' checked in twice in one micro-batch");
  }
  flag = 1;
  return --pending_[b] == 0;
}

void GradBuckets::completed(const LayoutPlan& plan, size_t b) {
  complete_[b] = 1;
  std::fill(checked_in_[b].begin(), checked_in_[b].end(), 0);
  pending_[b] = checked_in_[b].size();
  for (size_t k = 0; k < complete_.size(); ++k) {
    if (plan.buffers()[k].trainable && !complete_[k]) return;
  }
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
