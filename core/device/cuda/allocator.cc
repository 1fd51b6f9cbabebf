#include "core/device/cuda/allocator.h"

#include "core/device/cuda/error.h"
#include "core/device/cuda/stream.h"

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

StatusOr<void*> CudaAllocator::allocate_async(size_t bytes, Stream& stream) {
  if (!(stream.device() == device())) {
    return invalid_argument("cuda allocate_async: the stream is on " + stream.device().to_string() +
                            ", the allocator on " + device().to_string());
  }
  HPS_RETURN_IF_ERROR(set_device(index_));
  void* pointer = nullptr;
  HPS_RETURN_IF_ERROR(cuda_status(
      cudaMallocAsync(&pointer, bytes == 0 ? 1 : bytes, static_cast<CudaStream&>(stream).native()),
      "cudaMallocAsync"));
  return pointer;
}

void CudaAllocator::deallocate_async(void* pointer, Stream& stream) {
  if (pointer == nullptr) return;
  (void)cudaSetDevice(index_);
  (void)cudaFreeAsync(pointer, static_cast<CudaStream&>(stream).native());
}

}  // namespace hps::cuda
