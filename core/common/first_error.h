// FirstError: the first failure of a sequence of steps that must all run.
#pragma once

#include <utility>

#include "core/common/status.h"

namespace hps {

// The first failure of a sequence of steps that must all run (waits before memory is
// freed): keep() every step's status, then return status().
class FirstError {
 public:
  void keep(Status s) {
    if (first_.ok() && !s.ok()) first_ = std::move(s);
  }
  const Status& status() const { return first_; }

 private:
  Status first_;
};

}  // namespace hps
