#include "core/comm/self/communicator.h"

#include <algorithm>
#include <cstring>

#include "core/trace/trace.h"

namespace hps::self_backend {

SelfCommunicator::SelfCommunicator(const CommOptions& options)
    : name_(options.name),
      timeout_ms_(options.timeout.count()),
      stream_(std::make_unique<cpu::CpuStream>()) {
  stream_->set_trace_name("communicator '" + name_ + "' rank 0 of 1");
  set_rank_names(RankNames(options.world_ranks));
}

StatusOr<std::unique_ptr<Communicator>> SelfCommunicator::create(const CommOptions& options) {
  HPS_RETURN_IF_ERROR(check_comm_timeout(options.timeout, "create_communicator: the timeout"));
  return std::unique_ptr<Communicator>(new SelfCommunicator(options));
}

void SelfCommunicator::fail_operations(const Status& cause) {
  std::lock_guard lock(failure_mutex_);
  if (failure_.ok()) failure_ = cause;
}

Status SelfCommunicator::failure() const {
  std::lock_guard lock(failure_mutex_);
  return failure_;
}

void SelfCommunicator::set_timeout(Milliseconds timeout) {
  timeout_ms_ = std::clamp(timeout, Milliseconds(1), kMaxCommTimeout).count();
}

StatusOr<std::shared_ptr<Work>> SelfCommunicator::enqueue(const char* operation, uint64_t bytes,
                                                          Stream* ready,
                                                          std::function<void()> body) {
  const std::string where =
      std::string(operation) + " #" + std::to_string(next_sequence_) + " on group '" + name_ + "'";
  if (aborted_) return aborted(where + ": the communicator was aborted");
  if (Status f = failure(); !f.ok()) {
    return aborted(where + ": the communicator failed: " + f.message());
  }
  HPS_RETURN_IF_ERROR(wait_for_ready(*stream_, ready, operation));
  const uint64_t sequence = next_sequence_++;
  auto work = std::make_shared<Work>(where, std::make_unique<cpu::CpuEvent>());
  stream_->enqueue(
      [this, work, operation, bytes, sequence, where, body = std::move(body)] {
        if (aborted_) {
          work->set_status(aborted(where + ": the communicator was aborted"));
          return;
        }
        if (Status f = failure(); !f.ok()) {
          work->set_status(aborted(where + ": the communicator failed: " + f.message()));
          return;
        }
        if (trace::enabled()) trace::collective(operation, bytes, name_, sequence);
        body();
      },
      operation);
  HPS_RETURN_IF_ERROR(work->done_event().record(*stream_));
  return work;
}

namespace {

// The identity from `send` into `recv` (nothing when they are the same buffer).
std::function<void()> copy(const void* send, void* recv, size_t bytes) {
  return [send, recv, bytes] {
    if (send != recv && bytes > 0) std::memmove(recv, send, bytes);
  };
}

}  // namespace

StatusOr<std::shared_ptr<Work>> SelfCommunicator::all_reduce(const void* send, void* recv,
                                                             size_t count, DType dtype, ReduceOp op,
                                                             Stream* ready, uint64_t /*tag*/) {
  const CommArgs a{"all_reduce", name_, 1};
  HPS_RETURN_IF_ERROR(reduce_op_from_int(static_cast<int32_t>(op)).status());
  HPS_RETURN_IF_ERROR(check_reduce_buffers(a, send, recv, count, dtype, true));
  const size_t bytes = count * dtype_size(dtype);
  return enqueue("all_reduce", bytes, ready, copy(send, recv, bytes));
}

StatusOr<std::shared_ptr<Work>> SelfCommunicator::reduce(const void* send, void* recv, size_t count,
                                                         DType dtype, ReduceOp op, int32_t root,
                                                         Stream* ready) {
  const CommArgs a{"reduce", name_, 1};
  HPS_RETURN_IF_ERROR(reduce_op_from_int(static_cast<int32_t>(op)).status());
  HPS_RETURN_IF_ERROR(check_rank_in_group(a, "root", root));
  HPS_RETURN_IF_ERROR(check_reduce_buffers(a, send, recv, count, dtype, true));
  const size_t bytes = count * dtype_size(dtype);
  return enqueue("reduce", bytes, ready, copy(send, recv, bytes));
}

StatusOr<std::shared_ptr<Work>> SelfCommunicator::broadcast(void* buffer, size_t count, DType dtype,
                                                            int32_t root, Stream* ready) {
  const CommArgs a{"broadcast", name_, 1};
  HPS_RETURN_IF_ERROR(check_rank_in_group(a, "root", root));
  HPS_RETURN_IF_ERROR(check_buffer(a, "buffer", buffer, count, dtype));
  return enqueue("broadcast", count * dtype_size(dtype), ready, [] {});
}

StatusOr<std::shared_ptr<Work>> SelfCommunicator::all_gather(const void* send, void* recv,
                                                             size_t count, DType dtype,
                                                             Stream* ready, uint64_t /*tag*/) {
  const CommArgs a{"all_gather", name_, 1};
  HPS_RETURN_IF_ERROR(check_all_gather_buffers(a, 0, send, recv, count, dtype));
  const size_t bytes = count * dtype_size(dtype);
  return enqueue("all_gather", bytes, ready, copy(send, recv, bytes));
}

StatusOr<std::shared_ptr<Work>> SelfCommunicator::reduce_scatter(const void* send, void* recv,
                                                                 size_t count, DType dtype,
                                                                 ReduceOp op, Stream* ready,
                                                                 uint64_t /*tag*/) {
  const CommArgs a{"reduce_scatter", name_, 1};
  HPS_RETURN_IF_ERROR(reduce_op_from_int(static_cast<int32_t>(op)).status());
  HPS_RETURN_IF_ERROR(check_reduce_scatter_buffers(a, 0, send, recv, count, dtype));
  const size_t bytes = count * dtype_size(dtype);
  return enqueue("reduce_scatter", bytes, ready, copy(send, recv, bytes));
}

StatusOr<std::shared_ptr<Work>> SelfCommunicator::send(const void* buffer, size_t count,
                                                       DType dtype, int32_t peer, Stream* ready) {
  (void)buffer, (void)count, (void)dtype, (void)ready;
  const CommArgs a{"send", name_, 1};
  HPS_RETURN_IF_ERROR(check_rank_in_group(a, "peer", peer));
  return invalid_argument("send on group '" + name_ + "': to itself");
}

StatusOr<std::shared_ptr<Work>> SelfCommunicator::recv(void* buffer, size_t count, DType dtype,
                                                       int32_t peer, Stream* ready) {
  (void)buffer, (void)count, (void)dtype, (void)ready;
  const CommArgs a{"recv", name_, 1};
  HPS_RETURN_IF_ERROR(check_rank_in_group(a, "peer", peer));
  return invalid_argument("recv on group '" + name_ + "': from itself");
}

StatusOr<std::shared_ptr<Work>> SelfCommunicator::barrier(Stream* ready) {
  return enqueue("barrier", 0, ready, [] {});
}

StatusOr<std::unique_ptr<Communicator>> SelfCommunicator::split_group(
    const std::vector<int32_t>& ranks, std::string name, std::vector<int32_t> world_ranks) {
  (void)ranks;  // [0]: Communicator::split checked it
  CommOptions child;
  child.name = std::move(name);
  child.world_ranks = std::move(world_ranks);
  child.timeout = timeout();
  return create(child);
}

}  // namespace hps::self_backend
