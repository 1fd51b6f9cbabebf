// Task flows (DESIGN.md, "Task flows"): an ordered list of asynchronous tasks, each with
// its done-event, the buffers it keeps alive and an optional callback. A stream can wait
// on every pending task without the host blocking; poll() runs the callbacks of tasks
// that completed, in order, and lets their buffers go; drain() is the only call that
// blocks the host, and it is counted.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <vector>

#include "core/comm/work.h"
#include "core/device/stream.h"

namespace hps {

struct Task {
  // The operation whose completion the task tracks; its status goes to the callback.
  std::shared_ptr<Work> work;
  // Anything that must outlive the operation (buffers it reads or writes).
  std::vector<std::shared_ptr<void>> keep_alive;
  // Runs on the thread that calls poll() or drain(), after the operation completed.
  std::function<void(const Status&)> callback;
};

class TaskFlow {
 public:
  Status add(Task task);
  // Work enqueued on `stream` after this call waits for every pending task, stream-side.
  Status wait(Stream& stream);
  // Completes the tasks at the front whose operation finished: runs their callbacks in
  // order and releases their buffers. Stops at the first unfinished task, so callbacks
  // always run in the order the tasks were added. Returns how many completed. No blocking.
  StatusOr<size_t> poll();
  // Blocks until every task finished, completing them in order. Counted as a host sync.
  // Returns the first failure among them (all callbacks still run).
  Status drain();
  size_t pending() const { return tasks_.size(); }

 private:
  Status complete_front();
  std::deque<Task> tasks_;
};

}  // namespace hps
