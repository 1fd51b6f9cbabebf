#include "core/storage/full_buffer_pool.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "core/common/env.h"
#include "core/common/logging.h"
#include "core/device/cpu/stream.h"

namespace hps {
namespace {

size_t page_rounded(size_t bytes) {
  const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (std::max<size_t>(bytes, 1) + page - 1) / page * page;
}

}  // namespace

StatusOr<bool> debug_views_from_env() { return env_flag("HPS_DEBUG_VIEWS", false); }

FullBuffer::~FullBuffer() {
  // Dropped without give_back (an engine torn down after synchronizing): no work uses it.
  if (memory_ != nullptr) pool_->free_now(memory_, bytes_);
}

FullBufferPool::FullBufferPool(Device device, bool checked)
    : device_(device), checked_(checked && device.type == DeviceType::kCpu) {
  auto allocator = allocator_for(device);
  if (allocator.ok()) allocator_ = *allocator;
}

FullBufferPool::~FullBufferPool() {
  for (Pooled& p : pooled_) {
    if (p.ready) (void)p.ready->synchronize_uncounted();  // teardown only
    free_now(p.memory, p.bytes);
  }
}

StatusOr<void*> FullBufferPool::allocate_fresh(size_t bytes, Stream& user) {
  ++fresh_;
  if (checked_) {
    void* memory = mmap(nullptr, page_rounded(bytes), PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (memory == MAP_FAILED) {
      return out_of_memory("full buffer of " + std::to_string(bytes) +
                           " bytes (HPS_DEBUG_VIEWS mapping): " + std::strerror(errno));
    }
    return memory;
  }
  if (allocator_ == nullptr) return unavailable("full buffer pool: no allocator for the device");
  return allocator_->allocate_async(bytes, user);
}

void FullBufferPool::free_now(void* memory, size_t bytes) {
  if (checked_) {
    munmap(memory, page_rounded(bytes));
    return;
  }
  allocator_->deallocate(memory);
}

void FullBufferPool::trim(uint64_t incoming, Stream& user) {
  auto over = [&] { return lent_bytes_ + pooled_bytes_ + incoming > budget_; };
  // Completed buffers first. Freed in `user`'s order too: a device's immediate free (CUDA's
  // cudaFree) waits for everything queued on the device, a host sync in every step whose
  // units differ in size.
  for (auto it = pooled_.begin(); it != pooled_.end() && over();) {
    auto done = it->ready ? it->ready->query() : StatusOr<bool>(true);
    if (done.ok() && *done) {
      pooled_bytes_ -= it->bytes;
      if (checked_) {
        free_now(it->memory, it->bytes);
      } else {
        allocator_->deallocate_async(it->memory, user);
      }
      it = pooled_.erase(it);
    } else {
      ++it;
    }
  }
  while (over() && !pooled_.empty()) {
    Pooled& p = pooled_.front();
    // Freed in `user`'s order, after its last use: no host wait.
    if (user.wait(*p.ready).ok()) {
      allocator_->deallocate_async(p.memory, user);
    } else {
      (void)p.ready->synchronize_uncounted();
      free_now(p.memory, p.bytes);
    }
    pooled_bytes_ -= p.bytes;
    pooled_.erase(pooled_.begin());
  }
}

StatusOr<std::unique_ptr<FullBuffer>> FullBufferPool::take(size_t bytes, Stream& user) {
  ++takes_;
  std::unique_ptr<Event> ready;
  void* memory = nullptr;
  if (!checked_) {
    // The same size only: a larger buffer would hold more than needed and let the resident
    // bytes creep up. A completed one first; a busy one when the budget is reached.
    auto fits = [&](const Pooled& p) { return p.bytes == bytes; };
    auto completed = [&](const Pooled& p) {
      if (!fits(p)) return false;
      if (!p.ready) return true;
      auto done = p.ready->query();
      return done.ok() && *done;
    };
    auto it = std::find_if(pooled_.begin(), pooled_.end(), completed);
    if (it == pooled_.end() && lent_bytes_ + pooled_bytes_ + bytes > budget_) {
      it = std::find_if(pooled_.begin(), pooled_.end(), fits);
      if (it != pooled_.end()) HPS_RETURN_IF_ERROR(user.wait(*it->ready));
    }
    if (it != pooled_.end()) {
      memory = it->memory;
      ready = std::move(it->ready);
      pooled_bytes_ -= it->bytes;
      pooled_.erase(it);
    }
  }
  if (memory == nullptr) {
    trim(bytes, user);
    HPS_ASSIGN_OR_RETURN(memory, allocate_fresh(bytes, user));
  }
  lent_bytes_ += bytes;
  return std::unique_ptr<FullBuffer>(new FullBuffer(this, memory, bytes, std::move(ready)));
}

Status FullBufferPool::give_back(std::unique_ptr<FullBuffer> buffer, Stream& last_user) {
  if (!buffer) return Status::Ok();
  void* memory = std::exchange(buffer->memory_, nullptr);
  const size_t bytes = buffer->bytes_;
  lent_bytes_ -= bytes;
  if (checked_) {
    // Inaccessible once the last user is done; the pages go back, the addresses stay
    // reserved so no later buffer can be reached through a stale view.
    const size_t mapped = page_rounded(bytes);
    static_cast<cpu::HostQueue&>(last_user).enqueue(
        [memory, mapped] {
          madvise(memory, mapped, MADV_DONTNEED);
          mprotect(memory, mapped, PROT_NONE);
        },
        "release (checked)");
    return Status::Ok();
  }
  std::unique_ptr<Event> ready = std::move(buffer->ready_);
  if (!ready) {
    HPS_ASSIGN_OR_RETURN(ready, create_event(device_));
  }
  const Status recorded = ready->record(last_user);
  if (!recorded.ok()) {
    free_now(memory, bytes);  // cannot order a reuse after its users: not pooled
    return recorded;
  }
  pooled_.push_back({memory, bytes, std::move(ready)});
  pooled_bytes_ += bytes;
  return Status::Ok();
}

}  // namespace hps
