#pragma once

#include <map>
#include <mutex>
#include <vector>

#include "core/device/allocator.h"

namespace hps::cpu {

// Host memory aligned to kAllocationAlignment. Stream-ordered frees are tasks on the CPU
// stream that return the block to a cache of free blocks (by rounded size, at most
// kCachedBytesLimit in all); allocate_async takes from that cache first.
class CpuAllocator final : public Allocator {
 public:
  static constexpr size_t kCachedBytesLimit = size_t{256} << 20;

  ~CpuAllocator() override;
  Device device() const override { return Device::cpu(); }
  StatusOr<void*> allocate(size_t bytes) override;
  void deallocate(void* pointer) override;
  StatusOr<void*> allocate_async(size_t bytes, Stream& stream) override;
  void deallocate_async(void* pointer, Stream& stream) override;

  size_t cached_bytes() const;

 private:
  void return_to_cache(void* pointer, size_t rounded);

  mutable std::mutex mutex_;
  std::multimap<size_t, void*> cache_;    // rounded size → free block
  std::map<void*, size_t> async_blocks_;  // blocks handed out by allocate_async
  size_t cached_bytes_ = 0;
};

}  // namespace hps::cpu
