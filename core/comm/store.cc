// The rules every store shares: limits, timeouts and the arithmetic of `add`.
#include "core/comm/store.h"

#include <algorithm>
#include <charconv>

namespace hps {

Status store_timeout(std::string_view operation, const std::vector<std::string>& keys,
                     Milliseconds timeout) {
  std::string m = std::string(operation) + " timed out after " + std::to_string(timeout.count()) +
                  " ms waiting for key";
  m += keys.size() == 1 ? " " : "s ";
  for (size_t i = 0; i < keys.size(); ++i) {
    if (i) m += ", ";
    m += "'" + keys[i] + "'";
  }
  return timeout_error(std::move(m));
}

void WatchedStore::stop_watching() {
  std::lock_guard<std::mutex> lock(mu_);
  check_ = nullptr;
}

Status WatchedStore::watch() {
  std::lock_guard<std::mutex> lock(mu_);
  return check_ ? check_() : Status::Ok();
}

StatusOr<std::string> WatchedStore::get(std::string_view key, Milliseconds timeout) {
  HPS_RETURN_IF_ERROR(wait_in_slices("store get", {std::string(key)}, timeout));
  return ForwardingStore::get(key, timeout);
}

Status WatchedStore::wait(const std::vector<std::string>& keys, Milliseconds timeout) {
  return wait_in_slices("store wait", keys, timeout);
}

Status WatchedStore::wait_in_slices(std::string_view operation,
                                    const std::vector<std::string>& keys, Milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + clamp_store_wait(timeout);
  for (;;) {
    HPS_RETURN_IF_ERROR(watch());
    const auto left =
        std::chrono::duration_cast<Milliseconds>(deadline - Clock::now()) + Milliseconds(1);
    Status s = ForwardingStore::wait(keys, std::clamp(left, Milliseconds(1), kSlice));
    if (s.code() != StatusCode::kTimeout) return s;
    if (Clock::now() >= deadline) return store_timeout(operation, keys, timeout);
  }
}

AbortableStore::AbortableStore(std::shared_ptr<Store> inner)
    : AbortableStore(std::move(inner), std::make_shared<std::atomic<bool>>(false)) {}

AbortableStore::AbortableStore(std::shared_ptr<Store> inner,
                               std::shared_ptr<std::atomic<bool>> aborted)
    : WatchedStore(std::move(inner),
                   [aborted] { return aborted->load() ? aborted_error() : Status::Ok(); }),
      aborted_(std::move(aborted)) {}

Status AbortableStore::aborted_error() {
  return aborted("store: aborted (hps_store_abort): a rendezvous or wait over it ends here");
}

Status AbortableStore::refuse_if_aborted() const {
  return aborted_->load() ? aborted_error() : Status::Ok();
}

Status AbortableStore::set(std::string_view key, std::string_view value) {
  HPS_RETURN_IF_ERROR(refuse_if_aborted());
  return WatchedStore::set(key, value);
}

StatusOr<int64_t> AbortableStore::add(std::string_view key, int64_t delta) {
  HPS_RETURN_IF_ERROR(refuse_if_aborted());
  return WatchedStore::add(key, delta);
}

StatusOr<bool> AbortableStore::check(const std::vector<std::string>& keys) {
  HPS_RETURN_IF_ERROR(refuse_if_aborted());
  return WatchedStore::check(keys);
}

Status check_store_key(std::string_view key) {
  if (key.size() <= kMaxStoredKeyBytes) return Status::Ok();
  return invalid_argument("store: a key of " + std::to_string(key.size()) +
                          " bytes (with hpshard's prefixes) is longer than the limit of " +
                          std::to_string(kMaxStoredKeyBytes));
}

Status check_caller_key(std::string_view key) {
  if (key.size() <= kMaxStoreKeyBytes) return Status::Ok();
  return invalid_argument("store: a key of " + std::to_string(key.size()) +
                          " bytes is longer than the limit of " +
                          std::to_string(kMaxStoreKeyBytes));
}

Status check_store_value(std::string_view key, size_t value_bytes) {
  HPS_RETURN_IF_ERROR(check_store_key(key));
  if (value_bytes <= kMaxStoreValueBytes) return Status::Ok();
  return invalid_argument("store: the value of '" + std::string(key) + "' has " +
                          std::to_string(value_bytes) + " bytes, more than the limit of " +
                          std::to_string(kMaxStoreValueBytes));
}

Milliseconds clamp_store_wait(Milliseconds timeout) {
  return std::clamp(timeout, Milliseconds(0), kMaxStoreWait);
}

StatusOr<int64_t> store_add_result(std::string_view key, const std::string* current,
                                   int64_t delta) {
  int64_t value = 0;
  if (current != nullptr) {  // an empty value is no integer either
    // Strictly [-]digits: from_chars takes no sign '+', no spaces, and reports overflow.
    const char* first = current->data();
    const char* last = first + current->size();
    auto [end, error] = std::from_chars(first, last, value);
    if (error == std::errc::result_out_of_range) {
      return out_of_range("store add: key '" + std::string(key) +
                          "' holds an integer beyond the 64-bit range");
    }
    if (error != std::errc() || end != last) {
      return invalid_argument("store add: key '" + std::string(key) +
                              "' holds a value that is not an integer");
    }
  }
  int64_t result = 0;
  if (__builtin_add_overflow(value, delta, &result)) {
    return out_of_range("store add: key '" + std::string(key) + "' would overflow (" +
                        std::to_string(value) + " + " + std::to_string(delta) + ")");
  }
  return result;
}

}  // namespace hps
