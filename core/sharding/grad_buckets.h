// Which gradients have checked in (grad_ready) this micro-batch, per flat buffer (bucket),
// and where the step is in its micro-batches. A bucket is complete when every parameter in
// it checked in once. Reductions start in one order on every rank (the ranks' collectives
// pair by their order): trainable buckets by their last-registered parameter, latest
// first, the order a backward pass completes them; a bucket complete before its turn waits
// for the buckets ahead of it. When every trainable bucket is reduced the micro-batch
// ends, and after the last one the step is due. Both stages keep one.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/common/status.h"
#include "core/storage/layout_plan.h"

namespace hps {

class GradBuckets {
 public:
  // After plan.seal().
  void init(const LayoutPlan& plan, int32_t accumulation_steps);

  // grad_ready(index) for a parameter of a trainable bucket: FAILED_PRECONDITION naming it
  // when it checked in already this micro-batch (or the step is due); true when its
  // bucket is now complete (ready for its reduction).
  StatusOr<bool> check_in(const LayoutPlan& plan, size_t index);
  // The bucket whose reduction starts next when it is complete, and whether it is.
  size_t next() const { return order_[next_]; }
  bool next_ready() const { return next_ < order_.size() && pending_[order_[next_]] == 0; }
  // next()'s reduction started: the turn passes to the bucket after it.
  void started();
  // Whether every gradient of bucket b checked in this micro-batch.
  bool checked_in(size_t b) const { return pending_[b] == 0 || complete_[b] != 0; }
  // Whether bucket b's reduction started this micro-batch.
  bool complete(size_t b) const { return complete_[b] != 0; }
  bool first_micro_batch() const { return micro_batch_ == 0; }
  bool last_micro_batch() const { return micro_batch_ == accumulation_steps_ - 1; }
  // FAILED_PRECONDITION unless every gradient checked in on the last micro-batch (a
  // model without trainable parameters is always due).
  Status check_step_due() const;
  // Every gradient checked in on the last micro-batch: only step() comes next.
  bool step_due() const { return has_trainable_ && micro_batch_ == accumulation_steps_; }
  // No gradient checked in since the last step() (or ever).
  bool between_steps() const;
  // step() enqueued the update: the next step's first micro-batch starts.
  void stepped() { micro_batch_ = 0; }

 private:
  // " (micro-batch m of k has not had 'a', 'b' checked in)", or "" when every gradient has.
  std::string still_due(const LayoutPlan& plan) const;

  std::vector<std::vector<uint8_t>> checked_in_;  // per bucket, per parameter of it
  std::vector<size_t> pending_;                   // per bucket: parameters not checked in
  std::vector<size_t> position_;                  // per parameter, within its bucket
  std::vector<uint8_t> complete_;                 // per bucket, this micro-batch
  std::vector<size_t> order_;                     // trainable buckets, reductions' order
  size_t next_ = 0;                               // in order_: the next reduction
  int32_t micro_batch_ = 0;
  int32_t accumulation_steps_ = 1;
  bool has_trainable_ = false;
};

}  // namespace hps
