#pragma once

#include "core/device/allocator.h"

namespace hps::cuda {

// Device memory from cudaMalloc (256-byte aligned by CUDA's guarantee); stream-ordered
// allocations from cudaMallocAsync / cudaFreeAsync (the device's default memory pool).
class CudaAllocator final : public Allocator {
 public:
  explicit CudaAllocator(int32_t index) : index_(index) {}
  Device device() const override { return Device::cuda(index_); }
  StatusOr<void*> allocate(size_t bytes) override;
  void deallocate(void* pointer) override;
  StatusOr<void*> allocate_async(size_t bytes, Stream& stream) override;
  void deallocate_async(void* pointer, Stream& stream) override;

 private:
  int32_t index_;
};

}  // namespace hps::cuda
