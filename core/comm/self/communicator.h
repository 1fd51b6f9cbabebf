// The CPU communicator of a group of one rank: every collective is the identity (a copy
// where the output is another buffer), so it needs no transport, no store traffic and no
// Gloo. create_communicator() makes it for a CPU group of size 1 where the build has no
// Gloo (a CUDA machine's), so a single-process job there still has the CPU group that
// checkpoints agree over.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "core/comm/communicator.h"
#include "core/device/cpu/stream.h"

namespace hps::self_backend {

class SelfCommunicator final : public Communicator {
 public:
  // Options out of range are INVALID_ARGUMENT (as create_communicator checks them).
  static StatusOr<std::unique_ptr<Communicator>> create(const CommOptions& options);
  ~SelfCommunicator() override { untie(); }

  int32_t rank() const override { return 0; }
  int32_t size() const override { return 1; }
  Device device() const override { return Device::cpu(); }
  const std::string& name() const override { return name_; }
  std::string_view transport() const override { return "self"; }
  Stream& stream() override { return *stream_; }
  Milliseconds timeout() const override { return Milliseconds(timeout_ms_.load()); }
  void set_timeout(Milliseconds timeout) override;

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
  // A rank has no peer to send to or receive from: INVALID_ARGUMENT, as on any group.
  StatusOr<std::shared_ptr<Work>> send(const void* buffer, size_t count, DType dtype, int32_t peer,
                                       Stream* ready) override;
  StatusOr<std::shared_ptr<Work>> recv(void* buffer, size_t count, DType dtype, int32_t peer,
                                       Stream* ready) override;
  StatusOr<std::shared_ptr<Work>> barrier(Stream* ready) override;

 protected:
  StatusOr<std::unique_ptr<Communicator>> split_group(const std::vector<int32_t>& ranks,
                                                      std::string name,
                                                      std::vector<int32_t> world_ranks) override;
  void abort_operations() override { aborted_ = true; }
  // Its operations never fail on their own (no peer): only fail() records a failure.
  void fail_operations(const Status& cause) override;

 private:
  explicit SelfCommunicator(const CommOptions& options);
  // Queues `body` on the stream (after `ready`'s work so far) with a fresh Work; an
  // operation that reaches the stream after abort() ends ABORTED without running.
  StatusOr<std::shared_ptr<Work>> enqueue(const char* operation, uint64_t bytes, Stream* ready,
                                          std::function<void()> body);

  std::string name_;
  std::atomic<int64_t> timeout_ms_;
  std::atomic<bool> aborted_{false};
  Status failure() const;
  mutable std::mutex failure_mutex_;
  Status failure_;  // fail()'s cause: later operations are refused with it
  uint64_t next_sequence_ = 0;
  std::unique_ptr<cpu::CpuStream> stream_;
};

}  // namespace hps::self_backend
