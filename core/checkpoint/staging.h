// Host memory the snapshot and load copies of a device's stream run through: plain memory
// for the CPU, page-locked memory for a CUDA device (a copy into pageable memory would
// make cudaMemcpyAsync wait for the stream on the host, a hidden host sync).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/common/status.h"
#include "core/device/device.h"

namespace hps::ckpt {

class HostStaging {
 public:
  HostStaging() = default;
  ~HostStaging();
  HostStaging(HostStaging&& other) noexcept;
  HostStaging& operator=(HostStaging&& other) noexcept;
  HostStaging(const HostStaging&) = delete;
  HostStaging& operator=(const HostStaging&) = delete;

  // `bytes` bytes (uninitialised) for copies to and from `device`.
  static StatusOr<HostStaging> allocate(Device device, size_t bytes);
  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  // Reuse for `bytes` bytes of copies to and from `device`, when the memory suffices.
  bool reuse(Device device, size_t bytes);

 private:
  void release();
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  size_t capacity_ = 0;
  Device device_;
  bool pinned_ = false;
};

}  // namespace hps::ckpt
