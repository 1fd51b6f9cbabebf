#include <condition_variable>
#include <map>
#include <mutex>

#include "core/comm/store.h"

namespace hps {
namespace {

class InMemoryStore final : public Store {
 public:
  Status set(std::string_view key, std::string_view value) override {
    HPS_RETURN_IF_ERROR(check_store_value(key, value.size()));
    {
      std::lock_guard lock(mutex_);
      values_[std::string(key)] = std::string(value);
    }
    changed_.notify_all();
    return Status::Ok();
  }

  StatusOr<std::string> get(std::string_view key, Milliseconds timeout) override {
    HPS_RETURN_IF_ERROR(check_store_key(key));
    timeout = clamp_store_wait(timeout);
    const std::vector<std::string> keys{std::string(key)};
    std::unique_lock lock(mutex_);
    if (!changed_.wait_for(lock, timeout, [&] { return all_set(keys); })) {
      return store_timeout("store get", keys, timeout);
    }
    return values_.find(keys[0])->second;
  }

  StatusOr<int64_t> add(std::string_view key, int64_t delta) override {
    HPS_RETURN_IF_ERROR(check_store_key(key));
    int64_t result = 0;
    {
      std::lock_guard lock(mutex_);
      auto it = values_.find(std::string(key));
      HPS_ASSIGN_OR_RETURN(
          result, store_add_result(key, it == values_.end() ? nullptr : &it->second, delta));
      values_[std::string(key)] = std::to_string(result);
    }
    changed_.notify_all();
    return result;
  }

  Status wait(const std::vector<std::string>& keys, Milliseconds timeout) override {
    for (const auto& k : keys) HPS_RETURN_IF_ERROR(check_store_key(k));
    timeout = clamp_store_wait(timeout);
    std::unique_lock lock(mutex_);
    if (!changed_.wait_for(lock, timeout, [&] { return all_set(keys); })) {
      return store_timeout("store wait", keys, timeout);
    }
    return Status::Ok();
  }

  StatusOr<bool> check(const std::vector<std::string>& keys) override {
    for (const auto& k : keys) HPS_RETURN_IF_ERROR(check_store_key(k));
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
  void abandon_peers() override { base_->abandon_peers(); }
  void drop_idle_connections() override { base_->drop_idle_connections(); }

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

}  // namespace hps
