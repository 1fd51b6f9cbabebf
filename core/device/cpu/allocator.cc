#include "core/device/cpu/allocator.h"

#include <cstdlib>
#include <limits>
#include <string>

#include "core/device/cpu/stream.h"

namespace hps::cpu {
namespace {

StatusOr<size_t> rounded_size(size_t bytes) {
  constexpr size_t kMax = std::numeric_limits<size_t>::max() - kAllocationAlignment;
  if (bytes > kMax) return out_of_memory("cpu allocation of " + std::to_string(bytes) + " bytes");
  size_t rounded = (bytes + kAllocationAlignment - 1) / kAllocationAlignment * kAllocationAlignment;
  return rounded == 0 ? kAllocationAlignment : rounded;
}

StatusOr<void*> aligned(size_t rounded, size_t bytes) {
  void* pointer = std::aligned_alloc(kAllocationAlignment, rounded);
  if (pointer == nullptr) {
    return out_of_memory("cpu allocation of " + std::to_string(bytes) + " bytes failed");
  }
  return pointer;
}

}  // namespace

CpuAllocator::~CpuAllocator() {
  for (auto& [size, pointer] : cache_) std::free(pointer);
}

StatusOr<void*> CpuAllocator::allocate(size_t bytes) {
  HPS_ASSIGN_OR_RETURN(size_t rounded, rounded_size(bytes));
  return aligned(rounded, bytes);
}

void CpuAllocator::deallocate(void* pointer) {
  if (pointer == nullptr) return;
  {
    std::lock_guard lock(mutex_);
    async_blocks_.erase(pointer);  // a stream-ordered block freed at once is fine too
  }
  std::free(pointer);
}

StatusOr<void*> CpuAllocator::allocate_async(size_t bytes, Stream& stream) {
  if (stream.device().type != DeviceType::kCpu) {
    return invalid_argument("cpu allocate_async: the stream is on " + stream.device().to_string());
  }
  HPS_ASSIGN_OR_RETURN(size_t rounded, rounded_size(bytes));
  void* pointer = nullptr;
  {
    std::lock_guard lock(mutex_);
    // A cached block's free task has run: nothing queued before it uses the block.
    if (auto it = cache_.find(rounded); it != cache_.end()) {
      pointer = it->second;
      cached_bytes_ -= rounded;
      cache_.erase(it);
    }
  }
  if (pointer == nullptr) {
    HPS_ASSIGN_OR_RETURN(pointer, aligned(rounded, bytes));
  }
  std::lock_guard lock(mutex_);
  async_blocks_[pointer] = rounded;
  return pointer;
}

void CpuAllocator::return_to_cache(void* pointer, size_t rounded) {
  {
    std::lock_guard lock(mutex_);
    if (cached_bytes_ + rounded <= kCachedBytesLimit) {
      cache_.emplace(rounded, pointer);
      cached_bytes_ += rounded;
      return;
    }
  }
  std::free(pointer);
}

void CpuAllocator::deallocate_async(void* pointer, Stream& stream) {
  if (pointer == nullptr) return;
  size_t rounded = 0;
  {
    std::lock_guard lock(mutex_);
    auto it = async_blocks_.find(pointer);
    if (it != async_blocks_.end()) {
      rounded = it->second;
      async_blocks_.erase(it);
    }
  }
  auto* queue = dynamic_cast<HostQueue*>(&stream);
  if (rounded == 0 || queue == nullptr) {  // not from allocate_async, or not a CPU stream
    std::free(pointer);
    return;
  }
  queue->enqueue([this, pointer, rounded] { return_to_cache(pointer, rounded); }, "free");
}

size_t CpuAllocator::cached_bytes() const {
  std::lock_guard lock(mutex_);
  return cached_bytes_;
}

}  // namespace hps::cpu
