#include <condition_variable>
#include <map>
#include <mutex>

#include "core/comm/store.h"

namespace hps {
namespace {

class InMemoryStore final : public Store {
 public:
  Status set(std::string_view key, std::string_view value) override {
    {
      std::lock_guard lock(mutex_);
      values_[std::string(key)] = std::string(value);
    }
    changed_.notify_all();
    return Status::Ok();
  }

  StatusOr<std::string> get(std::string_view key, Milliseconds timeout) override {
    const std::vector<std::string> keys{std::string(key)};
    std::unique_lock lock(mutex_);
    if (!changed_.wait_for(lock, timeout, [&] { return all_set(keys); })) {
      return store_timeout("store get", keys, timeout);
    }
    return values_.find(keys[0])->second;
  }

  StatusOr<int64_t> add(std::string_view key, int64_t delta) override {
    int64_t result = 0;
    {
      std::lock_guard lock(mutex_);
      std::string& slot = values_[std::string(key)];
      int64_t current = 0;
      if (!slot.empty()) {
        try {
          current = std::stoll(slot);
        } catch (const std::exception&) {
          return invalid_argument("store add: key '" + std::string(key) +
                                  "' holds a value that is not an integer");
        }
      }
      result = current + delta;
      slot = std::to_string(result);
    }
    changed_.notify_all();
    return result;
  }

  Status wait(const std::vector<std::string>& keys, Milliseconds timeout) override {
    std::unique_lock lock(mutex_);
    if (!changed_.wait_for(lock, timeout, [&] { return all_set(keys); })) {
      return store_timeout("store wait", keys, timeout);
    }
    return Status::Ok();
  }

  StatusOr<bool> check(const std::vector<std::string>& keys) override {
    std::lock_guard lock(mutex_);
    return all_set(keys);
  }

 private:
  bool all_set(const std::vector<std::string>& keys) const {
    for (const auto& k : keys) {
      if (values_.find(k) == values_.end()) return false;
    }
    return true;
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, std::string> values_;
};

class PrefixStore final : public Store {
 public:
  PrefixStore(std::shared_ptr<Store> base, std::string prefix)
      : base_(std::move(base)), prefix_(std::move(prefix) + "/") {}

  Status set(std::string_view key, std::string_view value) override {
    return base_->set(prefixed(key), value);
  }
  StatusOr<std::string> get(std::string_view key, Milliseconds timeout) override {
    return base_->get(prefixed(key), timeout);
  }
  StatusOr<int64_t> add(std::string_view key, int64_t delta) override {
    return base_->add(prefixed(key), delta);
  }
  Status wait(const std::vector<std::string>& keys, Milliseconds timeout) override {
    return base_->wait(prefixed(keys), timeout);
  }
  StatusOr<bool> check(const std::vector<std::string>& keys) override {
    return base_->check(prefixed(keys));
  }

 private:
  std::string prefixed(std::string_view key) const { return prefix_ + std::string(key); }
  std::vector<std::string> prefixed(const std::vector<std::string>& keys) const {
    std::vector<std::string> out;
    out.reserve(keys.size());
    for (const auto& k : keys) out.push_back(prefixed(k));
    return out;
  }

  std::shared_ptr<Store> base_;
  std::string prefix_;
};

}  // namespace

std::shared_ptr<Store> make_in_memory_store() { return std::make_shared<InMemoryStore>(); }

std::shared_ptr<Store> make_prefix_store(std::shared_ptr<Store> base, std::string prefix) {
  return std::make_shared<PrefixStore>(std::move(base), std::move(prefix));
}

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

}  // namespace hps
