// Work: the handle of one asynchronous communication operation. Its completion is an
// Event on the communicator's stream; a caller's stream can wait on it without the host
// blocking, and the host can poll it. Only wait() blocks the host, and it is counted.
#pragma once

#include <memory>
#include <mutex>
#include <string>

#include "core/common/status.h"
#include "core/device/stream.h"

namespace hps {

class Work {
 public:
  Work(std::string description, std::unique_ptr<Event> done)
      : description_(std::move(description)),
        done_(std::move(done)),
        state_(std::make_shared<State>()) {}

  const std::string& description() const { return description_; }
  Event& done_event() { return *done_; }

  // Whether the operation has finished; its error once it has finished with one.
  StatusOr<bool> test();
  // Blocks the host until the operation has finished, and returns how it ended. Counted.
  Status wait();
  // Blocks the host until the operation has finished or `timeout` has passed, whichever
  // comes first: whether it finished; its error once it has finished with one. Counted as
  // one host sync when it returns finished, so that a loop of timed waits counts as wait().
  StatusOr<bool> wait_for(std::chrono::nanoseconds timeout);
  // Work enqueued on `stream` after this call starts only after the operation finished;
  // when it failed, the failure becomes the stream's (Stream::wait_for_outcome: a CPU
  // stream's next synchronize() reports it, the calling thread's stream returns it here).
  Status wait_on(Stream& stream);

  // Called by the backend (on the communication stream) before the done event completes.
  void set_status(Status status);
  Status status() const;

 private:
  std::string description_;
  std::unique_ptr<Event> done_;
  // Shared with the outcome checks streams run after waiting (they may outlive the Work).
  struct State {
    std::mutex mutex;
    Status status;
  };
  std::shared_ptr<State> state_;
};

}  // namespace hps
