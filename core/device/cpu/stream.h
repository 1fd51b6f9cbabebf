// CPU streams: an ordered queue of host tasks run by the stream's own worker thread,
// so communication enqueued on one stream runs beside compute on the caller's thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <stop_token>
#include <string>
#include <thread>

#include "core/device/stream.h"

namespace hps::cpu {

class StreamCore;

// The completion mark of one event record; shared by the event and the queued task.
class EventMark {
 public:
  EventMark() = default;
  // A mark completed by a task on `stream`; set_index() says which, before anyone waits.
  explicit EventMark(std::weak_ptr<StreamCore> stream) : stream_(std::move(stream)) {}
  void set_index(uint64_t index) { index_ = index; }
  void complete();
  bool completed() const;
  // Blocks the calling thread (a worker or, counted, the host) until the mark completes.
  // While the stream's worker is idle, the waiting thread runs the stream's queued tasks
  // up to the one that completes the mark itself, in order and one at a time, instead of
  // waking the worker and sleeping until it is done: two thread hand-offs saved.
  void wait() const;
  // Blocks the calling thread until the mark completes or `timeout` has passed; whether it
  // completed. Runs no task of the stream (one may block for long): the worker does.
  bool wait_for(std::chrono::nanoseconds timeout) const;
  // Blocks the calling thread until the mark completes or `stop` is requested; whether it
  // completed. Runs no task of the stream either: one may block for long, and no stop
  // reaches into it.
  bool wait(std::stop_token stop) const;

 private:
  mutable std::mutex mutex_;
  mutable std::condition_variable done_cv_;
  bool completed_ = false;
  std::weak_ptr<StreamCore> stream_;
  uint64_t index_ = 0;
};

// A CPU stream's queue, shared by its worker and by threads that wait on its marks.
class StreamCore {
 public:
  StreamCore();
  // Returns the 1-based index of the task. `label` (a static string, or null) names the
  // task in the timeline (core/trace).
  uint64_t enqueue(std::function<void()> task, const char* label = nullptr);
  uint32_t trace_track() const { return trace_track_; }
  // Runs queued tasks on the calling thread while no one else runs one, up to task
  // `index`.
  void help_until(uint64_t index);
  void run_worker();  // the worker's loop, until stop() and an empty queue
  void stop();
  void synchronize();  // until every task enqueued so far has finished
  // The first asynchronous error a task recorded since the last take_error(), or OK; taking
  // it clears it.
  void record_error(const Status& s);
  Status take_error();

 private:
  // Pops the front task (the caller holds `lock`), runs it unlocked, and records it done.
  void run_front(std::unique_lock<std::mutex>& lock);

  std::mutex mutex_;
  std::condition_variable work_cv_;
  std::condition_variable idle_cv_;
  struct Task {
    std::function<void()> run;
    const char* label;
  };
  std::deque<Task> queue_;
  const uint32_t trace_track_;
  uint64_t enqueued_ = 0;
  uint64_t started_ = 0;
  uint64_t finished_ = 0;
  bool busy_ = false;  // a task is running (on the worker or a helping thread)
  bool stopping_ = false;
  mutable std::mutex error_mutex_;
  Status error_;
};

// What the CPU kernels, copies and events need of a CPU stream: a place to enqueue host
// work in order, and a mark for an event record. Two kinds: CpuStream (a worker thread
// runs the queue beside the caller) and CallerStream (the calling thread itself).
class HostQueue : public Stream {
 public:
  Device device() const override { return Device::cpu(); }
  // Runs `task` after everything enqueued before it. `label` (a static string) names the
  // task for timelines.
  virtual void enqueue(std::function<void()> task, const char* label = nullptr) = 0;
  // Enqueues the completion of a new mark and returns it.
  virtual std::shared_ptr<EventMark> record_mark() = 0;
  Status memcpy_async(void* dst, const void* src, size_t bytes) override;
  Status memset_async(void* dst, int value, size_t bytes) override;
};

class CpuStream final : public HostQueue {
 public:
  CpuStream();
  ~CpuStream() override;  // finishes the queued work, then joins the worker
  CpuStream(const CpuStream&) = delete;
  CpuStream& operator=(const CpuStream&) = delete;

  Status wait(Event& event) override;
  // As wait(), except that the stream stops waiting once `stop` is requested: work
  // enqueued after this call then runs without waiting for the rest of `event`'s work.
  // For a communicator's operations queued behind a caller's stream that may never get
  // there (blocked behind another group's operation): its abort ends them at once.
  Status wait(Event& event, std::stop_token stop);
  Status wait_for_outcome(Event& event, std::function<Status()> outcome) override;
  Status synchronize() override;

  // Enqueues `task` to run on the worker after everything enqueued before it. `label`
  // names it in the timeline (HPS_TRACE): a static string ("adamw", "copy"), or null for
  // "task".
  void enqueue(std::function<void()> task, const char* label = nullptr) override;
  // This stream's track in the timeline, and the name the timeline gives it.
  uint32_t trace_track() const { return core_->trace_track(); }
  void set_trace_name(std::string name);
  void set_name(std::string name) override { set_trace_name(std::move(name)); }
  std::shared_ptr<EventMark> record_mark() override;

 private:
  std::shared_ptr<StreamCore> core_;
  std::thread worker_;
};

// The calling thread as a stream: on the CPU a framework computes on its own thread, so
// "work enqueued on the compute stream" runs at once, and "the compute stream waits for
// an event" blocks that thread — a dependency wait (counted apart from host syncs, with
// the time blocked; host_sync.h), not a host sync. Engines use it when the framework
// gives no compute stream, so their protocol is the same for every device.
class CallerStream final : public HostQueue {
 public:
  Status wait(Event& event) override;
  // The outcome is known when the wait returns: a failure is returned.
  Status wait_for_outcome(Event& event, std::function<Status()> outcome) override;
  // Everything enqueued has already run.
  Status synchronize() override { return Status::Ok(); }
  void enqueue(std::function<void()> task, const char* label = nullptr) override;
  std::shared_ptr<EventMark> record_mark() override;
};

class CpuEvent final : public Event {
 public:
  Device device() const override { return Device::cpu(); }
  Status record(Stream& stream) override;
  StatusOr<bool> query() override;
  Status synchronize() override;
  Status synchronize_uncounted() override;
  StatusOr<bool> wait_for(std::chrono::nanoseconds timeout) override;
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
