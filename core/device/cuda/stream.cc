#include "core/device/cuda/stream.h"

#include "core/device/cuda/error.h"
#include "core/device/host_sync.h"

namespace hps::cuda {

StatusOr<std::unique_ptr<Stream>> CudaStream::create(int32_t index) {
  HPS_RETURN_IF_ERROR(set_device(index));
  cudaStream_t stream = nullptr;
  HPS_RETURN_IF_ERROR(cuda_status(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                                  "cudaStreamCreateWithFlags"));
  return std::unique_ptr<Stream>(new CudaStream(index, stream, true));
}

std::unique_ptr<Stream> CudaStream::legacy_default(int32_t index) {
  return std::unique_ptr<Stream>(new CudaStream(index, cudaStreamLegacy, false));
}

CudaStream::~CudaStream() {
  if (!owned_) return;
  // cudaStreamDestroy returns at once; queued work still completes (CUDA semantics).
  (void)cudaSetDevice(index_);
  (void)cudaStreamDestroy(stream_);
}

Status CudaStream::wait(Event& event) {
  HPS_RETURN_IF_ERROR(check_same_device(*this, event, "stream wait"));
  if (!event.recorded()) return failed_precondition("stream wait: the event was never recorded");
  return cuda_status(cudaStreamWaitEvent(stream_, static_cast<CudaEvent&>(event).native(), 0),
                     "cudaStreamWaitEvent");
}

Status CudaStream::synchronize() {
  count_host_sync(HostSyncKind::kStreamSynchronize);
  return cuda_status(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
}

Status CudaStream::memcpy_async(void* dst, const void* src, size_t bytes) {
  HPS_RETURN_IF_ERROR(check_copy_regions(dst, src, bytes));
  if (bytes == 0) return Status::Ok();
  return cuda_status(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_),
                     "cudaMemcpyAsync");
}

Status CudaStream::memset_async(void* dst, int value, size_t bytes) {
  if (bytes == 0) return Status::Ok();
  if (dst == nullptr) return invalid_argument("memset_async: null pointer with a non-zero size");
  return cuda_status(cudaMemsetAsync(dst, value, bytes, stream_), "cudaMemsetAsync");
}

StatusOr<std::unique_ptr<Event>> CudaEvent::create(int32_t index) {
  HPS_RETURN_IF_ERROR(set_device(index));
  cudaEvent_t event = nullptr;
  HPS_RETURN_IF_ERROR(cuda_status(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                                  "cudaEventCreateWithFlags"));
  return std::unique_ptr<Event>(new CudaEvent(index, event));
}

CudaEvent::~CudaEvent() {
  (void)cudaSetDevice(index_);
  (void)cudaEventDestroy(event_);
}

Status CudaEvent::record(Stream& stream) {
  HPS_RETURN_IF_ERROR(check_same_device(stream, *this, "event record"));
  HPS_RETURN_IF_ERROR(cuda_status(
      cudaEventRecord(event_, static_cast<CudaStream&>(stream).native()), "cudaEventRecord"));
  recorded_ = true;
  return Status::Ok();
}

StatusOr<bool> CudaEvent::query() {
  if (!recorded_) return failed_precondition("event query: the event was never recorded");
  const cudaError_t e = cudaEventQuery(event_);
  if (e == cudaSuccess) return true;
  if (e == cudaErrorNotReady) return false;
  return cuda_status(e, "cudaEventQuery");
}

Status CudaEvent::synchronize() {
  if (!recorded_) return failed_precondition("event synchronize: the event was never recorded");
  count_host_sync(HostSyncKind::kEventSynchronize);
  return synchronize_uncounted();
}

Status CudaEvent::synchronize_uncounted() {
  if (!recorded_) return failed_precondition("event synchronize: the event was never recorded");
  return cuda_status(cudaEventSynchronize(event_), "cudaEventSynchronize");
}

}  // namespace hps::cuda
