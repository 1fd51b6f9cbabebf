// What stage 3 decides about units on the host: which flat buffers each unit owns, the
// gather order recorded on the first step and the cursor into it (for prefetch and for
// keeping a unit live across a release).
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
  void init(const LayoutPlan& plan, int32_t prefetch_window);

  // The flat buffers of `unit`; NOT_FOUND naming it when no parameter belongs to it.
  StatusOr<const std::vector<size_t>*> unit_buffers(int32_t unit) const;

  // gather(unit) was called: the first step records it; later steps move the cursor on and
  // return the buffers to start gathering ahead (the next units in the recorded order while
  // fewer than the window hold live buffers; `live(b)` says whether buffer b is).
  std::vector<size_t> on_gather(int32_t unit, const std::function<bool(size_t)>& live);
  // release(unit): true when the recorded order gathers this unit next (keep it live).
  bool gathered_next(int32_t unit) const;

  // step() enqueued the update: a new step starts; the order is known from now on.
  void stepped();
  // After stepped(): the buffers of the units the next step gathers first, in the recorded
  // order while fewer than the window hold live buffers, to start gathering as soon as
  // their own updates are done. Empty while the order is not known.
  std::vector<size_t> on_step(const std::function<bool(size_t)>& live) const;

  int32_t prefetch_window() const { return window_; }

  // The units with a live buffer (`live(b)`).
  int32_t live_units(const std::function<bool(size_t)>& live) const;
  // A live unit other than `except` none of whose buffers is in use (`busy(b)`), the one the
  // recorded order reaches last from the cursor (first: one it does not reach again this
  // step); -1 when there is none.
  int32_t unit_to_drop(int32_t except, const std::function<bool(size_t)>& live,
                       const std::function<bool(size_t)>& busy) const;

 private:
  // The buffers of the units at order_[first...] not live yet, while fewer than the window
  // hold live buffers (counting these).
  std::vector<size_t> ahead_from(size_t first, const std::function<bool(size_t)>& live) const;

  std::map<int32_t, std::vector<size_t>> units_;
  std::vector<int32_t> order_;
  bool recording_ = true;
  size_t cursor_ = 0;
  int32_t window_ = 2;
};

}  // namespace hps
