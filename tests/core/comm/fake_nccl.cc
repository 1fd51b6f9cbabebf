// A fake NCCL in non-blocking mode, loaded through hpshard's NCCL loader (nccl_api.h) by
// nccl_handle_test.cc: no GPU, no CUDA runtime. Each operation (init, split, a collective,
// finalize) follows the next entry of a script — ncclInProgress for some number of polls
// of ncclCommGetAsyncError, then a final state — and the fake records every call and every
// misuse the protocol forbids: a call on an aborted or destroyed communicator, an
// operation issued while the previous one is still in progress, two calls on one
// communicator at the same time, a blocking configuration.
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>

namespace {

struct Step {
  int polls;  // ncclInProgress answers before the final state; -1: for ever
  ncclResult_t final_state;
};

struct FakeComm {
  int polls_left = 0;
  ncclResult_t state = ncclSuccess;  // after the polls
  bool freed = false;
  bool settled = true;  // the current operation's final state was reported
  std::atomic<int> inside{0};
};

std::mutex g_mutex;
std::deque<Step> g_script;
std::string g_log;
int g_misuse = 0;
std::string g_misuse_what;
int g_aborts = 0;
int g_settled_operations = 0;

void log(const char* what) {
  g_log += what;
  g_log += ' ';
}

void misuse(const std::string& what) {
  ++g_misuse;
  if (g_misuse_what.empty()) g_misuse_what = what;
}

Step next_step() {
  if (g_script.empty()) return {0, ncclSuccess};
  const Step s = g_script.front();
  g_script.pop_front();
  return s;
}

// Entered by every call on a communicator: flags concurrent calls (the fake holds each call
// open a little, so overlapping callers meet) and calls on a freed one.
class Entry {
 public:
  Entry(FakeComm* comm, const char* what) : comm_(comm) {
    if (comm_ == nullptr) return;
    if (comm_->inside.fetch_add(1) != 0) {
      std::lock_guard lock(g_mutex);
      misuse(std::string("concurrent call: ") + what);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
    std::lock_guard lock(g_mutex);
    if (comm_->freed) misuse(std::string("call on a freed communicator: ") + what);
  }
  ~Entry() {
    if (comm_ != nullptr) comm_->inside.fetch_sub(1);
  }

 private:
  FakeComm* comm_;
};

FakeComm* fake(ncclComm_t comm) { return reinterpret_cast<FakeComm*>(comm); }

// Starts an operation on `c` from the script; what the call returns.
ncclResult_t begin(FakeComm* c, const char* what) {
  std::lock_guard lock(g_mutex);
  log(what);
  if (!c->settled) misuse(std::string("issued while in progress: ") + what);
  const Step s = next_step();
  c->polls_left = s.polls;
  c->state = s.final_state;
  c->settled = s.polls == 0;
  if (s.polls != 0) return ncclInProgress;
  if (s.final_state == ncclSuccess) ++g_settled_operations;
  return s.final_state;
}

ncclResult_t collective(ncclComm_t comm, const char* what) {
  Entry entry(fake(comm), what);
  return begin(fake(comm), what);
}

}  // namespace

extern "C" {

// ---- control, for the test ----

void fake_nccl_reset() {
  std::lock_guard lock(g_mutex);
  g_script.clear();
  g_log.clear();
  g_misuse = 0;
  g_misuse_what.clear();
  g_aborts = 0;
  g_settled_operations = 0;
}
void fake_nccl_script(int polls, int final_state) {
  std::lock_guard lock(g_mutex);
  g_script.push_back({polls, static_cast<ncclResult_t>(final_state)});
}
// Copies the call log into `out` (NUL-terminated, truncated to `size`).
void fake_nccl_log(char* out, size_t size) {
  std::lock_guard lock(g_mutex);
  std::strncpy(out, g_log.c_str(), size - 1);
  out[size - 1] = '\0';
}
int fake_nccl_misuse(char* what, size_t size) {
  std::lock_guard lock(g_mutex);
  std::strncpy(what, g_misuse_what.c_str(), size - 1);
  what[size - 1] = '\0';
  return g_misuse;
}
int fake_nccl_aborts() {
  std::lock_guard lock(g_mutex);
  return g_aborts;
}
// Operations whose state has become ncclSuccess (for a collective: its work is "enqueued").
int fake_nccl_settled() {
  std::lock_guard lock(g_mutex);
  return g_settled_operations;
}

// ---- the NCCL API hpshard loads ----

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess: return "no error";
    case ncclSystemError: return "fake system error";
    case ncclRemoteError: return "fake remote error";
    case ncclInProgress: return "in progress";
    default: return "fake error";
  }
}

ncclResult_t ncclGetVersion(int* version) {
  *version = 22803;
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  std::memset(id->internal, 0, sizeof id->internal);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int, ncclUniqueId, int,
                                    ncclConfig_t* config) {
  auto* c = new FakeComm;
  *comm = reinterpret_cast<ncclComm_t>(c);
  if (config == nullptr || config->blocking != 0) {
    std::lock_guard lock(g_mutex);
    misuse("a blocking communicator");
  }
  return begin(c, "init");
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int, ncclComm_t* newcomm,
                           ncclConfig_t* config) {
  Entry entry(fake(comm), "split");
  if (color == NCCL_SPLIT_NOCOLOR) {
    *newcomm = nullptr;
    return begin(fake(comm), "split");
  }
  auto* c = new FakeComm;
  *newcomm = reinterpret_cast<ncclComm_t>(c);
  if (config == nullptr || config->blocking != 0) {
    std::lock_guard lock(g_mutex);
    misuse("a blocking communicator");
  }
  return begin(c, "split");
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state) {
  Entry entry(fake(comm), "poll");
  FakeComm* c = fake(comm);
  std::lock_guard lock(g_mutex);
  log("poll");
  if (c->polls_left != 0) {
    if (c->polls_left > 0) --c->polls_left;
    *state = ncclInProgress;
    return ncclSuccess;
  }
  if (!c->settled) {
    c->settled = true;
    if (c->state == ncclSuccess) ++g_settled_operations;
  }
  *state = c->state;
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  Entry entry(fake(comm), "abort");
  std::lock_guard lock(g_mutex);
  log("abort");
  ++g_aborts;
  fake(comm)->freed = true;  // leaked on purpose: later misuse stays detectable
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  Entry entry(fake(comm), "finalize");
  return begin(fake(comm), "finalize");
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  Entry entry(fake(comm), "destroy");
  std::lock_guard lock(g_mutex);
  log("destroy");
  fake(comm)->freed = true;
  return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t comm,
                           cudaStream_t) {
  return collective(comm, "all_reduce");
}
ncclResult_t ncclReduce(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, int,
                        ncclComm_t comm, cudaStream_t) {
  return collective(comm, "reduce");
}
ncclResult_t ncclBroadcast(const void*, void*, size_t, ncclDataType_t, int, ncclComm_t comm,
                           cudaStream_t) {
  return collective(comm, "broadcast");
}
ncclResult_t ncclAllGather(const void*, void*, size_t, ncclDataType_t, ncclComm_t comm,
                           cudaStream_t) {
  return collective(comm, "all_gather");
}
ncclResult_t ncclReduceScatter(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t,
                               ncclComm_t comm, cudaStream_t) {
  return collective(comm, "reduce_scatter");
}
ncclResult_t ncclSend(const void*, size_t, ncclDataType_t, int, ncclComm_t comm, cudaStream_t) {
  return collective(comm, "send");
}
ncclResult_t ncclRecv(void*, size_t, ncclDataType_t, int, ncclComm_t comm, cudaStream_t) {
  return collective(comm, "recv");
}

}  // extern "C"
