#pragma once

#include "core/device/allocator.h"

namespace hps::cpu {

// Host memory aligned to kAllocationAlignment.
class CpuAllocator final : public Allocator {
 public:
  Device device() const override { return Device::cpu(); }
  StatusOr<void*> allocate(size_t bytes) override;
  void deallocate(void* pointer) override;
};

}  // namespace hps::cpu
