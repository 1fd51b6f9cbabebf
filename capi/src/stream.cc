// Stream and event handles.
#include "core/device/stream.h"

#include <memory>

#include "capi/src/error.h"
#include "capi/src/handles.h"

using hps::capi::guard;

namespace {

hps::StatusOr<hps::Device> to_device(int32_t raw_type, int32_t index) {
  HPS_ASSIGN_OR_RETURN(hps::DeviceType t, hps::device_type_from_int(raw_type));
  return hps::Device{t, index};
}

}  // namespace

extern "C" {

HPS_API hps_status_t hps_stream_create(hps_device_type_t type, int32_t index,
                                       hps_stream_t** out_stream) {
  HPS_CHECK_ARG(out_stream);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(hps::Device device, to_device(hps::capi::raw_enum(type), index));
    HPS_ASSIGN_OR_RETURN(auto impl, hps::create_stream(device));
    *out_stream = new hps_stream{std::move(impl)};
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_stream_destroy(hps_stream_t* stream) {
  if (hps::capi::left_to_parent(stream)) return HPS_STATUS_OK;
  return guard(__func__, [&]() -> hps::Status {
    // An engine keeping the stream alive: the queued work still finishes now, as documented.
    const hps::Status finished = stream != nullptr && stream->impl.use_count() > 1
                                     ? stream->impl->synchronize()
                                     : hps::Status::Ok();
    delete stream;
    return finished;
  });
}

HPS_API hps_status_t hps_stream_synchronize(hps_stream_t* stream) {
  HPS_CHECK_ARG(stream);
  return guard(__func__, [&] { return stream->impl->synchronize(); });
}

HPS_API hps_status_t hps_stream_wait_event(hps_stream_t* stream, hps_event_t* event) {
  HPS_CHECK_ARG(stream);
  HPS_CHECK_ARG(event);
  return guard(__func__, [&] { return stream->impl->wait(*event->impl); });
}

HPS_API hps_status_t hps_memcpy_async(void* dst, const void* src, size_t bytes,
                                      hps_stream_t* stream) {
  HPS_CHECK_ARG(stream);
  return guard(__func__, [&] { return stream->impl->memcpy_async(dst, src, bytes); });
}

HPS_API hps_status_t hps_event_create(hps_device_type_t type, int32_t index,
                                      hps_event_t** out_event) {
  HPS_CHECK_ARG(out_event);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(hps::Device device, to_device(hps::capi::raw_enum(type), index));
    HPS_ASSIGN_OR_RETURN(auto impl, hps::create_event(device));
    *out_event = new hps_event{std::move(impl)};
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_event_destroy(hps_event_t* event) {
  if (hps::capi::left_to_parent(event)) return HPS_STATUS_OK;
  return guard(__func__, [&]() -> hps::Status {
    delete event;
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_event_record(hps_event_t* event, hps_stream_t* stream) {
  HPS_CHECK_ARG(event);
  HPS_CHECK_ARG(stream);
  return guard(__func__, [&] { return event->impl->record(*stream->impl); });
}

HPS_API hps_status_t hps_event_query(hps_event_t* event, int32_t* out_completed) {
  HPS_CHECK_ARG(event);
  HPS_CHECK_ARG(out_completed);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(bool completed, event->impl->query());
    *out_completed = completed ? 1 : 0;
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_event_synchronize(hps_event_t* event) {
  HPS_CHECK_ARG(event);
  return guard(__func__, [&] { return event->impl->synchronize(); });
}

}  // extern "C"
