#include "core/device/cpu/stream.h"

#include <chrono>
#include <cstring>

#include "core/device/host_sync.h"
#include "core/trace/trace.h"

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
  if (auto stream = stream_.lock()) {
    {
      std::lock_guard lock(mutex_);
      if (completed_) return;
    }
    stream->help_until(index_);
  }
  std::unique_lock lock(mutex_);
  done_cv_.wait(lock, [&] { return completed_; });
}

bool EventMark::wait_for(std::chrono::nanoseconds timeout) const {
  std::unique_lock lock(mutex_);
  return done_cv_.wait_for(lock, timeout, [&] { return completed_; });
}

bool EventMark::wait(std::stop_token stop) const {
  // The stop's callback runs on the thread that requests it; it notifies under the lock,
  // so the request cannot fall between this thread's check and its sleep.
  std::stop_callback wake(stop, [this] {
    std::lock_guard lock(mutex_);
    done_cv_.notify_all();
  });
  std::unique_lock lock(mutex_);
  done_cv_.wait(lock, [&] { return completed_ || stop.stop_requested(); });
  return completed_;
}

StreamCore::StreamCore() : trace_track_(trace::new_stream_track()) {}

uint64_t StreamCore::enqueue(std::function<void()> task, const char* label) {
  uint64_t index = 0;
  {
    std::lock_guard lock(mutex_);
    queue_.push_back({std::move(task), label});
    index = ++enqueued_;
  }
  work_cv_.notify_one();
  return index;
}

void StreamCore::run_front(std::unique_lock<std::mutex>& lock) {
  Task task = std::move(queue_.front());
  queue_.pop_front();
  ++started_;
  busy_ = true;
  lock.unlock();
  if (trace::enabled()) {
    // On this stream's track whichever thread runs it (the worker or a helping waiter).
    trace::TaskScope scope(trace_track_, task.label);
    task.run();
  } else {
    task.run();
  }
  lock.lock();
  busy_ = false;
  ++finished_;
  idle_cv_.notify_all();
}

void StreamCore::help_until(uint64_t index) {
  std::unique_lock lock(mutex_);
  bool ran = false;
  while (!busy_ && !queue_.empty() && started_ < index) {
    run_front(lock);
    ran = true;
  }
  // The worker may have gone back to sleep while this thread ran tasks: more may be
  // queued, or a destructor may be waiting for the worker to see the queue idle.
  if (ran) work_cv_.notify_one();
}

void StreamCore::run_worker() {
  std::unique_lock lock(mutex_);
  for (;;) {
    work_cv_.wait(lock, [&] { return (stopping_ && !busy_) || (!queue_.empty() && !busy_); });
    if (queue_.empty()) return;  // stopping, and everything queued has run
    run_front(lock);
  }
}

void StreamCore::stop() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  work_cv_.notify_all();
}

void StreamCore::synchronize() {
  std::unique_lock lock(mutex_);
  const uint64_t target = enqueued_;
  idle_cv_.wait(lock, [&] { return finished_ >= target; });
}

void StreamCore::record_error(const Status& s) {
  if (s.ok()) return;
  std::lock_guard lock(error_mutex_);
  if (error_.ok()) error_ = s;
}

Status StreamCore::take_error() {
  std::lock_guard lock(error_mutex_);
  Status s = std::move(error_);
  error_ = Status::Ok();
  return s;
}

CpuStream::CpuStream()
    : core_(std::make_shared<StreamCore>()), worker_([core = core_] { core->run_worker(); }) {
  trace::stream_created();
}

CpuStream::~CpuStream() {
  core_->stop();
  worker_.join();
  trace::retire_track(core_->trace_track());
  trace::stream_destroyed();  // the last stream of a traced run writes the timeline
}

void CpuStream::set_trace_name(std::string name) {
  trace::name_track(core_->trace_track(), std::move(name));
}

void CpuStream::enqueue(std::function<void()> task, const char* label) {
  core_->enqueue(std::move(task), label);
}

std::shared_ptr<EventMark> CpuStream::record_mark() {
  // The task may run (and complete the mark) before enqueue returns; only the helping
  // wait needs the index, and no one can wait on the mark before it is returned.
  auto mark = std::make_shared<EventMark>(core_);
  mark->set_index(core_->enqueue([mark] { mark->complete(); }, "record event"));
  return mark;
}

Status CpuStream::wait(Event& event) {
  HPS_RETURN_IF_ERROR(check_same_device(*this, event, "stream wait"));
  auto mark = static_cast<CpuEvent&>(event).mark();
  if (!mark) return failed_precondition("stream wait: the event was never recorded");
  enqueue([mark] { mark->wait(); }, "wait event");
  return Status::Ok();
}

Status CpuStream::wait(Event& event, std::stop_token stop) {
  HPS_RETURN_IF_ERROR(check_same_device(*this, event, "stream wait"));
  auto mark = static_cast<CpuEvent&>(event).mark();
  if (!mark) return failed_precondition("stream wait: the event was never recorded");
  if (mark->completed()) return Status::Ok();  // the calling thread's stream: already there
  enqueue([mark, stop = std::move(stop)] { (void)mark->wait(stop); }, "wait event");
  return Status::Ok();
}

Status CpuStream::wait_for_outcome(Event& event, std::function<Status()> outcome) {
  HPS_RETURN_IF_ERROR(wait(event));
  enqueue(
      [core = std::weak_ptr<StreamCore>(core_), outcome = std::move(outcome)] {
        if (auto c = core.lock()) c->record_error(outcome());
      },
      "check outcome");
  return Status::Ok();
}

Status CpuStream::synchronize() {
  count_host_sync(HostSyncKind::kStreamSynchronize);
  core_->synchronize();
  return core_->take_error();
}

Status HostQueue::memcpy_async(void* dst, const void* src, size_t bytes) {
  HPS_RETURN_IF_ERROR(check_copy_regions(dst, src, bytes));
  if (bytes == 0) return Status::Ok();
  enqueue([dst, src, bytes] { std::memcpy(dst, src, bytes); }, "copy");
  return Status::Ok();
}

Status HostQueue::memset_async(void* dst, int value, size_t bytes) {
  if (bytes == 0) return Status::Ok();
  if (dst == nullptr) return invalid_argument("memset_async: null pointer with a non-zero size");
  enqueue([dst, value, bytes] { std::memset(dst, value, bytes); }, "memset");
  return Status::Ok();
}

Status CallerStream::wait(Event& event) {
  HPS_RETURN_IF_ERROR(check_same_device(*this, event, "stream wait"));
  auto mark = static_cast<CpuEvent&>(event).mark();
  if (!mark) return failed_precondition("stream wait: the event was never recorded");
  if (mark->completed()) return Status::Ok();
  const auto start = std::chrono::steady_clock::now();
  mark->wait();
  count_dependency_wait(static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count()));
  return Status::Ok();
}

Status CallerStream::wait_for_outcome(Event& event, std::function<Status()> outcome) {
  HPS_RETURN_IF_ERROR(wait(event));
  return outcome();
}

void CallerStream::enqueue(std::function<void()> task, const char* /*label*/) { task(); }

std::shared_ptr<EventMark> CallerStream::record_mark() {
  auto mark = std::make_shared<EventMark>();
  mark->complete();
  return mark;
}

Status CpuEvent::record(Stream& stream) {
  HPS_RETURN_IF_ERROR(check_same_device(stream, *this, "event record"));
  mark_ = static_cast<HostQueue&>(stream).record_mark();
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

StatusOr<bool> CpuEvent::wait_for(std::chrono::nanoseconds timeout) {
  if (!mark_) return failed_precondition("event wait: the event was never recorded");
  return mark_->wait_for(timeout);
}

}  // namespace hps::cpu
