// CPU streams: an ordered queue of host tasks run by the stream's own worker thread,
// so communication enqueued on one stream runs beside compute on the caller's thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "core/device/stream.h"

namespace hps::cpu {

// The completion mark of one event record; shared by the event and the queued task.
class EventMark {
 public:
  void complete();
  bool completed() const;
  void wait() const;  // blocks the calling thread (a worker or, counted, the host)

 private:
  mutable std::mutex mutex_;
  mutable std::condition_variable done_cv_;
  bool completed_ = false;
};

class CpuStream final : public Stream {
 public:
  CpuStream();
  ~CpuStream() override;  // finishes the queued work, then joins the worker
  CpuStream(const CpuStream&) = delete;
  CpuStream& operator=(const CpuStream&) = delete;

  Device device() const override { return Device::cpu(); }
  Status wait(Event& event) override;
  Status synchronize() override;
  Status memcpy_async(void* dst, const void* src, size_t bytes) override;

  // Enqueues `task` to run on the worker after everything enqueued before it.
  void enqueue(std::function<void()> task);

 private:
  void run();

  std::mutex mutex_;
  std::condition_variable work_cv_;
  std::condition_variable idle_cv_;
  std::deque<std::function<void()>> queue_;
  uint64_t enqueued_ = 0;
  uint64_t finished_ = 0;
  bool stopping_ = false;
  std::thread worker_;
};

class CpuEvent final : public Event {
 public:
  Device device() const override { return Device::cpu(); }
  Status record(Stream& stream) override;
  StatusOr<bool> query() override;
  Status synchronize() override;
  Status synchronize_uncounted() override;
  bool recorded() const override { return mark_ != nullptr; }

  // Records a mark that `owner` completes itself instead of a stream: for work that
  // finishes off the stream's queue (point-to-point transfers).
  std::shared_ptr<EventMark> record_detached() { return mark_ = std::make_shared<EventMark>(); }

  // The mark of the most recent record (null when never recorded).
  std::shared_ptr<EventMark> mark() const { return mark_; }

 private:
  std::shared_ptr<EventMark> mark_;
};

}  // namespace hps::cpu
