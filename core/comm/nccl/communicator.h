// The CUDA communicator: NCCL in non-blocking mode (nccl_handle.h: why, and the protocol)
// on the communicator's own CUDA stream. An operation's done-event is recorded only after
// NCCL has finished enqueueing it. A watchdog thread ends operations that outlive the
// timeout, or a communicator NCCL reports broken, by aborting the NCCL communicator — after
// marking every pending operation failed — so no rank hangs and no waiter reads OK.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "core/comm/communicator.h"
#include "core/comm/nccl/nccl_handle.h"

namespace hps::nccl_backend {

class NcclCommunicator final : public Communicator {
 public:
  static StatusOr<std::unique_ptr<Communicator>> create(std::shared_ptr<Store> store, int32_t rank,
                                                        int32_t size, int32_t device_index,
                                                        const CommOptions& options);
  // Closes the NCCL communicator: finalisation flushes what was issued, for at most
  // kCloseGrace (or the timeout when shorter); then it is aborted.
  ~NcclCommunicator() override;

  static constexpr std::chrono::milliseconds kCloseGrace{10'000};

  int32_t rank() const override { return rank_; }
  int32_t size() const override { return size_; }
  Device device() const override { return Device::cuda(device_index_); }
  const std::string& name() const override { return options_.name; }
  std::string_view transport() const override { return "nccl"; }
  Stream& stream() override { return *stream_; }
  Milliseconds timeout() const override { return Milliseconds(timeout_ms_.load()); }
  void set_timeout(Milliseconds timeout) override {
    timeout_ms_ = std::clamp(timeout, Milliseconds(1), kMaxCommTimeout).count();
  }

  StatusOr<std::shared_ptr<Work>> all_reduce(const void* send, void* recv, size_t count,
                                             DType dtype, ReduceOp op, Stream* ready,
                                             uint64_t tag) override;
  StatusOr<std::shared_ptr<Work>> reduce(const void* send, void* recv, size_t count, DType dtype,
                                         ReduceOp op, int32_t root, Stream* ready) override;
  StatusOr<std::shared_ptr<Work>> broadcast(void* buffer, size_t count, DType dtype, int32_t root,
                                            Stream* ready) override;
  StatusOr<std::shared_ptr<Work>> all_gather(const void* send, void* recv, size_t count,
                                             DType dtype, Stream* ready, uint64_t tag) override;
  StatusOr<std::shared_ptr<Work>> reduce_scatter(const void* send, void* recv, size_t count,
                                                 DType dtype, ReduceOp op, Stream* ready,
                                                 uint64_t tag) override;
  StatusOr<std::shared_ptr<Work>> send(const void* buffer, size_t count, DType dtype, int32_t peer,
                                       Stream* ready) override;
  StatusOr<std::shared_ptr<Work>> recv(void* buffer, size_t count, DType dtype, int32_t peer,
                                       Stream* ready) override;
  StatusOr<std::shared_ptr<Work>> barrier(Stream* ready) override;

 protected:
  StatusOr<std::unique_ptr<Communicator>> split_group(const std::vector<int32_t>& ranks,
                                                      std::string name,
                                                      std::vector<int32_t> world_ranks) override;
  void abort_operations() override;
  void fail_operations(const Status& cause) override;

 private:
  NcclCommunicator(const NcclApi& api, int32_t rank, int32_t size, int32_t device_index,
                   CommOptions options);
  // The CUDA side of a new communicator: its stream, events, scratch and watchdog.
  Status start();
  // Runs `launch` (an NCCL call on the stream) after `ready`, waits until NCCL has enqueued
  // it, records the Work's event, and hands the Work to the watchdog.
  template <typename Launch>
  StatusOr<std::shared_ptr<Work>> enqueue(const char* operation, Stream* ready, Launch&& launch);
  // Marks every pending operation failed (the handle's before_abort).
  void fail_pending(const Status& failure);
  void watch();

  const NcclApi& nccl_;
  int32_t rank_;
  int32_t size_;
  int32_t device_index_;
  CommOptions options_;
  std::atomic<int64_t> timeout_ms_;
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<Event> ready_event_;  // reused: a stream wait captures its state at the call
  void* barrier_scratch_ = nullptr;
  uint64_t next_sequence_ = 1;

  // The operations the watchdog watches. Lock order: the handle's lock, then this one; the
  // watchdog never calls the handle while holding it.
  std::mutex mutex_;
  std::condition_variable watch_cv_;
  struct Pending {
    std::shared_ptr<Work> work;
    std::chrono::steady_clock::time_point deadline;
  };
  std::deque<Pending> pending_;
  bool stopping_ = false;
  std::thread watchdog_;
  // Last: it is destroyed first, while what its before_abort touches still exists.
  NcclHandle handle_;
};

}  // namespace hps::nccl_backend
