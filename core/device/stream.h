// Stream and Event: one interface, a CPU and a CUDA implementation (device/cpu/,
// device/cuda/). Work is enqueued without blocking the host; the only host-blocking
// calls are synchronize(), and they are counted (host_sync.h).
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "core/common/status.h"
#include "core/device/device.h"

namespace hps {

class Event;

class Stream {
 public:
  virtual ~Stream() = default;
  virtual Device device() const = 0;
  // Work enqueued after this call waits for `event`'s most recent record, without
  // blocking the host. FAILED_PRECONDITION when the event was never recorded.
  virtual Status wait(Event& event) = 0;
  // As wait(), and once `event` has completed the stream asks `outcome` how the work it
  // marks ended: a failure becomes the stream's (an asynchronous error), so that work
  // enqueued after it is known to have run on a failed operation's output. CPU streams
  // report it from the next synchronize() (once: the one after that starts afresh); the
  // calling thread's stream returns it from this call. Streams that cannot ask in order (CUDA) only
  // wait: the failure is reported where its operation is waited for.
  virtual Status wait_for_outcome(Event& event, std::function<Status()> outcome) {
    (void)outcome;
    return wait(event);
  }
  // Blocks the host until everything enqueued so far has completed. Counted. A CPU stream
  // that took an asynchronous error (wait_for_outcome) since its last synchronize() returns
  // it, after everything has completed.
  virtual Status synchronize() = 0;
  // Enqueues a copy of `bytes` bytes; the regions must stay valid until it completes, and
  // must not overlap (check_copy_regions: INVALID_ARGUMENT, nothing enqueued).
  // Either side may be host memory (on CUDA through unified addressing); a copy into host
  // memory is complete only when the stream gets there (read it after an event or
  // synchronize()).
  virtual Status memcpy_async(void* dst, const void* src, size_t bytes) = 0;
  // Enqueues `bytes` bytes of `dst` (memory of the stream's device) set to `value`.
  virtual Status memset_async(void* dst, int value, size_t bytes) = 0;
  // What the timeline (HPS_TRACE) calls this stream's track; ignored where it has none.
  virtual void set_name(std::string /*name*/) {}
};

class Event {
 public:
  virtual ~Event() = default;
  virtual Device device() const = 0;
  // Marks the current end of `stream`'s queue.
  virtual Status record(Stream& stream) = 0;
  // Whether the most recent record has completed, without blocking.
  virtual StatusOr<bool> query() = 0;
  // Blocks the host until the most recent record has completed. Counted.
  virtual Status synchronize() = 0;
  // The same wait, for callers that count the sync under their own kind (Work::wait).
  virtual Status synchronize_uncounted() = 0;
  // Blocks the host until the most recent record has completed or `timeout` has passed,
  // whichever comes first; whether it completed. Uncounted (Work::wait_for counts). This
  // default polls query() with sleeps growing to a millisecond; CPU events wait on the mark.
  virtual StatusOr<bool> wait_for(std::chrono::nanoseconds timeout);
  virtual bool recorded() const = 0;
};

StatusOr<std::unique_ptr<Stream>> create_stream(Device device);
// The stream a framework computes on when it names none: on the CPU the calling thread
// (cpu::CallerStream: work runs at once, waits block the caller as dependency waits); on
// CUDA the device's legacy default stream (not owned).
StatusOr<std::unique_ptr<Stream>> default_compute_stream(Device device);
StatusOr<std::unique_ptr<Event>> create_event(Device device);

// Blocks the host until everything enqueued on `stream` so far has completed, leaving an
// asynchronous error the stream took for its next synchronize(). For a failure path that
// frees memory its queued work uses (a copy enqueued before the collective that refused).
// Counted (set-up and error paths only).
Status drain(Stream& stream);
// Copies `bytes` of device memory into host memory after the work enqueued on `stream`
// and blocks the host until it has arrived. A host sync (counted as a device-to-host
// read): for set-up, gather_all and checkpoints, never inside a step.
Status copy_to_host(Stream& stream, void* host, const void* device, size_t bytes);

// Shared argument checks of the implementations.
Status check_same_device(const Stream& stream, const Event& event, const char* operation);
// memcpy_async's regions: INVALID_ARGUMENT when `bytes` > 0 and a pointer is null, a region
// runs past the end of the address space, or the two overlap (the copy's result would
// depend on its direction).
Status check_copy_regions(const void* dst, const void* src, size_t bytes);

}  // namespace hps
