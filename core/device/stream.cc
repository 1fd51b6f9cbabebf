#include "core/device/stream.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <thread>

#include "core/common/config.h"
#include "core/device/cpu/stream.h"
#include "core/device/host_sync.h"
#if HPS_HAVE_CUDA
#include "core/device/cuda/stream.h"
#endif

namespace hps {

StatusOr<bool> Event::wait_for(std::chrono::nanoseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::microseconds(20);
  for (;;) {
    HPS_ASSIGN_OR_RETURN(const bool done, query());
    if (done) return true;
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return false;
    std::this_thread::sleep_for(std::min<std::chrono::nanoseconds>(pause, deadline - now));
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
}

StatusOr<std::unique_ptr<Stream>> create_stream(Device device) {
  HPS_RETURN_IF_ERROR(check_device(device));
#if HPS_HAVE_CUDA
  if (device.type == DeviceType::kCuda) return cuda::CudaStream::create(device.index);
#endif
  return std::unique_ptr<Stream>(std::make_unique<cpu::CpuStream>());
}

StatusOr<std::unique_ptr<Stream>> default_compute_stream(Device device) {
  HPS_RETURN_IF_ERROR(check_device(device));
#if HPS_HAVE_CUDA
  if (device.type == DeviceType::kCuda) return cuda::CudaStream::legacy_default(device.index);
#endif
  return std::unique_ptr<Stream>(std::make_unique<cpu::CallerStream>());
}

StatusOr<std::unique_ptr<Event>> create_event(Device device) {
  HPS_RETURN_IF_ERROR(check_device(device));
#if HPS_HAVE_CUDA
  if (device.type == DeviceType::kCuda) return cuda::CudaEvent::create(device.index);
#endif
  return std::unique_ptr<Event>(std::make_unique<cpu::CpuEvent>());
}

Status drain(Stream& stream) {
  auto done = create_event(stream.device());
  if (!done.ok()) return stream.synchronize();  // the wait matters more than the error
  const Status recorded = (*done)->record(stream);
  return recorded.ok() ? (*done)->synchronize() : stream.synchronize();
}

Status copy_to_host(Stream& stream, void* host, const void* device, size_t bytes) {
  if (bytes == 0) return Status::Ok();
  // The event first: once the copy is queued, nothing returns before it has landed.
  HPS_ASSIGN_OR_RETURN(auto done, create_event(stream.device()));
  HPS_RETURN_IF_ERROR(stream.memcpy_async(host, device, bytes));
  count_host_sync(HostSyncKind::kDeviceToHostRead);
  const Status recorded = done->record(stream);
  if (!recorded.ok()) {
    (void)stream.synchronize();
    return recorded;
  }
  return done->synchronize_uncounted();
}

Status check_copy_regions(const void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return Status::Ok();
  if (dst == nullptr || src == nullptr) {
    return invalid_argument("memcpy_async: null pointer with a non-zero size");
  }
  const auto d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
  const uintptr_t last = std::numeric_limits<uintptr_t>::max() - (bytes - 1);
  if (d > last || s > last) {
    return invalid_argument("memcpy_async: " + std::to_string(bytes) + " bytes at " +
                            (d > last ? "dst" : "src") + " run past the end of the address space");
  }
  if (d < s + bytes && s < d + bytes) {
    return invalid_argument("memcpy_async: dst and src overlap (" + std::to_string(bytes) +
                            " bytes, " + std::to_string(d > s ? d - s : s - d) +
                            " apart); copy through a separate buffer");
  }
  return Status::Ok();
}

Status check_same_device(const Stream& stream, const Event& event, const char* operation) {
  if (stream.device() == event.device()) return Status::Ok();
  return invalid_argument(std::string(operation) + ": the stream is on " +
                          stream.device().to_string() + " but the event is on " +
                          event.device().to_string());
}

}  // namespace hps
