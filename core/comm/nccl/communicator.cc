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

// Only called once create() has loaded the API.
const NcclApi& nccl() { return *nccl_api().value(); }

Status nccl_status(ncclResult_t result, const std::string& where) {
  if (result == ncclSuccess || result == ncclInProgress) return Status::Ok();
  return backend_error(where + ": NCCL error " + std::to_string(result) + ": " +
                       nccl().GetErrorString(result));
}

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

NcclCommunicator::NcclCommunicator(int32_t rank, int32_t size, int32_t device_index,
                                   CommOptions options)
    : rank_(rank),
      size_(size),
      device_index_(device_index),
      options_(std::move(options)),
      timeout_ms_(options_.timeout.count()) {}

Status NcclCommunicator::wait_ready(ncclResult_t result, const char* operation) {
  HPS_RETURN_IF_ERROR(nccl_status(result, operation));
  // Non-blocking mode: poll the communicator's state until it settles or time runs out.
  const auto deadline = Clock::now() + timeout();
  ncclResult_t state = ncclInProgress;
  while (true) {
    HPS_RETURN_IF_ERROR(nccl_status(nccl().CommGetAsyncError(comm_, &state), operation));
    if (state != ncclInProgress) break;
    if (Clock::now() > deadline) {
      nccl().CommAbort(comm_);
      comm_ = nullptr;
      return timeout_error(std::string(operation) + " on group '" + options_.name +
                           "' timed out after " + std::to_string(timeout().count()) + " ms");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return nccl_status(state, operation);
}

StatusOr<std::unique_ptr<Communicator>> NcclCommunicator::create(std::shared_ptr<Store> store,
                                                                 int32_t rank, int32_t size,
                                                                 int32_t device_index,
                                                                 const CommOptions& options) {
  HPS_RETURN_IF_ERROR(nccl_api().status());
  HPS_RETURN_IF_ERROR(cuda::set_device(device_index));
  HPS_ASSIGN_OR_RETURN(int64_t generation,
                       store->add("communicators/rank" + std::to_string(rank), 1));
  const std::string key = "comm" + std::to_string(generation) + "/nccl_unique_id";
  ncclUniqueId id;
  if (rank == 0) {
    HPS_RETURN_IF_ERROR(nccl_status(nccl().GetUniqueId(&id), "ncclGetUniqueId"));
    HPS_RETURN_IF_ERROR(store->set(key, std::string_view(id.internal, sizeof id.internal)));
  } else {
    HPS_ASSIGN_OR_RETURN(std::string value, store->get(key, options.timeout));
    if (value.size() != sizeof id.internal) return internal_error("malformed NCCL unique id");
    std::memcpy(id.internal, value.data(), sizeof id.internal);
  }
  std::unique_ptr<NcclCommunicator> comm(new NcclCommunicator(rank, size, device_index, options));
  ncclConfig_t config = nonblocking_config();
  HPS_RETURN_IF_ERROR(comm->wait_ready(
      nccl().CommInitRankConfig(&comm->comm_, size, id, rank, &config), "ncclCommInitRankConfig"));
  HPS_ASSIGN_OR_RETURN(comm->stream_, create_stream(Device::cuda(device_index)));
  HPS_RETURN_IF_ERROR(
      cuda::cuda_status(cudaMalloc(&comm->barrier_scratch_, sizeof(float)), "cudaMalloc"));
  comm->watchdog_ = std::thread([c = comm.get()] { c->watch(); });
  return std::unique_ptr<Communicator>(std::move(comm));
}

NcclCommunicator::~NcclCommunicator() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  watch_cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  (void)cudaSetDevice(device_index_);
  if (comm_ != nullptr) {
    if (aborted_) {
      nccl().CommAbort(comm_);
    } else {
      nccl().CommFinalize(comm_);
      ncclResult_t state = ncclInProgress;
      const auto deadline = Clock::now() + timeout();
      while (nccl().CommGetAsyncError(comm_, &state) == ncclSuccess && state == ncclInProgress &&
             Clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
      nccl().CommDestroy(comm_);
    }
  }
  if (barrier_scratch_ != nullptr) cudaFree(barrier_scratch_);
}

void NcclCommunicator::watch() {
  std::unique_lock lock(mutex_);
  while (!stopping_) {
    watch_cv_.wait_for(lock, std::chrono::milliseconds(10));
    // Nothing may escape into this thread: a failure to build a message (out of memory)
    // is retried on the next round.
    try {
      while (!pending_.empty()) {
        Pending& p = pending_.front();
        auto finished = p.work->done_event().query();
        if (finished.ok() && *finished) {
          pending_.pop_front();
          continue;
        }
        ncclResult_t state = ncclSuccess;
        if (comm_ != nullptr) nccl().CommGetAsyncError(comm_, &state);
        const bool failed = state != ncclSuccess && state != ncclInProgress;
        if (failed || Clock::now() > p.deadline) {
          Status s = failed ? nccl_status(state, p.work->description())
                            : timeout_error(p.work->description() + ": timed out after " +
                                            std::to_string(timeout().count()) + " ms");
          failure_ = s;
          aborted_ = true;
          HPS_LOG(kError) << s.to_string() << "; aborting the NCCL communicator";
          if (comm_ != nullptr) nccl().CommAbort(comm_);
          comm_ = nullptr;
          for (auto& q : pending_) q.work->set_status(s);
          pending_.clear();
        }
        break;
      }
    } catch (const std::exception& e) {
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
  {
    std::lock_guard lock(mutex_);
    if (aborted_ || comm_ == nullptr) {
      return aborted(where + ": the communicator was aborted" +
                     (failure_.ok() ? std::string() : " after: " + failure_.message()));
    }
  }
  HPS_RETURN_IF_ERROR(cuda::set_device(device_index_));
  if (ready != nullptr) {
    if (ready->device() != device()) {
      return invalid_argument(where + ": the ready stream is on " + ready->device().to_string());
    }
    HPS_ASSIGN_OR_RETURN(auto ready_event, create_event(device()));
    HPS_RETURN_IF_ERROR(ready_event->record(*ready));
    HPS_RETURN_IF_ERROR(stream_->wait(*ready_event));
  }
  auto native = static_cast<cuda::CudaStream&>(*stream_).native();
  HPS_RETURN_IF_ERROR(nccl_status(launch(native), where));
  HPS_ASSIGN_OR_RETURN(auto done, create_event(device()));
  auto work = std::make_shared<Work>(where, std::move(done));
  HPS_RETURN_IF_ERROR(work->done_event().record(*stream_));
  {
    std::lock_guard lock(mutex_);
    pending_.push_back({work, Clock::now() + timeout()});
  }
  return work;
}

StatusOr<std::shared_ptr<Work>> NcclCommunicator::all_reduce(const void* send, void* recv,
                                                             size_t count, DType dtype, ReduceOp op,
                                                             Stream* ready) {
  const CommArgs a{"all_reduce", options_.name, size_};
  HPS_RETURN_IF_ERROR(check_buffer(a, "send", send, count, dtype));
  HPS_RETURN_IF_ERROR(check_buffer(a, "recv", recv, count, dtype));
  return enqueue("all_reduce", ready, [&](cudaStream_t s) {
    return nccl().AllReduce(send, recv, count, nccl_type(dtype), nccl_op(op), comm_, s);
  });
}

StatusOr<std::shared_ptr<Work>> NcclCommunicator::reduce(const void* send, void* recv, size_t count,
                                                         DType dtype, ReduceOp op, int32_t root,
                                                         Stream* ready) {
  const CommArgs a{"reduce", options_.name, size_};
  HPS_RETURN_IF_ERROR(check_rank_in_group(a, "root", root));
  HPS_RETURN_IF_ERROR(check_buffer(a, "send", send, count, dtype));
  if (rank_ == root) HPS_RETURN_IF_ERROR(check_buffer(a, "recv", recv, count, dtype));
  return enqueue("reduce", ready, [&](cudaStream_t s) {
    return nccl().Reduce(send, recv, count, nccl_type(dtype), nccl_op(op), root, comm_, s);
  });
}

StatusOr<std::shared_ptr<Work>> NcclCommunicator::broadcast(void* buffer, size_t count, DType dtype,
                                                            int32_t root, Stream* ready) {
  const CommArgs a{"broadcast", options_.name, size_};
  HPS_RETURN_IF_ERROR(check_rank_in_group(a, "root", root));
  HPS_RETURN_IF_ERROR(check_buffer(a, "buffer", buffer, count, dtype));
  return enqueue("broadcast", ready, [&](cudaStream_t s) {
    return nccl().Broadcast(buffer, buffer, count, nccl_type(dtype), root, comm_, s);
  });
}

StatusOr<std::shared_ptr<Work>> NcclCommunicator::all_gather(const void* send, void* recv,
                                                             size_t count, DType dtype,
                                                             Stream* ready) {
  const CommArgs a{"all_gather", options_.name, size_};
  HPS_RETURN_IF_ERROR(check_buffer(a, "send", send, count, dtype));
  HPS_RETURN_IF_ERROR(check_buffer(a, "recv", recv, count, dtype, static_cast<size_t>(size_)));
  return enqueue("all_gather", ready, [&](cudaStream_t s) {
    return nccl().AllGather(send, recv, count, nccl_type(dtype), comm_, s);
  });
}

StatusOr<std::shared_ptr<Work>> NcclCommunicator::reduce_scatter(const void* send, void* recv,
                                                                 size_t count, DType dtype,
                                                                 ReduceOp op, Stream* ready) {
  const CommArgs a{"reduce_scatter", options_.name, size_};
  HPS_RETURN_IF_ERROR(check_buffer(a, "send", send, count, dtype, static_cast<size_t>(size_)));
  HPS_RETURN_IF_ERROR(check_buffer(a, "recv", recv, count, dtype));
  return enqueue("reduce_scatter", ready, [&](cudaStream_t s) {
    return nccl().ReduceScatter(send, recv, count, nccl_type(dtype), nccl_op(op), comm_, s);
  });
}

StatusOr<std::shared_ptr<Work>> NcclCommunicator::send(const void* buffer, size_t count,
                                                       DType dtype, int32_t peer, Stream* ready) {
  const CommArgs a{"send", options_.name, size_};
  HPS_RETURN_IF_ERROR(check_rank_in_group(a, "peer", peer));
  if (peer == rank_) return invalid_argument("send on group '" + options_.name + "': to itself");
  HPS_RETURN_IF_ERROR(check_buffer(a, "buffer", buffer, count, dtype));
  return enqueue("send", ready, [&](cudaStream_t s) {
    return nccl().Send(buffer, count, nccl_type(dtype), peer, comm_, s);
  });
}

StatusOr<std::shared_ptr<Work>> NcclCommunicator::recv(void* buffer, size_t count, DType dtype,
                                                       int32_t peer, Stream* ready) {
  const CommArgs a{"recv", options_.name, size_};
  HPS_RETURN_IF_ERROR(check_rank_in_group(a, "peer", peer));
  if (peer == rank_) return invalid_argument("recv on group '" + options_.name + "': from itself");
  HPS_RETURN_IF_ERROR(check_buffer(a, "buffer", buffer, count, dtype));
  return enqueue("recv", ready, [&](cudaStream_t s) {
    return nccl().Recv(buffer, count, nccl_type(dtype), peer, comm_, s);
  });
}

StatusOr<std::shared_ptr<Work>> NcclCommunicator::barrier(Stream* ready) {
  return enqueue("barrier", ready, [&](cudaStream_t s) {
    return nccl().AllReduce(barrier_scratch_, barrier_scratch_, 1, ncclFloat32, ncclSum, comm_, s);
  });
}

StatusOr<std::unique_ptr<Communicator>> NcclCommunicator::split(const std::vector<int32_t>& ranks,
                                                                std::string name) {
  const CommArgs a{"split", options_.name, size_};
  for (int32_t r : ranks) HPS_RETURN_IF_ERROR(check_rank_in_group(a, "rank", r));
  auto position = std::find(ranks.begin(), ranks.end(), rank_);
  const int color = position == ranks.end() ? NCCL_SPLIT_NOCOLOR : 0;
  const int key = position == ranks.end() ? 0 : static_cast<int>(position - ranks.begin());
  ncclConfig_t config = nonblocking_config();
  ncclComm_t child_comm = nullptr;
  HPS_RETURN_IF_ERROR(cuda::set_device(device_index_));
  HPS_RETURN_IF_ERROR(
      wait_ready(nccl().CommSplit(comm_, color, key, &child_comm, &config), "ncclCommSplit"));
  if (color == NCCL_SPLIT_NOCOLOR) return std::unique_ptr<Communicator>();
  CommOptions child_options = options_;
  child_options.name = std::move(name);
  std::unique_ptr<NcclCommunicator> child(new NcclCommunicator(
      key, static_cast<int32_t>(ranks.size()), device_index_, std::move(child_options)));
  child->comm_ = child_comm;
  HPS_ASSIGN_OR_RETURN(child->stream_, create_stream(device()));
  HPS_RETURN_IF_ERROR(
      cuda::cuda_status(cudaMalloc(&child->barrier_scratch_, sizeof(float)), "cudaMalloc"));
  child->watchdog_ = std::thread([c = child.get()] { c->watch(); });
  return std::unique_ptr<Communicator>(std::move(child));
}

void NcclCommunicator::abort() {
  std::lock_guard lock(mutex_);
  if (aborted_) return;
  aborted_ = true;
  failure_ = aborted("communicator '" + options_.name + "' was aborted");
  if (comm_ != nullptr) nccl().CommAbort(comm_);
  comm_ = nullptr;
  for (auto& p : pending_) p.work->set_status(failure_);
  pending_.clear();
}

}  // namespace hps::nccl_backend
