// DeviceBuffer: an owning allocation of one device's memory, handed out as DevicePtr.
#pragma once

#include <cstddef>

#include "core/common/status.h"
#include "core/device/allocator.h"
#include "core/device/device_ptr.h"

namespace hps {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // `bytes` of `device` memory whose address is a multiple of `alignment` (a power of two;
  // above kAllocationAlignment the allocation is padded to get there). Freed when the
  // buffer is destroyed (on CUDA cudaFree waits for the device).
  static StatusOr<DeviceBuffer> allocate(Device device, size_t bytes,
                                         size_t alignment = kAllocationAlignment);
  // Stream-ordered: usable by work enqueued on `stream` from now on, and freed in its order
  // when the buffer is destroyed or reset, so `stream` must outlive the buffer.
  static StatusOr<DeviceBuffer> allocate_async(Device device, size_t bytes, Stream& stream);

  ~DeviceBuffer() { reset(); }
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = static_cast<DeviceBuffer&&>(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  template <typename T = void>
  DevicePtr<T> data() const {
    return DevicePtr<void>(data_).as<T>();
  }
  size_t bytes() const { return bytes_; }
  bool empty() const { return data_ == nullptr; }
  Device device() const { return device_; }
  // Frees the memory (in the stream's order for a stream-ordered buffer).
  void reset();

 private:
  Allocator* allocator_ = nullptr;
  Stream* stream_ = nullptr;  // set for stream-ordered buffers
  void* base_ = nullptr;      // what the allocator returned
  void* data_ = nullptr;      // base_ rounded up to the alignment
  size_t bytes_ = 0;
  Device device_;
};

}  // namespace hps
