// Communicator and work handles.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "capi/src/dlpack.h"
#include "capi/src/error.h"
#include "capi/src/extensible.h"
#include "capi/src/handles.h"

using hps::capi::guard;
using hps::capi::raw_enum;

namespace {

hps::StatusOr<hps::DType> to_dtype(const hps_dtype_t& dtype) {
  return hps::dtype_from_int(raw_enum(dtype));
}

hps::StatusOr<hps::ReduceOp> to_op(const hps_reduce_op_t& op) {
  return hps::reduce_op_from_int(raw_enum(op));
}

hps::Stream* ready_stream(hps_stream_t* ready) { return ready ? ready->impl.get() : nullptr; }

hps::Status hand_out(hps::StatusOr<std::shared_ptr<hps::Work>> work, hps_work_t** out_work) {
  if (!work.ok()) return work.status();
  *out_work = new hps_work{std::move(work).value()};
  return hps::Status::Ok();
}

hps::Status check_capacity(const char* operation, const char* which, uint64_t have, uint64_t need) {
  if (have >= need) return hps::Status::Ok();
  return hps::invalid_argument(std::string(operation) + ": " + which + " holds " +
                               std::to_string(have) + " elements but needs " +
                               std::to_string(need) + " (size x count); nothing was sent");
}

// a * b, or an error when it overflows.
hps::StatusOr<uint64_t> times(uint64_t a, int32_t b, const char* operation) {
  const auto n = static_cast<uint64_t>(b);
  if (n != 0 && a > UINT64_MAX / n) {
    return hps::invalid_argument(std::string(operation) + ": the count overflows");
  }
  return a * n;
}

// The defaults hps_comm_options_init sets (the environment's, name NULL = "world").
hps::StatusOr<hps_comm_options_t> default_options() {
  HPS_ASSIGN_OR_RETURN(hps::CommOptions defaults, hps::comm_options_from_env());
  auto o = hps::capi::zeroed<hps_comm_options_t>();
  o.timeout_ms = defaults.timeout.count();
  o.check_arguments = defaults.check_arguments ? 1 : 0;
  o.name = nullptr;
  return o;
}

// A DLPack operand of a collective, checked and on the communicator's device.
hps::StatusOr<hps::capi::TensorArg> operand(const hps_comm& comm, const DLTensor* tensor,
                                            const char* what) {
  HPS_ASSIGN_OR_RETURN(hps::capi::TensorArg arg, hps::capi::tensor_arg(tensor, what));
  HPS_RETURN_IF_ERROR(hps::capi::check_device(arg, what, comm.impl->device()));
  return arg;
}

hps::Status same_count(const char* operation, const hps::capi::TensorArg& send,
                       const hps::capi::TensorArg& recv) {
  if (send.count == recv.count) return hps::Status::Ok();
  return hps::invalid_argument(std::string(operation) + ": send has " + std::to_string(send.count) +
                               " elements, recv " + std::to_string(recv.count) +
                               "; nothing was sent");
}

}  // namespace

extern "C" {

HPS_API hps_status_t hps_comm_options_init(hps_comm_options_t* options, size_t struct_size) {
  HPS_CHECK_ARG(options);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(hps_comm_options_t defaults, default_options());
    return hps::capi::init_struct(options, struct_size, defaults);
  });
}

HPS_API hps_status_t hps_comm_create(hps_store_t* store, int32_t rank, int32_t size,
                                     hps_device_type_t type, int32_t device_index,
                                     const hps_comm_options_t* options, hps_comm_t** out_comm) {
  HPS_CHECK_ARG(store);
  HPS_CHECK_ARG(out_comm);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(hps::DeviceType t, hps::device_type_from_int(raw_enum(type)));
    HPS_ASSIGN_OR_RETURN(hps::CommOptions o, hps::comm_options_from_env());
    if (options != nullptr) {
      HPS_ASSIGN_OR_RETURN(hps_comm_options_t defaults, default_options());
      HPS_ASSIGN_OR_RETURN(const hps_comm_options_t given,
                           hps::capi::read_struct(options, defaults, "options"));
      if (given.timeout_ms <= 0)
        return hps::invalid_argument("options->timeout_ms must be positive");
      o.timeout = hps::Milliseconds(given.timeout_ms);
      o.check_arguments = given.check_arguments != 0;
      if (given.name != nullptr) o.name = given.name;
    }
    HPS_ASSIGN_OR_RETURN(auto comm,
                         hps::create_communicator(store->impl, rank, size, {t, device_index}, o));
    *out_comm = new hps_comm{std::shared_ptr<hps::Communicator>(std::move(comm))};
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_comm_destroy(hps_comm_t* comm) {
  if (hps::capi::left_to_parent(comm)) return HPS_STATUS_OK;
  return guard(__func__, [&]() -> hps::Status {
    delete comm;
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_comm_finish(hps_comm_t* comm) {
  HPS_CHECK_ARG(comm);
  return guard(__func__, [&] { return comm->impl->finish(); });
}

HPS_API hps_status_t hps_comm_abort(hps_comm_t* comm) {
  HPS_CHECK_ARG(comm);
  return guard(__func__, [&]() -> hps::Status {
    comm->impl->abort();
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_comm_rank(hps_comm_t* comm, int32_t* out_rank) {
  HPS_CHECK_ARG(comm);
  HPS_CHECK_ARG(out_rank);
  *out_rank = comm->impl->rank();
  return HPS_STATUS_OK;
}

HPS_API hps_status_t hps_comm_size(hps_comm_t* comm, int32_t* out_size) {
  HPS_CHECK_ARG(comm);
  HPS_CHECK_ARG(out_size);
  *out_size = comm->impl->size();
  return HPS_STATUS_OK;
}

HPS_API hps_status_t hps_comm_device(hps_comm_t* comm, hps_device_type_t* out_type,
                                     int32_t* out_index) {
  HPS_CHECK_ARG(comm);
  HPS_CHECK_ARG(out_type);
  HPS_CHECK_ARG(out_index);
  const hps::Device device = comm->impl->device();
  *out_type = static_cast<hps_device_type_t>(device.type);
  *out_index = device.index;
  return HPS_STATUS_OK;
}

HPS_API hps_status_t hps_comm_transport(hps_comm_t* comm, const char** out_name) {
  HPS_CHECK_ARG(comm);
  HPS_CHECK_ARG(out_name);
  // transport() views a string literal: NUL-terminated, static storage.
  *out_name = comm->impl->transport().data();
  return HPS_STATUS_OK;
}

HPS_API hps_status_t hps_comm_set_timeout(hps_comm_t* comm, int64_t timeout_ms) {
  HPS_CHECK_ARG(comm);
  return guard(__func__, [&]() -> hps::Status {
    HPS_RETURN_IF_ERROR(hps::check_comm_timeout(hps::Milliseconds(timeout_ms), "timeout_ms"));
    comm->impl->set_timeout(hps::Milliseconds(timeout_ms));
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_comm_split(hps_comm_t* comm, const int32_t* ranks, size_t count,
                                    const char* name, hps_comm_t** out_comm) {
  HPS_CHECK_ARG(comm);
  HPS_CHECK_ARG(ranks);
  HPS_CHECK_ARG(name);
  HPS_CHECK_ARG(out_comm);
  return guard(__func__, [&]() -> hps::Status {
    // A count beyond the group's size is refused with the list unread, on every rank.
    HPS_ASSIGN_OR_RETURN(auto child, comm->impl->split(ranks, count, name));
    *out_comm =
        child ? new hps_comm{std::shared_ptr<hps::Communicator>(std::move(child))} : nullptr;
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_comm_all_reduce(hps_comm_t* comm, const void* send, void* recv,
                                         uint64_t count, hps_dtype_t dtype, hps_reduce_op_t op,
                                         hps_stream_t* ready, hps_work_t** out_work) {
  HPS_CHECK_ARG(comm);
  HPS_CHECK_ARG(out_work);
  HPS_CHECK_OPTIONAL_ARG(ready);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(hps::DType d, to_dtype(dtype));
    HPS_ASSIGN_OR_RETURN(hps::ReduceOp o, to_op(op));
    return hand_out(comm->impl->all_reduce(send, recv, count, d, o, ready_stream(ready)), out_work);
  });
}

HPS_API hps_status_t hps_comm_reduce(hps_comm_t* comm, const void* send, void* recv, uint64_t count,
                                     hps_dtype_t dtype, hps_reduce_op_t op, int32_t root,
                                     hps_stream_t* ready, hps_work_t** out_work) {
  HPS_CHECK_ARG(comm);
  HPS_CHECK_ARG(out_work);
  HPS_CHECK_OPTIONAL_ARG(ready);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(hps::DType d, to_dtype(dtype));
    HPS_ASSIGN_OR_RETURN(hps::ReduceOp o, to_op(op));
    return hand_out(comm->impl->reduce(send, recv, count, d, o, root, ready_stream(ready)),
                    out_work);
  });
}

HPS_API hps_status_t hps_comm_broadcast(hps_comm_t* comm, void* buffer, uint64_t count,
                                        hps_dtype_t dtype, int32_t root, hps_stream_t* ready,
                                        hps_work_t** out_work) {
  HPS_CHECK_ARG(comm);
  HPS_CHECK_ARG(out_work);
  HPS_CHECK_OPTIONAL_ARG(ready);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(hps::DType d, to_dtype(dtype));
    return hand_out(comm->impl->broadcast(buffer, count, d, root, ready_stream(ready)), out_work);
  });
}

HPS_API hps_status_t hps_comm_all_gather(hps_comm_t* comm, const void* send, uint64_t send_count,
                                         void* recv, uint64_t recv_count, hps_dtype_t dtype,
                                         hps_stream_t* ready, hps_work_t** out_work) {
  HPS_CHECK_ARG(comm);
  HPS_CHECK_ARG(out_work);
  HPS_CHECK_OPTIONAL_ARG(ready);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(hps::DType d, to_dtype(dtype));
    HPS_ASSIGN_OR_RETURN(uint64_t need, times(send_count, comm->impl->size(), "all_gather"));
    HPS_RETURN_IF_ERROR(check_capacity("all_gather", "recv", recv_count, need));
    return hand_out(comm->impl->all_gather(send, recv, send_count, d, ready_stream(ready)),
                    out_work);
  });
}

HPS_API hps_status_t hps_comm_reduce_scatter(hps_comm_t* comm, const void* send,
                                             uint64_t send_count, void* recv, uint64_t recv_count,
                                             hps_dtype_t dtype, hps_reduce_op_t op,
                                             hps_stream_t* ready, hps_work_t** out_work) {
  HPS_CHECK_ARG(comm);
  HPS_CHECK_ARG(out_work);
  HPS_CHECK_OPTIONAL_ARG(ready);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(hps::DType d, to_dtype(dtype));
    HPS_ASSIGN_OR_RETURN(hps::ReduceOp o, to_op(op));
    HPS_ASSIGN_OR_RETURN(uint64_t need, times(recv_count, comm->impl->size(), "reduce_scatter"));
    HPS_RETURN_IF_ERROR(check_capacity("reduce_scatter", "send", send_count, need));
    return hand_out(comm->impl->reduce_scatter(send, recv, recv_count, d, o, ready_stream(ready)),
                    out_work);
  });
}

HPS_API hps_status_t hps_comm_send(hps_comm_t* comm, const void* buffer, uint64_t count,
                                   hps_dtype_t dtype, int32_t peer, hps_stream_t* ready,
                                   hps_work_t** out_work) {
  HPS_CHECK_ARG(comm);
  HPS_CHECK_ARG(out_work);
  HPS_CHECK_OPTIONAL_ARG(ready);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(hps::DType d, to_dtype(dtype));
    return hand_out(comm->impl->send(buffer, count, d, peer, ready_stream(ready)), out_work);
  });
}

HPS_API hps_status_t hps_comm_recv(hps_comm_t* comm, void* buffer, uint64_t count,
                                   hps_dtype_t dtype, int32_t peer, hps_stream_t* ready,
                                   hps_work_t** out_work) {
  HPS_CHECK_ARG(comm);
  HPS_CHECK_ARG(out_work);
  HPS_CHECK_OPTIONAL_ARG(ready);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(hps::DType d, to_dtype(dtype));
    return hand_out(comm->impl->recv(buffer, count, d, peer, ready_stream(ready)), out_work);
  });
}

HPS_API hps_status_t hps_comm_barrier(hps_comm_t* comm, hps_stream_t* ready,
                                      hps_work_t** out_work) {
  HPS_CHECK_ARG(comm);
  HPS_CHECK_ARG(out_work);
  HPS_CHECK_OPTIONAL_ARG(ready);
  return guard(__func__,
               [&] { return hand_out(comm->impl->barrier(ready_stream(ready)), out_work); });
}

HPS_API hps_status_t hps_comm_all_reduce_dlpack(hps_comm_t* comm, const DLTensor* send,
                                                const DLTensor* recv, hps_reduce_op_t op,
                                                hps_stream_t* ready, hps_work_t** out_work) {
  HPS_CHECK_ARG(comm);
  HPS_CHECK_ARG(out_work);
  HPS_CHECK_OPTIONAL_ARG(ready);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(auto s, operand(*comm, send, "send"));
    HPS_ASSIGN_OR_RETURN(auto r, operand(*comm, recv, "recv"));
    HPS_RETURN_IF_ERROR(hps::capi::check_same_dtype(s, "send", r, "recv"));
    HPS_RETURN_IF_ERROR(same_count("all_reduce", s, r));
    HPS_ASSIGN_OR_RETURN(hps::ReduceOp o, to_op(op));
    return hand_out(
        comm->impl->all_reduce(s.data, r.data, s.count, s.dtype, o, ready_stream(ready)), out_work);
  });
}

HPS_API hps_status_t hps_comm_reduce_dlpack(hps_comm_t* comm, const DLTensor* send,
                                            const DLTensor* recv, hps_reduce_op_t op, int32_t root,
                                            hps_stream_t* ready, hps_work_t** out_work) {
  HPS_CHECK_ARG(comm);
  HPS_CHECK_ARG(out_work);
  HPS_CHECK_OPTIONAL_ARG(ready);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(auto s, operand(*comm, send, "send"));
    void* recv_data = nullptr;
    if (recv != nullptr) {
      HPS_ASSIGN_OR_RETURN(auto r, operand(*comm, recv, "recv"));
      HPS_RETURN_IF_ERROR(hps::capi::check_same_dtype(s, "send", r, "recv"));
      HPS_RETURN_IF_ERROR(same_count("reduce", s, r));
      recv_data = r.data;
    }
    HPS_ASSIGN_OR_RETURN(hps::ReduceOp o, to_op(op));
    return hand_out(
        comm->impl->reduce(s.data, recv_data, s.count, s.dtype, o, root, ready_stream(ready)),
        out_work);
  });
}

HPS_API hps_status_t hps_comm_broadcast_dlpack(hps_comm_t* comm, const DLTensor* buffer,
                                               int32_t root, hps_stream_t* ready,
                                               hps_work_t** out_work) {
  HPS_CHECK_ARG(comm);
  HPS_CHECK_ARG(out_work);
  HPS_CHECK_OPTIONAL_ARG(ready);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(auto b, operand(*comm, buffer, "buffer"));
    return hand_out(comm->impl->broadcast(b.data, b.count, b.dtype, root, ready_stream(ready)),
                    out_work);
  });
}

HPS_API hps_status_t hps_comm_all_gather_dlpack(hps_comm_t* comm, const DLTensor* send,
                                                const DLTensor* recv, hps_stream_t* ready,
                                                hps_work_t** out_work) {
  HPS_CHECK_ARG(comm);
  HPS_CHECK_ARG(out_work);
  HPS_CHECK_OPTIONAL_ARG(ready);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(auto s, operand(*comm, send, "send"));
    HPS_ASSIGN_OR_RETURN(auto r, operand(*comm, recv, "recv"));
    HPS_RETURN_IF_ERROR(hps::capi::check_same_dtype(s, "send", r, "recv"));
    HPS_ASSIGN_OR_RETURN(uint64_t need, times(s.count, comm->impl->size(), "all_gather"));
    HPS_RETURN_IF_ERROR(check_capacity("all_gather", "recv", r.count, need));
    return hand_out(comm->impl->all_gather(s.data, r.data, s.count, s.dtype, ready_stream(ready)),
                    out_work);
  });
}

HPS_API hps_status_t hps_comm_reduce_scatter_dlpack(hps_comm_t* comm, const DLTensor* send,
                                                    const DLTensor* recv, hps_reduce_op_t op,
                                                    hps_stream_t* ready, hps_work_t** out_work) {
  HPS_CHECK_ARG(comm);
  HPS_CHECK_ARG(out_work);
  HPS_CHECK_OPTIONAL_ARG(ready);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(auto s, operand(*comm, send, "send"));
    HPS_ASSIGN_OR_RETURN(auto r, operand(*comm, recv, "recv"));
    HPS_RETURN_IF_ERROR(hps::capi::check_same_dtype(s, "send", r, "recv"));
    HPS_ASSIGN_OR_RETURN(hps::ReduceOp o, to_op(op));
    HPS_ASSIGN_OR_RETURN(uint64_t need, times(r.count, comm->impl->size(), "reduce_scatter"));
    HPS_RETURN_IF_ERROR(check_capacity("reduce_scatter", "send", s.count, need));
    return hand_out(
        comm->impl->reduce_scatter(s.data, r.data, r.count, s.dtype, o, ready_stream(ready)),
        out_work);
  });
}

HPS_API hps_status_t hps_comm_send_dlpack(hps_comm_t* comm, const DLTensor* buffer, int32_t peer,
                                          hps_stream_t* ready, hps_work_t** out_work) {
  HPS_CHECK_ARG(comm);
  HPS_CHECK_ARG(out_work);
  HPS_CHECK_OPTIONAL_ARG(ready);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(auto b, operand(*comm, buffer, "buffer"));
    return hand_out(comm->impl->send(b.data, b.count, b.dtype, peer, ready_stream(ready)),
                    out_work);
  });
}

HPS_API hps_status_t hps_comm_recv_dlpack(hps_comm_t* comm, const DLTensor* buffer, int32_t peer,
                                          hps_stream_t* ready, hps_work_t** out_work) {
  HPS_CHECK_ARG(comm);
  HPS_CHECK_ARG(out_work);
  HPS_CHECK_OPTIONAL_ARG(ready);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(auto b, operand(*comm, buffer, "buffer"));
    return hand_out(comm->impl->recv(b.data, b.count, b.dtype, peer, ready_stream(ready)),
                    out_work);
  });
}

HPS_API hps_status_t hps_work_test(hps_work_t* work, int32_t* out_completed) {
  HPS_CHECK_ARG(work);
  HPS_CHECK_ARG(out_completed);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(bool done, work->impl->test());
    *out_completed = done ? 1 : 0;
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_work_wait(hps_work_t* work) {
  HPS_CHECK_ARG(work);
  return guard(__func__, [&] { return work->impl->wait(); });
}

HPS_API hps_status_t hps_work_wait_timeout(hps_work_t* work, int64_t timeout_ms,
                                           int32_t* out_completed) {
  HPS_CHECK_ARG(work);
  HPS_CHECK_ARG(out_completed);
  return guard(__func__, [&]() -> hps::Status {
    if (timeout_ms < 0) {
      return hps::invalid_argument("hps_work_wait_timeout: timeout_ms is " +
                                   std::to_string(timeout_ms) + ", not >= 0");
    }
    // About 35 years: longer ones would overflow the clock's nanoseconds.
    constexpr int64_t kLongest = int64_t{1} << 40;
    // An error is the finished operation's (its failure), returned with *out_completed
    // untouched, as hps_work_test does.
    HPS_ASSIGN_OR_RETURN(
        bool done, work->impl->wait_for(std::chrono::milliseconds(std::min(timeout_ms, kLongest))));
    *out_completed = done ? 1 : 0;
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_work_wait_stream(hps_work_t* work, hps_stream_t* stream) {
  HPS_CHECK_ARG(work);
  HPS_CHECK_ARG(stream);
  return guard(__func__, [&] { return work->impl->wait_on(*stream->impl); });
}

HPS_API hps_status_t hps_work_destroy(hps_work_t* work) {
  if (hps::capi::left_to_parent(work)) return HPS_STATUS_OK;
  return guard(__func__, [&]() -> hps::Status {
    delete work;
    return hps::Status::Ok();
  });
}

}  // extern "C"
