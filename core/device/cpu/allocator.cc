#include "core/device/cpu/allocator.h"

#include <cstdlib>
#include <limits>
#include <string>

namespace hps::cpu {

StatusOr<void*> CpuAllocator::allocate(size_t bytes) {
  constexpr size_t kMax = std::numeric_limits<size_t>::max() - kAllocationAlignment;
  if (bytes > kMax) return out_of_memory("cpu allocation of " + std::to_string(bytes) + " bytes");
  size_t rounded = (bytes + kAllocationAlignment - 1) / kAllocationAlignment * kAllocationAlignment;
  if (rounded == 0) rounded = kAllocationAlignment;
  void* pointer = std::aligned_alloc(kAllocationAlignment, rounded);
  if (pointer == nullptr) {
    return out_of_memory("cpu allocation of " + std::to_string(bytes) + " bytes failed");
  }
  return pointer;
}

void CpuAllocator::deallocate(void* pointer) { std::free(pointer); }

}  // namespace hps::cpu
