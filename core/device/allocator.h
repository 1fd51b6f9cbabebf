// Device memory allocation: one interface, a CPU and a CUDA implementation. Besides plain
// allocation, both allocate and free in stream order (cudaMallocAsync / cudaFreeAsync on
// CUDA; on the CPU a cache of blocks whose frees are queued on the stream), so a buffer
// that work still uses is never handed to someone else and the host never waits to free.
#pragma once

#include <cstddef>

#include "core/common/status.h"
#include "core/device/device.h"

namespace hps {

class Stream;

// Every allocation is aligned to at least this many bytes (the storage alignment).
inline constexpr size_t kAllocationAlignment = 256;

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual Device device() const = 0;
  // Returns memory of at least `bytes` bytes (a unique non-null pointer for 0 bytes).
  virtual StatusOr<void*> allocate(size_t bytes) = 0;
  // Frees memory from allocate() (or from allocate_async() once no work uses it); null is
  // a no-op.
  virtual void deallocate(void* pointer) = 0;
  // Memory that work enqueued on `stream` after this call may use (and anything ordered
  // after that work). `stream` must be on this allocator's device.
  virtual StatusOr<void*> allocate_async(size_t bytes, Stream& stream) = 0;
  // Frees memory from allocate_async() once the work enqueued on `stream` so far has
  // completed; the host does not wait. Null is a no-op.
  virtual void deallocate_async(void* pointer, Stream& stream) = 0;
};

// The process-wide allocator of `device`; the device must exist.
StatusOr<Allocator*> allocator_for(Device device);

}  // namespace hps
