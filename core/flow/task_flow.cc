#include "core/flow/task_flow.h"

#include "core/device/host_sync.h"

namespace hps {

Status TaskFlow::add(Task task) {
  if (!task.work) return invalid_argument("task flow: a task needs the work it tracks");
  tasks_.push_back(std::move(task));
  return Status::Ok();
}

Status TaskFlow::wait(Stream& stream) {
  for (auto& t : tasks_) HPS_RETURN_IF_ERROR(t.work->wait_on(stream));
  return Status::Ok();
}

Status TaskFlow::complete_front() {
  Task task = std::move(tasks_.front());
  tasks_.pop_front();
  const Status s = task.work->status();
  if (task.callback) task.callback(s);
  return s;  // task.keep_alive goes here, after the operation finished
}

StatusOr<size_t> TaskFlow::poll() {
  size_t completed = 0;
  while (!tasks_.empty()) {
    HPS_ASSIGN_OR_RETURN(bool finished, tasks_.front().work->done_event().query());
    if (!finished) break;
    (void)complete_front();  // a failed task's status reaches its callback
    ++completed;
  }
  return completed;
}

Status TaskFlow::drain() {
  if (tasks_.empty()) return Status::Ok();
  count_host_sync(HostSyncKind::kTaskFlowDrain);
  Status first;
  while (!tasks_.empty()) {
    Status waited = tasks_.front().work->done_event().synchronize_uncounted();
    Status s = complete_front();
    if (first.ok() && !waited.ok()) first = waited;
    if (first.ok() && !s.ok()) first = s;
  }
  return first;
}

}  // namespace hps
