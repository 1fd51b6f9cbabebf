#include "core/comm/nccl/communicator.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>

#include "core/comm/nccl/nccl_api.h"
#include "core/common/logging.h"
#include "core/device/cuda/error.h"
#include "core/device/cuda/stream.h"

namespace hps::nccl_backend {
namespace {

using Clock = std::chrono::steady_clock;

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return ncclFloat32;
    case DType::kFloat64: return ncclFloat64;
    case DType::kFloat16: return ncclFloat16;
    case DType::kBFloat16: return ncclBfloat16;
    case DType::kInt32: return ncclInt32;
    case DType::kInt64: return ncclInt64;
    case DType::kUInt8: return ncclUint8;
  }
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kMin: return ncclMin;
  }
  return ncclSum;
}

ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

}  // namespace

NcclCommunicator::NcclCommunicator(const NcclApi& api, int32_t rank, int32_t size,
                                   int32_t device_index, CommOptions options)
    : nccl_(api),
      rank_(rank),
      size_(size),
      device_index_(device_index),
      options_(std::move(options)),
      timeout_ms_(options_.timeout.count()),
      handle_(api, options_.name, [this](const Status& failure) { fail_pending(failure); }) {
  set_rank_names(RankNames(options_.world_ranks));
}

Status NcclCommunicator::start() {
  HPS_ASSIGN_OR_RETURN(stream_, create_stream(device()));
  HPS_ASSIGN_OR_RETURN(ready_event_, create_event(device()));
  HPS_RETURN_IF_ERROR(
      cuda::cuda_status(cudaMalloc(&barrier_scratch_, sizeof(float)), "cudaMalloc"));
  watchdog_ = std::thread([this] { watch(); });
  return Status::Ok();
}

StatusOr<std::unique_ptr<Communicator>> NcclCommunicator::create(std::shared_ptr<Store> store,
                                                                 int32_t rank, int32_t size,
                                                                 int32_t device_index,
                                                                 const CommOptions& options) {
  HPS_ASSIGN_OR_RETURN(const NcclApi* api, nccl_api());
  HPS_RETURN_IF_ERROR(cuda::set_device(device_index));
  HPS_ASSIGN_OR_RETURN(int64_t generation,
                       store->add("communicators/rank" + std::to_string(rank), 1));
  const std::string key = "comm" + std::to_string(generation) + "/nccl_unique_id";
  ncclUniqueId id;
  if (rank == 0) {
    const ncclResult_t result = api->GetUniqueId(&id);
    if (result != ncclSuccess) {
      return backend_error("ncclGetUniqueId: NCCL error " + std::to_string(result) + ": " +
                           api->GetErrorString(result));
    }
    HPS_RETURN_IF_ERROR(store->set(key, std::string_view(id.internal, sizeof id.internal)));
  } else {
    HPS_ASSIGN_OR_RETURN(std::string value, store->get(key, options.timeout));
    if (value.size() != sizeof id.internal) return internal_error("malformed NCCL unique id");
    std::memcpy(id.internal, value.data(), sizeof id.internal);
  }
  std::unique_ptr<NcclCommunicator> comm(
      new NcclCommunicator(*api, rank, size, device_index, options));
  ncclConfig_t config = nonblocking_config();
  HPS_RETURN_IF_ERROR(comm->handle_.init(
      "ncclCommInitRankConfig",
      [&](ncclComm_t* out) { return api->CommInitRankConfig(out, size, id, rank, &config); },
      Clock::now() + options.timeout));
  const Status started = comm->start();
  if (!started.ok()) {
    comm->handle_.abort(started);  // peers find out through their own timeouts
    return started;
  }
  return std::unique_ptr<Communicator>(std::move(comm));
}

NcclCommunicator::~NcclCommunicator() {
  untie();
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  watch_cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  (void)cudaSetDevice(device_index_);
  handle_.close(std::min<std::chrono::milliseconds>(kCloseGrace, timeout()));
  if (barrier_scratch_ != nullptr) cudaFree(barrier_scratch_);
}

void NcclCommunicator::fail_pending(const Status& failure) {
  std::lock_guard lock(mutex_);
  for (auto& p : pending_) p.work->set_status(failure);
  pending_.clear();
}

void NcclCommunicator::watch() {
  // The event queries below would otherwise open a context on device 0 for this thread.
  if (Status s = cuda::set_device(device_index_); !s.ok()) {
    HPS_LOG(kWarn) << "NCCL watchdog: " << s.to_string();
  }
  std::unique_lock lock(mutex_);
  while (!stopping_) {
    watch_cv_.wait_for(lock, std::chrono::milliseconds(10));
    // Nothing may escape into this thread: a failure to build a message (out of memory) is
    // retried on the next round.
    try {
      // However the handle was aborted (here, by a call NCCL failed, by fail()), the links
      // hear of it (only the first time counts), without this lock held.
      lock.unlock();
      if (handle_.aborted()) notify_failure(handle_.failure());
      lock.lock();
      // Completed operations leave in order (one stream: the first unfinished one is the
      // oldest still running).
      while (!pending_.empty()) {
        auto finished = pending_.front().work->done_event().query();
        if (!finished.ok() || !*finished) break;
        pending_.pop_front();
      }
      if (pending_.empty()) continue;
      const Pending oldest = pending_.front();
      // The handle is asked without this lock held (lock order: handle, then this).
      lock.unlock();
      const ncclResult_t state = handle_.async_error();
      Status failure = Status::Ok();
      if (state != ncclSuccess) {
        failure = backend_error(oldest.work->description() + ": NCCL reports error " +
                                std::to_string(state) + " on the communicator");
      } else if (Clock::now() > oldest.deadline) {
        failure = timeout_error(oldest.work->description() + ": timed out after " +
                                std::to_string(timeout().count()) + " ms");
      }
      if (!failure.ok()) {
        HPS_LOG(kError) << failure.to_string() << "; aborting the NCCL communicator";
        handle_.abort(failure);  // marks every pending operation failed, then aborts NCCL
      }
      lock.lock();
    } catch (const std::exception& e) {
      if (!lock.owns_lock()) lock.lock();
      HPS_LOG(kError) << "NCCL watchdog: " << e.what();
    }
  }
}

template <typename Launch>
StatusOr<std::shared_ptr<Work>> NcclCommunicator::enqueue(const char* operation, Stream* ready,
                                                          Launch&& launch) {
  const std::string where = std::string(operation) + " #" + std::to_string(next_sequence_++) +
                            " on group '" + options_.name + "' (rank " + std::to_string(rank_) +
                            " of " + std::to_string(size_) + ")";
  HPS_RETURN_IF_ERROR(cuda::set_device(device_index_));
  if (ready != nullptr) {
    if (ready->device() != device()) {
      return invalid_argument(where + ": the ready stream is on " + ready->device().to_string());
    }
    HPS_RETURN_IF_ERROR(ready_event_->record(*ready));
    HPS_RETURN_IF_ERROR(stream_->wait(*ready_event_));
  }
  HPS_ASSIGN_OR_RETURN(auto done, create_event(device()));
  auto work = std::make_shared<Work>(where, std::move(done));
  auto native = static_cast<cuda::CudaStream&>(*stream_).native();
  // Returns once NCCL's kernel is on the stream (or the communicator was aborted).
  HPS_RETURN_IF_ERROR(handle_.run(
      where, [&](ncclComm_t comm) { return launch(comm, native); }, Clock::now() + timeout()));
  HPS_RETURN_IF_ERROR(work->done_event().record(*stream_));
  {
    std::lock_guard lock(mutex_);
    pending_.push_back({work, Clock::now() + timeout()});
  }
  // An abort between run() and the push above found no such work to fail: fail it here. (An
  // abort after the push fails it itself.)
  if (handle_.aborted()) work->set_status(handle_.failure());
  watch_cv_.notify_all();
  return work;
}

StatusOr<std::shared_ptr<Work>> NcclCommunicator::all_reduce(const void* send, void* recv,
                                                             size_t count, DType dtype, ReduceOp op,
                                                             Stream* ready, uint64_t /*tag*/) {
  const CommArgs a{"all_reduce", options_.name, size_};
  HPS_RETURN_IF_ERROR(check_reduce_buffers(a, send, recv, count, dtype, true));
  return enqueue("all_reduce", ready, [&](ncclComm_t comm, cudaStream_t s) {
    return nccl_.AllReduce(send, recv, count, nccl_type(dtype), nccl_op(op), comm, s);
  });
}

StatusOr<std::shared_ptr<Work>> NcclCommunicator::reduce(const void* send, void* recv, size_t count,
                                                         DType dtype, ReduceOp op, int32_t root,
                                                         Stream* ready) {
  const CommArgs a{"reduce", options_.name, size_};
  HPS_RETURN_IF_ERROR(check_rank_in_group(a, "root", root));
  HPS_RETURN_IF_ERROR(check_reduce_buffers(a, send, recv, count, dtype, rank_ == root));
  return enqueue("reduce", ready, [&](ncclComm_t comm, cudaStream_t s) {
    return nccl_.Reduce(send, recv, count, nccl_type(dtype), nccl_op(op), root, comm, s);
  });
}

StatusOr<std::shared_ptr<Work>> NcclCommunicator::broadcast(void* buffer, size_t count, DType dtype,
                                                            int32_t root, Stream* ready) {
  const CommArgs a{"broadcast", options_.name, size_};
  HPS_RETURN_IF_ERROR(check_rank_in_group(a, "root", root));
  HPS_RETURN_IF_ERROR(check_buffer(a, "buffer", buffer, count, dtype));
  return enqueue("broadcast", ready, [&](ncclComm_t comm, cudaStream_t s) {
    return nccl_.Broadcast(buffer, buffer, count, nccl_type(dtype), root, comm, s);
  });
}

StatusOr<std::shared_ptr<Work>> NcclCommunicator::all_gather(const void* send, void* recv,
                                                             size_t count, DType dtype,
                                                             Stream* ready, uint64_t /*tag*/) {
  const CommArgs a{"all_gather", options_.name, size_};
  HPS_RETURN_IF_ERROR(check_all_gather_buffers(a, rank_, send, recv, count, dtype));
  return enqueue("all_gather", ready, [&](ncclComm_t comm, cudaStream_t s) {
    return nccl_.AllGather(send, recv, count, nccl_type(dtype), comm, s);
  });
}

StatusOr<std::shared_ptr<Work>> NcclCommunicator::reduce_scatter(const void* send, void* recv,
                                                                 size_t count, DType dtype,
                                                                 ReduceOp op, Stream* ready,
                                                                 uint64_t /*tag*/) {
  const CommArgs a{"reduce_scatter", options_.name, size_};
  HPS_RETURN_IF_ERROR(check_reduce_scatter_buffers(a, rank_, send, recv, count, dtype));
  return enqueue("reduce_scatter", ready, [&](ncclComm_t comm, cudaStream_t s) {
    return nccl_.ReduceScatter(send, recv, count, nccl_type(dtype), nccl_op(op), comm, s);
  });
}

StatusOr<std::shared_ptr<Work>> NcclCommunicator::send(const void* buffer, size_t count,
                                                       DType dtype, int32_t peer, Stream* ready) {
  const CommArgs a{"send", options_.name, size_};
  HPS_RETURN_IF_ERROR(check_rank_in_group(a, "peer", peer));
  if (peer == rank_) return invalid_argument("send on group '" + options_.name + "': to itself");
  HPS_RETURN_IF_ERROR(check_buffer(a, "buffer", buffer, count, dtype));
  return enqueue("send", ready, [&](ncclComm_t comm, cudaStream_t s) {
    return nccl_.Send(buffer, count, nccl_type(dtype), peer, comm, s);
  });
}

StatusOr<std::shared_ptr<Work>> NcclCommunicator::recv(void* buffer, size_t count, DType dtype,
                                                       int32_t peer, Stream* ready) {
  const CommArgs a{"recv", options_.name, size_};
  HPS_RETURN_IF_ERROR(check_rank_in_group(a, "peer", peer));
  if (peer == rank_) return invalid_argument("recv on group '" + options_.name + "': from itself");
  HPS_RETURN_IF_ERROR(check_buffer(a, "buffer", buffer, count, dtype));
  return enqueue("recv", ready, [&](ncclComm_t comm, cudaStream_t s) {
    return nccl_.Recv(buffer, count, nccl_type(dtype), peer, comm, s);
  });
}

StatusOr<std::shared_ptr<Work>> NcclCommunicator::barrier(Stream* ready) {
  return enqueue("barrier", ready, [&](ncclComm_t comm, cudaStream_t s) {
    return nccl_.AllReduce(barrier_scratch_, barrier_scratch_, 1, ncclFloat32, ncclSum, comm, s);
  });
}

StatusOr<std::unique_ptr<Communicator>> NcclCommunicator::split_group(
    const std::vector<int32_t>& ranks, std::string name, std::vector<int32_t> world_ranks) {
  auto position = std::find(ranks.begin(), ranks.end(), rank_);
  const int color = position == ranks.end() ? NCCL_SPLIT_NOCOLOR : 0;
  const int key = position == ranks.end() ? 0 : static_cast<int>(position - ranks.begin());
  HPS_RETURN_IF_ERROR(cuda::set_device(device_index_));
  CommOptions child_options = options_;
  child_options.name = std::move(name);
  child_options.timeout = timeout();
  child_options.world_ranks = std::move(world_ranks);
  std::unique_ptr<NcclCommunicator> child(new NcclCommunicator(
      nccl_, key, static_cast<int32_t>(ranks.size()), device_index_, std::move(child_options)));
  ncclConfig_t config = nonblocking_config();
  HPS_RETURN_IF_ERROR(handle_.split("ncclCommSplit into '" + child->name() + "'", color, key,
                                    &config, child->handle_, Clock::now() + timeout()));
  if (color == NCCL_SPLIT_NOCOLOR) return std::unique_ptr<Communicator>();
  const Status started = child->start();
  if (!started.ok()) {
    child->handle_.abort(started);
    return started;
  }
  return std::unique_ptr<Communicator>(std::move(child));
}

void NcclCommunicator::abort_operations() {
  handle_.abort(aborted("communicator '" + options_.name + "' was aborted"));
}

void NcclCommunicator::fail_operations(const Status& cause) {
  handle_.abort(cause);  // nothing when aborted already
}

}  // namespace hps::nccl_backend
