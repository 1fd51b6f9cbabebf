// The CUDA communicator: NCCL in non-blocking mode on the communicator's own CUDA
// stream. A watchdog thread ends operations that outlive the timeout by aborting the
// NCCL communicator, so no rank hangs.
#pragma once

#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "core/comm/communicator.h"

namespace hps::nccl_backend {

class NcclCommunicator final : public Communicator {
 public:
  static StatusOr<std::unique_ptr<Communicator>> create(std::shared_ptr<Store> store, int32_t rank,
                                                        int32_t size, int32_t device_index,
                                                        const CommOptions& options);
  ~NcclCommunicator() override;

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
                                             DType dtype, ReduceOp op, Stream* ready) override;
  StatusOr<std::shared_ptr<Work>> reduce(const void* send, void* recv, size_t count, DType dtype,
                                         ReduceOp op, int32_t root, Stream* ready) override;
  StatusOr<std::shared_ptr<Work>> broadcast(void* buffer, size_t count, DType dtype, int32_t root,
                                            Stream* ready) override;
  StatusOr<std::shared_ptr<Work>> all_gather(const void* send, void* recv, size_t count,
                                             DType dtype, Stream* ready) override;
  StatusOr<std::shared_ptr<Work>> reduce_scatter(const void* send, void* recv, size_t count,
                                                 DType dtype, ReduceOp op, Stream* ready) override;
  StatusOr<std::shared_ptr<Work>> send(const void* buffer, size_t count, DType dtype, int32_t peer,
                                       Stream* ready) override;
  StatusOr<std::shared_ptr<Work>> recv(void* buffer, size_t count, DType dtype, int32_t peer,
                                       Stream* ready) override;
  StatusOr<std::shared_ptr<Work>> barrier(Stream* ready) override;
  StatusOr<std::unique_ptr<Communicator>> split(const std::vector<int32_t>& ranks,
                                                std::string name) override;
  void abort() override;

 private:
  NcclCommunicator(int32_t rank, int32_t size, int32_t device_index, CommOptions options);
  // Runs `launch` (an NCCL call on the stream) after `ready`, records the Work's event,
  // and hands the Work to the watchdog.
  template <typename Launch>
  StatusOr<std::shared_ptr<Work>> enqueue(const char* operation, Stream* ready, Launch&& launch);
  Status wait_ready(ncclResult_t result, const char* operation);
  void watch();

  int32_t rank_;
  int32_t size_;
  int32_t device_index_;
  CommOptions options_;
  std::atomic<int64_t> timeout_ms_;
  ncclComm_t comm_ = nullptr;
  std::unique_ptr<Stream> stream_;
  void* barrier_scratch_ = nullptr;
  uint64_t next_sequence_ = 1;

  std::mutex mutex_;
  std::condition_variable watch_cv_;
  struct Pending {
    std::shared_ptr<Work> work;
    std::chrono::steady_clock::time_point deadline;
  };
  std::deque<Pending> pending_;
  bool stopping_ = false;
  std::atomic<bool> aborted_{false};
  Status failure_;
  std::thread watchdog_;
};

}  // namespace hps::nccl_backend
