#include "core/checkpoint/staging.h"

#include <cstdlib>
#include <new>

#include "core/common/config.h"

#if HPS_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace hps::ckpt {

HostStaging::~HostStaging() { release(); }

HostStaging::HostStaging(HostStaging&& other) noexcept
    : data_(other.data_),
      size_(other.size_),
      capacity_(other.capacity_),
      device_(other.device_),
      pinned_(other.pinned_) {
  other.data_ = nullptr;
  other.size_ = other.capacity_ = 0;
}

HostStaging& HostStaging::operator=(HostStaging&& other) noexcept {
  if (this != &other) {
    release();
    data_ = other.data_;
    size_ = other.size_;
    capacity_ = other.capacity_;
    device_ = other.device_;
    pinned_ = other.pinned_;
    other.data_ = nullptr;
    other.size_ = other.capacity_ = 0;
  }
  return *this;
}

void HostStaging::release() {
  if (data_ == nullptr) return;
#if HPS_HAVE_CUDA
  if (pinned_) {
    cudaFreeHost(data_);
    data_ = nullptr;
    return;
  }
#endif
  std::free(data_);
  data_ = nullptr;
}

bool HostStaging::reuse(Device device, size_t bytes) {
  if (data_ == nullptr || !(device == device_) || bytes > capacity_) return false;
  size_ = bytes;
  return true;
}

StatusOr<HostStaging> HostStaging::allocate(Device device, size_t bytes) {
  HostStaging s;
  s.size_ = bytes;
  const size_t rounded = (std::max<size_t>(bytes, 1) + 4095) / 4096 * 4096;
  s.capacity_ = rounded;
  s.device_ = device;
  if (device.type == DeviceType::kCuda) {
#if HPS_HAVE_CUDA
    void* p = nullptr;
    const cudaError_t e = cudaHostAlloc(&p, rounded, cudaHostAllocDefault);
    if (e != cudaSuccess) {
      return out_of_memory("checkpoint: " + std::to_string(bytes) +
                           " bytes of page-locked staging memory: " + cudaGetErrorString(e));
    }
    s.data_ = static_cast<uint8_t*>(p);
    s.pinned_ = true;
    return s;
#else
    return unavailable("checkpoint: this build of hpshard has no CUDA");
#endif
  }
  // Page-aligned: whole pages go to the kernel's write path in one piece.
  void* p = std::aligned_alloc(4096, rounded);
  if (p == nullptr) {
    return out_of_memory("checkpoint: " + std::to_string(bytes) + " bytes of staging memory");
  }
  s.data_ = static_cast<uint8_t*>(p);
  return s;
}

}  // namespace hps::ckpt
