#include "core/comm/work.h"

#include "core/device/host_sync.h"

namespace hps {

StatusOr<bool> Work::test() {
  HPS_ASSIGN_OR_RETURN(bool finished, done_->query());
  if (!finished) return false;
  HPS_RETURN_IF_ERROR(status());
  return true;
}

Status Work::wait() {
  count_host_sync(HostSyncKind::kWorkWait);
  // The event's own synchronize would count a second time; wait on it uncounted.
  HPS_RETURN_IF_ERROR(done_->synchronize_uncounted());
  return status();
}

StatusOr<bool> Work::wait_for(std::chrono::nanoseconds timeout) {
  HPS_ASSIGN_OR_RETURN(const bool finished, done_->wait_for(timeout));
  if (!finished) return false;
  count_host_sync(HostSyncKind::kWorkWait);
  HPS_RETURN_IF_ERROR(status());
  return true;
}

Status Work::wait_on(Stream& stream) {
  return stream.wait_for_outcome(*done_, [state = state_] {
    std::lock_guard lock(state->mutex);
    return state->status;
  });
}

void Work::set_status(Status status) {
  std::lock_guard lock(state_->mutex);
  state_->status = std::move(status);
}

Status Work::status() const {
  std::lock_guard lock(state_->mutex);
  return state_->status;
}

}  // namespace hps
