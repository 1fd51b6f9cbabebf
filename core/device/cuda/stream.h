// CUDA streams and events: thin owners of cudaStream_t / cudaEvent_t.
#pragma once

#include <cuda_runtime_api.h>

#include "core/device/stream.h"

namespace hps::cuda {

class CudaStream final : public Stream {
 public:
  static StatusOr<std::unique_ptr<Stream>> create(int32_t index);
  // The legacy default stream of device `index`, not owned (never destroyed).
  static std::unique_ptr<Stream> legacy_default(int32_t index);
  ~CudaStream() override;
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  Device device() const override { return Device::cuda(index_); }
  Status wait(Event& event) override;
  Status synchronize() override;
  Status memcpy_async(void* dst, const void* src, size_t bytes) override;
  Status memset_async(void* dst, int value, size_t bytes) override;
  cudaStream_t native() const { return stream_; }

 private:
  CudaStream(int32_t index, cudaStream_t stream, bool owned)
      : index_(index), stream_(stream), owned_(owned) {}
  int32_t index_;
  cudaStream_t stream_;
  bool owned_;
};

class CudaEvent final : public Event {
 public:
  static StatusOr<std::unique_ptr<Event>> create(int32_t index);
  ~CudaEvent() override;
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  Device device() const override { return Device::cuda(index_); }
  Status record(Stream& stream) override;
  StatusOr<bool> query() override;
  Status synchronize() override;
  Status synchronize_uncounted() override;
  bool recorded() const override { return recorded_; }
  cudaEvent_t native() const { return event_; }

 private:
  CudaEvent(int32_t index, cudaEvent_t event) : index_(index), event_(event) {}
  int32_t index_;
  cudaEvent_t event_;
  bool recorded_ = false;
};

}  // namespace hps::cuda
