// Device memory allocation: one interface, a CPU and a CUDA implementation.
#pragma once

#include <cstddef>

#include "core/common/status.h"
#include "core/device/device.h"

namespace hps {

// Every allocation is aligned to at least this many bytes (the storage alignment).
inline constexpr size_t kAllocationAlignment = 256;

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual Device device() const = 0;
  // Returns memory of at least `bytes` bytes (a unique non-null pointer for 0 bytes).
  virtual StatusOr<void*> allocate(size_t bytes) = 0;
  // Frees memory from allocate(); null is a no-op.
  virtual void deallocate(void* pointer) = 0;
};

// The process-wide allocator of `device`; the device must exist.
StatusOr<Allocator*> allocator_for(Device device);

}  // namespace hps
