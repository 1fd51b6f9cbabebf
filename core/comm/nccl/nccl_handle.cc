#include "core/comm/nccl/nccl_handle.h"

#include <thread>

namespace hps::nccl_backend {
namespace {

// Polls spin (yield) this many times before sleeping: an enqueue that returned
// ncclInProgress usually settles within microseconds, a connection set-up takes longer.
constexpr int kSpinningPolls = 64;
constexpr auto kPollSleep = std::chrono::microseconds(50);

}  // namespace

NcclHandle::NcclHandle(const NcclApi& api, std::string group,
                       std::function<void(const Status&)> before_abort)
    : api_(api), group_(std::move(group)), before_abort_(std::move(before_abort)) {}

NcclHandle::~NcclHandle() {
  std::lock_guard lock(mutex_);
  if (comm_ != nullptr) {
    abort_locked(
        hps::aborted("the communicator of group '" + group_ + "' was destroyed while open"));
  }
}

Status NcclHandle::nccl_error(ncclResult_t result, const std::string& what) const {
  return backend_error(what + " on group '" + group_ + "': NCCL error " + std::to_string(result) +
                       ": " + api_.GetErrorString(result));
}

Status NcclHandle::aborted_status(const std::string& what) const {
  if (failure_.ok()) {
    return hps::aborted(what + " on group '" + group_ + "': the communicator is closed");
  }
  return hps::aborted(what + " on group '" + group_ +
                      "': the communicator was aborted after: " + failure_.message());
}

void NcclHandle::abort_locked(const Status& failure) {
  if (aborted_) return;
  // The failure first, then the owner's pending operations, then NCCL: whoever wakes when
  // the abort ends an operation already finds it failed.
  aborted_ = true;
  failure_ = failure;
  if (before_abort_) before_abort_(failure);
  if (comm_ != nullptr) api_.CommAbort(comm_);
  comm_ = nullptr;
}

void NcclHandle::abort(const Status& failure) {
  std::lock_guard lock(mutex_);
  abort_locked(failure);
}

bool NcclHandle::open() const {
  std::lock_guard lock(mutex_);
  return comm_ != nullptr;
}

bool NcclHandle::aborted() const {
  std::lock_guard lock(mutex_);
  return aborted_;
}

Status NcclHandle::failure() const {
  std::lock_guard lock(mutex_);
  return failure_;
}

Status NcclHandle::settle(std::unique_lock<std::mutex>& lock, const std::string& what,
                          Clock::time_point deadline, NcclHandle* other) {
  for (int polls = 0;; ++polls) {
    if (aborted_ || comm_ == nullptr) return aborted_status(what);
    ncclResult_t state = ncclSuccess, other_state = ncclSuccess;
    ncclResult_t result = api_.CommGetAsyncError(comm_, &state);
    if (result == ncclSuccess && other != nullptr && other->comm_ != nullptr) {
      result = api_.CommGetAsyncError(other->comm_, &other_state);
    }
    if (result != ncclSuccess) return nccl_error(result, what + " (ncclCommGetAsyncError)");
    if (state != ncclInProgress && other_state != ncclInProgress) {
      if (state != ncclSuccess) return nccl_error(state, what);
      if (other_state != ncclSuccess) return nccl_error(other_state, what);
      return Status::Ok();
    }
    if (Clock::now() >= deadline) {
      return timeout_error(what + " on group '" + group_ +
                           "' was still in progress in NCCL at its deadline");
    }
    // Let the watchdog and abort() in between polls.
    lock.unlock();
    if (polls < kSpinningPolls) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(kPollSleep);
    }
    lock.lock();
  }
}

Status NcclHandle::init(const std::string& what,
                        const std::function<ncclResult_t(ncclComm_t*)>& create,
                        Clock::time_point deadline) {
  std::unique_lock lock(mutex_);
  if (comm_ != nullptr || aborted_) {
    return failed_precondition(what + " on group '" + group_ + "': the handle is in use");
  }
  const ncclResult_t result = create(&comm_);
  Status status = Status::Ok();
  if (result != ncclSuccess && result != ncclInProgress) {
    status = nccl_error(result, what);
  } else if (comm_ == nullptr) {
    status = internal_error(what + " on group '" + group_ + "': NCCL returned no communicator");
  } else {
    status = settle(lock, what, deadline);
  }
  // A communicator that failed to initialise is aborted, never finalized: finalisation
  // would wait for peers that may never come.
  if (!status.ok()) abort_locked(status);
  return status;
}

Status NcclHandle::split(const std::string& what, int color, int key, ncclConfig_t* config,
                         NcclHandle& child, Clock::time_point deadline) {
  std::unique_lock lock(mutex_);
  if (aborted_ || comm_ == nullptr) return aborted_status(what);
  ncclComm_t created = nullptr;
  const ncclResult_t result = api_.CommSplit(comm_, color, key, &created, config);
  {
    std::lock_guard child_lock(child.mutex_);
    child.comm_ = created;
  }
  Status status = Status::Ok();
  if (result != ncclSuccess && result != ncclInProgress) {
    status = nccl_error(result, what);
  } else {
    // The split is collective over this communicator and initialises the child: both settle.
    status = settle(lock, what, deadline, &child);
  }
  if (!status.ok()) {
    child.abort(status);
    abort_locked(status);
  }
  return status;
}

Status NcclHandle::run(const std::string& what, const std::function<ncclResult_t(ncclComm_t)>& call,
                       Clock::time_point deadline) {
  std::unique_lock lock(mutex_);
  if (aborted_ || comm_ == nullptr) return aborted_status(what);
  const ncclResult_t result = call(comm_);
  if (result == ncclSuccess) return Status::Ok();
  Status status =
      result == ncclInProgress ? settle(lock, what, deadline) : nccl_error(result, what);
  // A collective that failed on this rank would leave its peers waiting: end it here, so
  // they fail too (through their own timeouts) instead of hanging.
  if (!status.ok()) abort_locked(status);
  return status;
}

ncclResult_t NcclHandle::async_error() {
  std::lock_guard lock(mutex_);
  if (comm_ == nullptr) return ncclSuccess;
  ncclResult_t state = ncclSuccess;
  const ncclResult_t result = api_.CommGetAsyncError(comm_, &state);
  if (result != ncclSuccess) return result;
  return state == ncclInProgress ? ncclSuccess : state;
}

void NcclHandle::close(std::chrono::milliseconds grace) {
  std::unique_lock lock(mutex_);
  if (aborted_ || comm_ == nullptr) return;
  const std::string what = "ncclCommFinalize";
  const ncclResult_t result = api_.CommFinalize(comm_);
  Status status = Status::Ok();
  if (result != ncclSuccess && result != ncclInProgress) {
    status = nccl_error(result, what);
  } else {
    status = settle(lock, what, Clock::now() + grace);
  }
  if (!status.ok()) {
    abort_locked(status);
    return;
  }
  api_.CommDestroy(comm_);
  comm_ = nullptr;
}

}  // namespace hps::nccl_backend
