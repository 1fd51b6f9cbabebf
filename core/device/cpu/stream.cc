#include "core/device/cpu/stream.h"

#include <cstring>

#include "core/device/host_sync.h"

namespace hps::cpu {

void EventMark::complete() {
  {
    std::lock_guard lock(mutex_);
    completed_ = true;
  }
  done_cv_.notify_all();
}

bool EventMark::completed() const {
  std::lock_guard lock(mutex_);
  return completed_;
}

void EventMark::wait() const {
  std::unique_lock lock(mutex_);
  done_cv_.wait(lock, [&] { return completed_; });
}

CpuStream::CpuStream() : worker_([this] { run(); }) {}

CpuStream::~CpuStream() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  worker_.join();
}

void CpuStream::enqueue(std::function<void()> task) {
  {
    std::lock_guard lock(mutex_);
    queue_.push_back(std::move(task));
    ++enqueued_;
  }
  work_cv_.notify_one();
}

void CpuStream::run() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock lock(mutex_);
      work_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything queued has run
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
    {
      std::lock_guard lock(mutex_);
      ++finished_;
    }
    idle_cv_.notify_all();
  }
}

Status CpuStream::wait(Event& event) {
  HPS_RETURN_IF_ERROR(check_same_device(*this, event, "stream wait"));
  auto mark = static_cast<CpuEvent&>(event).mark();
  if (!mark) return failed_precondition("stream wait: the event was never recorded");
  enqueue([mark] { mark->wait(); });
  return Status::Ok();
}

Status CpuStream::synchronize() {
  count_host_sync(HostSyncKind::kStreamSynchronize);
  std::unique_lock lock(mutex_);
  const uint64_t target = enqueued_;
  idle_cv_.wait(lock, [&] { return finished_ >= target; });
  return Status::Ok();
}

Status CpuStream::memcpy_async(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return Status::Ok();
  if (dst == nullptr || src == nullptr) {
    return invalid_argument("memcpy_async: null pointer with a non-zero size");
  }
  enqueue([dst, src, bytes] { std::memcpy(dst, src, bytes); });
  return Status::Ok();
}

Status CpuEvent::record(Stream& stream) {
  HPS_RETURN_IF_ERROR(check_same_device(stream, *this, "event record"));
  auto mark = std::make_shared<EventMark>();
  static_cast<CpuStream&>(stream).enqueue([mark] { mark->complete(); });
  mark_ = std::move(mark);
  return Status::Ok();
}

StatusOr<bool> CpuEvent::query() {
  if (!mark_) return failed_precondition("event query: the event was never recorded");
  return mark_->completed();
}

Status CpuEvent::synchronize() {
  if (!mark_) return failed_precondition("event synchronize: the event was never recorded");
  count_host_sync(HostSyncKind::kEventSynchronize);
  mark_->wait();
  return Status::Ok();
}

Status CpuEvent::synchronize_uncounted() {
  if (!mark_) return failed_precondition("event synchronize: the event was never recorded");
  mark_->wait();
  return Status::Ok();
}

}  // namespace hps::cpu
