#include "core/device/cuda/allocator.h"

#include "core/device/cuda/error.h"

namespace hps::cuda {

StatusOr<void*> CudaAllocator::allocate(size_t bytes) {
  HPS_RETURN_IF_ERROR(set_device(index_));
  void* pointer = nullptr;
  HPS_RETURN_IF_ERROR(cuda_status(cudaMalloc(&pointer, bytes == 0 ? 1 : bytes), "cudaMalloc"));
  return pointer;
}

void CudaAllocator::deallocate(void* pointer) {
  if (pointer == nullptr) return;
  (void)cudaSetDevice(index_);
  (void)cudaFree(pointer);
}

}  // namespace hps::cuda
