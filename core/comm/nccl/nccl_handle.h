// One NCCL communicator handle in NCCL's non-blocking mode, and the protocol that mode asks
// for, in one place (no CUDA runtime calls here, so it is tested on any machine with a fake
// NCCL: tests/core/comm/nccl_handle_test.cc).
//
// Why non-blocking: it is the mode in which ncclCommAbort may be called at any moment —
// during initialisation, a collective's enqueue or finalisation — which is how a timed-out
// or failed communicator is ended without a hang. Its price is that every call may return
// ncclInProgress before NCCL has done its part (for a collective: before its kernel is on
// the stream); the caller must poll ncclCommGetAsyncError until the state leaves
// ncclInProgress before it issues the next call or records an event after the operation.
// run() does exactly that, by a deadline.
//
// Threads: the issuing thread, the communicator's watchdog and abort() (any thread) share a
// handle. Every NCCL call on it is made under one mutex, which is never held while waiting
// (polls release it between attempts), so abort() cannot free the communicator under a
// call in flight and is never kept waiting for longer than one NCCL call.
#pragma once

#include <nccl.h>

#include <chrono>
#include <functional>
#include <mutex>
#include <string>

#include "core/comm/nccl/nccl_api.h"
#include "core/common/status.h"

namespace hps::nccl_backend {

class NcclHandle {
 public:
  using Clock = std::chrono::steady_clock;

  // `before_abort` runs when the handle is aborted, after the failure is recorded and
  // before ncclCommAbort (which lets the operations on the stream end): the owner marks its
  // pending operations failed there, so nobody can see one complete with an OK status.
  NcclHandle(const NcclApi& api, std::string group,
             std::function<void(const Status&)> before_abort = {});
  ~NcclHandle();  // close(0) when still open: aborts what is left
  NcclHandle(const NcclHandle&) = delete;
  NcclHandle& operator=(const NcclHandle&) = delete;

  // Creates the communicator: `create` is ncclCommInitRankConfig (non-blocking config) into
  // its argument; waits until NCCL has finished initialising it. On an error or at the
  // deadline the communicator is aborted (never finalized) and the failure returned.
  Status init(const std::string& what, const std::function<ncclResult_t(ncclComm_t*)>& create,
              Clock::time_point deadline);
  // Creates `child` by ncclCommSplit of this communicator (`config` non-blocking) and waits
  // until both have settled; `child` stays empty for NCCL_SPLIT_NOCOLOR.
  Status split(const std::string& what, int color, int key, ncclConfig_t* config, NcclHandle& child,
               Clock::time_point deadline);
  // Issues `call` on the communicator and returns once NCCL has finished enqueueing it (its
  // work is on the stream): only then may an event be recorded after it. Fails at once
  // (ABORTED, naming the first failure) on an aborted handle; an error or the deadline
  // aborts the handle.
  Status run(const std::string& what, const std::function<ncclResult_t(ncclComm_t)>& call,
             Clock::time_point deadline);
  // For the watchdog: the communicator's asynchronous error; ncclSuccess when there is no
  // communicator (aborted or closed) or it is busy.
  ncclResult_t async_error();
  // Ends the communicator once: records `failure` (the first one wins), runs before_abort,
  // then ncclCommAbort. Thread-safe; later calls do nothing.
  void abort(const Status& failure);
  // Closes a healthy communicator: ncclCommFinalize (flushes what was issued), polls for at
  // most `grace`, then ncclCommDestroy; aborts instead when finalisation fails or takes
  // longer. Nothing on an aborted or empty handle.
  void close(std::chrono::milliseconds grace);

  bool open() const;
  bool aborted() const;
  Status failure() const;  // OK until aborted
  const std::string& group() const { return group_; }

 private:
  // Polls until `comm` (and `other`, when given) leave ncclInProgress, releasing the lock
  // between polls; OK, the NCCL error, ABORTED (aborted meanwhile) or TIMEOUT.
  Status settle(std::unique_lock<std::mutex>& lock, const std::string& what,
                Clock::time_point deadline, NcclHandle* other = nullptr);
  Status nccl_error(ncclResult_t result, const std::string& what) const;
  void abort_locked(const Status& failure);
  Status aborted_status(const std::string& what) const;

  const NcclApi& api_;
  std::string group_;
  std::function<void(const Status&)> before_abort_;
  mutable std::mutex mutex_;
  ncclComm_t comm_ = nullptr;
  bool aborted_ = false;
  Status failure_;
};

}  // namespace hps::nccl_backend
