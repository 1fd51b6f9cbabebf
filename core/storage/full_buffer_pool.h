// The pool of full (unsharded) buffers stage 3 gathers units into and takes gradients in.
// Buffers are lent and given back in stream order: a buffer given back after the work
// queued on its last user's stream is reused by a later taker only once that work is done
// (the taker's stream waits for it, device-side; on the calling thread of a CPU framework
// that is a dependency wait). So steady steps allocate nothing, and the memory held stays
// within a budget (the shards plus the live window) without the host blocking.
//
// Checked mode (HPS_DEBUG_VIEWS=1, CPU only): every buffer is a fresh mapping, and a
// buffer given back becomes inaccessible (mprotect PROT_NONE, its pages returned to the
// system) once its last user is done, and its addresses are never handed out again: a
// write through a view kept past release faults at once instead of landing in another
// unit's parameters. Address space grows by every buffer lent; for debugging only.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/device/allocator.h"
#include "core/device/device_ptr.h"
#include "core/device/stream.h"

namespace hps {

class FullBufferPool;

// A buffer lent by the pool. Give it back with FullBufferPool::give_back.
class FullBuffer {
 public:
  DevicePtr<void> data() const { return DevicePtr<void>(memory_); }
  size_t bytes() const { return bytes_; }
  ~FullBuffer();

 private:
  friend class FullBufferPool;
  FullBuffer(FullBufferPool* pool, void* memory, size_t bytes, std::unique_ptr<Event> ready)
      : pool_(pool), memory_(memory), bytes_(bytes), ready_(std::move(ready)) {}
  FullBufferPool* pool_;
  void* memory_;
  size_t bytes_;
  std::unique_ptr<Event> ready_;  // reused with the memory
};

class FullBufferPool {
 public:
  // `checked`: the checked mode above (ignored on devices other than the CPU).
  FullBufferPool(Device device, bool checked);
  ~FullBufferPool();  // waits for the pooled buffers' last users, then frees them
  FullBufferPool(const FullBufferPool&) = delete;
  FullBufferPool& operator=(const FullBufferPool&) = delete;

  // Bytes lent plus pooled above which pooled buffers of other sizes are freed before a
  // fresh allocation, and at which a busy pooled buffer of the right size is waited for
  // rather than a new one allocated.
  void set_budget(uint64_t bytes) { budget_ = bytes; }
  // A buffer of `bytes` that work enqueued on `user` from now on may use.
  StatusOr<std::unique_ptr<FullBuffer>> take(size_t bytes, Stream& user);
  // Back to the pool once the work enqueued on `last_user` so far has completed.
  Status give_back(std::unique_ptr<FullBuffer> buffer, Stream& last_user);

  bool checked() const { return checked_; }
  uint64_t lent_bytes() const { return lent_bytes_; }
  uint64_t pooled_bytes() const { return pooled_bytes_; }
  uint64_t takes() const { return takes_; }
  uint64_t fresh_allocations() const { return fresh_; }

 private:
  friend class FullBuffer;
  struct Pooled {
    void* memory;
    size_t bytes;
    std::unique_ptr<Event> ready;  // recorded after the last user's work; null: free now
  };
  StatusOr<void*> allocate_fresh(size_t bytes, Stream& user);
  void free_now(void* memory, size_t bytes);  // no work uses it
  // Frees pooled buffers (completed ones first) until lent + pooled + `incoming` fits the
  // budget or none is left; a busy one is freed in `user`'s order after its last use.
  void trim(uint64_t incoming, Stream& user);

  Device device_;
  Allocator* allocator_ = nullptr;
  bool checked_ = false;
  uint64_t budget_ = ~uint64_t{0};
  std::vector<Pooled> pooled_;
  uint64_t lent_bytes_ = 0;
  uint64_t pooled_bytes_ = 0;
  uint64_t takes_ = 0;
  uint64_t fresh_ = 0;
};

// Whether HPS_DEBUG_VIEWS (0 or 1) asks for the checked mode; an error naming the variable
// for any other value.
StatusOr<bool> debug_views_from_env();

}  // namespace hps
