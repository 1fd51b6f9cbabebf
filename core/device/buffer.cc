#include "core/device/buffer.h"

#include <cstdint>
#include <string>

#include "core/device/stream.h"

namespace hps {

StatusOr<DeviceBuffer> DeviceBuffer::allocate(Device device, size_t bytes, size_t alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
    return invalid_argument("device buffer: alignment " + std::to_string(alignment) +
                            " is not a power of two");
  }
  const size_t padding = alignment > kAllocationAlignment ? alignment - kAllocationAlignment : 0;
  if (bytes > SIZE_MAX - padding) {
    return out_of_memory("device buffer of " + std::to_string(bytes) + " bytes");
  }
  HPS_ASSIGN_OR_RETURN(Allocator * allocator, allocator_for(device));
  HPS_ASSIGN_OR_RETURN(void* base, allocator->allocate(bytes + padding));
  DeviceBuffer b;
  b.allocator_ = allocator;
  b.base_ = base;
  const auto address = reinterpret_cast<uintptr_t>(base);
  b.data_ = reinterpret_cast<void*>((address + alignment - 1) / alignment * alignment);
  b.bytes_ = bytes;
  b.device_ = device;
  return b;
}

StatusOr<DeviceBuffer> DeviceBuffer::allocate_async(Device device, size_t bytes, Stream& stream) {
  HPS_ASSIGN_OR_RETURN(Allocator * allocator, allocator_for(device));
  HPS_ASSIGN_OR_RETURN(void* base, allocator->allocate_async(bytes, stream));
  DeviceBuffer b;
  b.allocator_ = allocator;
  b.stream_ = &stream;
  b.base_ = b.data_ = base;
  b.bytes_ = bytes;
  b.device_ = device;
  return b;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this == &other) return *this;
  reset();
  allocator_ = other.allocator_;
  stream_ = other.stream_;
  base_ = other.base_;
  data_ = other.data_;
  bytes_ = other.bytes_;
  device_ = other.device_;
  other.allocator_ = nullptr;
  other.stream_ = nullptr;
  other.base_ = other.data_ = nullptr;
  other.bytes_ = 0;
  return *this;
}

void DeviceBuffer::reset() {
  if (base_ != nullptr) {
    if (stream_ != nullptr) {
      allocator_->deallocate_async(base_, *stream_);
    } else {
      allocator_->deallocate(base_);
    }
  }
  allocator_ = nullptr;
  stream_ = nullptr;
  base_ = data_ = nullptr;
  bytes_ = 0;
}

}  // namespace hps
