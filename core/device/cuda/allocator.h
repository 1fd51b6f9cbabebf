#pragma once

#include "core/device/allocator.h"

namespace hps::cuda {

// Device memory from cudaMalloc (256-byte aligned by CUDA's guarantee).
class CudaAllocator final : public Allocator {
 public:
  explicit CudaAllocator(int32_t index) : index_(index) {}
  Device device() const override { return Device::cuda(index_); }
  StatusOr<void*> allocate(size_t bytes) override;
  void deallocate(void* pointer) override;

 private:
  int32_t index_;
};

}  // namespace hps::cuda
