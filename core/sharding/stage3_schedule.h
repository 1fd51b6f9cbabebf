// What stage 3 decides on the host, whatever the device holds the buffers: which flat
// buffers each unit owns, the gather order recorded on the first step and the cursor into
// it (for prefetch and for keeping a unit live across a release), which gradients have
// checked in this micro-batch, and when the step is due. Stage3Engine (CPU) and
// CudaStage3Engine (CUDA) each keep one; the device work (allocation, all-gathers,
// reductions, the optimizer) stays theirs.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <vector>

#include "core/common/status.h"
#include "core/storage/layout_plan.h"

namespace hps {

class Stage3Schedule {
 public:
  // After plan.seal().
  void init(const LayoutPlan& plan, int32_t accumulation_steps, int32_t prefetch_window);

  // The flat buffers of `unit`; NOT_FOUND naming it when no parameter belongs to it.
  StatusOr<const std::vector<size_t>*> unit_buffers(int32_t unit) const;

  // gather(unit) was called: the first step records it; later steps move the cursor on and
  // return the buffers to start gathering ahead (the next units in the recorded order while
  // fewer than the window hold live buffers; `live(b)` says whether buffer b is).
  std::vector<size_t> on_gather(int32_t unit, const std::function<bool(size_t)>& live);
  // release(unit): true when the recorded order gathers this unit next (keep it live).
  bool gathered_next(int32_t unit) const;

  // grad_ready(index) for a parameter of a trainable buffer: FAILED_PRECONDITION when it
  // checked in already this micro-batch; true when its buffer is now complete.
  StatusOr<bool> check_in(const LayoutPlan& plan, size_t index);
  // Buffer b's reduction started: its check-ins reset, and when every trainable buffer is
  // reduced the micro-batch ends (the step is due after the last one).
  void buffer_reduced(const LayoutPlan& plan, size_t b);
  bool reduced_this_micro_batch(size_t b) const { return reduced_[b] != 0; }
  bool first_micro_batch() const { return micro_batch_ == 0; }
  bool last_micro_batch() const { return micro_batch_ == accumulation_steps_ - 1; }
  // FAILED_PRECONDITION unless every gradient checked in on the last micro-batch.
  Status check_step_due() const;
  // step() enqueued the update: a new step starts; the order is recorded from now on.
  void stepped();

  int32_t prefetch_window() const { return window_; }

 private:
  std::map<int32_t, std::vector<size_t>> units_;
  std::vector<std::vector<uint8_t>> checked_in_;  // per buffer, per parameter of it
  std::vector<size_t> pending_;                   // per buffer: parameters not checked in
  std::vector<size_t> position_in_buffer_;        // per parameter
  std::vector<uint8_t> reduced_;                  // per buffer, this micro-batch
  std::vector<int32_t> order_;
  bool recording_ = true;
  size_t cursor_ = 0;
  int32_t micro_batch_ = 0;
  int32_t accumulation_steps_ = 1;
  int32_t window_ = 2;
};

}  // namespace hps
