// Store handles and rendezvous from the environment.
#include <algorithm>
#include <cstring>

#include "capi/src/error.h"
#include "capi/src/extensible.h"
#include "capi/src/handles.h"
#include "core/comm/rendezvous.h"

using hps::capi::guard;

namespace {

hps::StatusOr<hps::Milliseconds> to_timeout(int64_t timeout_ms) {
  if (timeout_ms <= 0) {
    return hps::invalid_argument("timeout_ms must be positive, not " + std::to_string(timeout_ms));
  }
  return hps::Milliseconds(timeout_ms);
}

void copy_text(char* out, size_t capacity, const std::string& text) {
  const size_t n = std::min(text.size(), capacity - 1);
  std::memcpy(out, text.data(), n);
  out[n] = '\0';
}

}  // namespace

extern "C" {

HPS_API hps_status_t hps_store_open(const char* url, int32_t rank, int64_t timeout_ms,
                                    hps_store_t** out_store) {
  HPS_CHECK_ARG(url);
  HPS_CHECK_ARG(out_store);
  return guard(__func__, [&]() -> hps::Status {
    HPS_ASSIGN_OR_RETURN(hps::Milliseconds timeout, to_timeout(timeout_ms));
    HPS_ASSIGN_OR_RETURN(auto store, hps::open_store(url, rank, timeout));
    *out_store = new hps_store{std::make_shared<hps::AbortableStore>(std::move(store))};
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_store_destroy(hps_store_t* store) {
  if (hps::capi::left_to_parent(store)) return HPS_STATUS_OK;
  return guard(__func__, [&]() -> hps::Status {
    delete store;
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_store_abort(hps_store_t* store) {
  HPS_CHECK_ARG(store);
  return guard(__func__, [&]() -> hps::Status {
    store->impl->abort();
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_store_set(hps_store_t* store, const char* key, const void* value,
                                   size_t size) {
  HPS_CHECK_ARG(store);
  HPS_CHECK_ARG(key);
  if (value == nullptr && size > 0) return hps::capi::fail_null(__func__, "value");
  return guard(__func__, [&]() -> hps::Status {
    HPS_RETURN_IF_ERROR(hps::check_caller_key(key));
    return store->impl->set(key, std::string_view(static_cast<const char*>(value), size));
  });
}

HPS_API hps_status_t hps_store_get(hps_store_t* store, const char* key, int64_t timeout_ms,
                                   void* buffer, size_t capacity, size_t* out_size) {
  HPS_CHECK_ARG(store);
  HPS_CHECK_ARG(key);
  HPS_CHECK_ARG(out_size);
  return guard(__func__, [&]() -> hps::Status {
    HPS_RETURN_IF_ERROR(hps::check_caller_key(key));
    HPS_ASSIGN_OR_RETURN(hps::Milliseconds timeout, to_timeout(timeout_ms));
    HPS_ASSIGN_OR_RETURN(std::string value, store->impl->get(key, timeout));
    *out_size = value.size();
    if (buffer == nullptr || capacity < value.size()) {
      return hps::out_of_range("the value of '" + std::string(key) + "' has " +
                               std::to_string(value.size()) + " bytes; the buffer holds " +
                               std::to_string(buffer ? capacity : 0));
    }
    std::memcpy(buffer, value.data(), value.size());
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_store_add(hps_store_t* store, const char* key, int64_t delta,
                                   int64_t* out_value) {
  HPS_CHECK_ARG(store);
  HPS_CHECK_ARG(key);
  HPS_CHECK_ARG(out_value);
  return guard(__func__, [&]() -> hps::Status {
    HPS_RETURN_IF_ERROR(hps::check_caller_key(key));
    HPS_ASSIGN_OR_RETURN(*out_value, store->impl->add(key, delta));
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_store_wait(hps_store_t* store, const char* key, int64_t timeout_ms) {
  HPS_CHECK_ARG(store);
  HPS_CHECK_ARG(key);
  return guard(__func__, [&]() -> hps::Status {
    HPS_RETURN_IF_ERROR(hps::check_caller_key(key));
    HPS_ASSIGN_OR_RETURN(hps::Milliseconds timeout, to_timeout(timeout_ms));
    return store->impl->wait({key}, timeout);
  });
}

HPS_API hps_status_t hps_store_check(hps_store_t* store, const char* key, int32_t* out_present) {
  HPS_CHECK_ARG(store);
  HPS_CHECK_ARG(key);
  HPS_CHECK_ARG(out_present);
  return guard(__func__, [&]() -> hps::Status {
    HPS_RETURN_IF_ERROR(hps::check_caller_key(key));
    HPS_ASSIGN_OR_RETURN(bool present, store->impl->check({key}));
    *out_present = present ? 1 : 0;
    return hps::Status::Ok();
  });
}

HPS_API hps_status_t hps_rendezvous_info_init(hps_rendezvous_info_t* info, size_t struct_size) {
  HPS_CHECK_ARG(info);
  return guard(__func__, [&] {
    return hps::capi::init_struct(info, struct_size, hps::capi::zeroed<hps_rendezvous_info_t>());
  });
}

HPS_API hps_status_t hps_rendezvous_from_env(hps_rendezvous_info_t* info) {
  HPS_CHECK_ARG(info);
  return guard(__func__, [&]() -> hps::Status {
    HPS_RETURN_IF_ERROR(hps::capi::caller_struct_size(info, "info").status());
    HPS_ASSIGN_OR_RETURN(hps::RendezvousInfo r, hps::rendezvous_from_env());
    auto out = hps::capi::zeroed<hps_rendezvous_info_t>();
    if (r.store_url.size() >= sizeof out.store_url) {
      return hps::invalid_argument("the store URL the environment gives (" + r.source +
                                   ") is longer than " + std::to_string(sizeof out.store_url - 1) +
                                   " bytes");
    }
    out.rank = r.rank;
    out.world_size = r.world_size;
    out.local_rank = r.local_rank;
    copy_text(out.store_url, sizeof out.store_url, r.store_url);
    copy_text(out.source, sizeof out.source, r.source);
    return hps::capi::write_struct(info, out, "info");
  });
}

}  // extern "C"
