#include "core/comm/communicator.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <stop_token>

#define XXH_INLINE_ALL  // header-only: libhpshard gains no shared-library dependency
#include <xxhash.h>

#include "core/comm/agreement.h"
#include "core/comm/descriptor.h"
#include "core/comm/self/communicator.h"
#include "core/comm/shm/shm_group.h"
#include "core/common/config.h"
#include "core/common/env.h"
#include "core/device/cpu/stream.h"
#if HPS_HAVE_GLOO
#include "core/comm/gloo/communicator.h"
#endif
#if HPS_HAVE_NCCL
#include "core/comm/nccl/communicator.h"
#endif

namespace hps {

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "unknown";
}

StatusOr<ReduceOp> reduce_op_from_int(int32_t raw) {
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
    if (static_cast<int32_t>(op) == raw) return op;
  }
  return invalid_argument("unknown reduction " + std::to_string(raw) +
                          " (0=sum, 1=avg, 2=max, 3=min)");
}

std::string tag_text(uint64_t tag) {
  const char* what = tag == kEngineClipTag       ? "an engine's clip norm"
                     : tag == kClipTag           ? "a standalone clip's norm"
                     : tag == kEngineFoundInfTag ? "an engine's found-inf flag"
                                                 : nullptr;
  return "tag " + std::to_string(tag) + (what ? std::string(" (") + what + ")" : std::string());
}

Status check_comm_timeout(Milliseconds timeout, std::string_view what) {
  if (timeout.count() > 0 && timeout <= kMaxCommTimeout) return Status::Ok();
  return invalid_argument(std::string(what) + " = " + std::to_string(timeout.count()) +
                          " ms is outside [1, " + std::to_string(kMaxCommTimeout.count()) +
                          "] (one year)");
}

StatusOr<CommOptions> comm_options_from_env(CommOptions defaults) {
  HPS_ASSIGN_OR_RETURN(
      int64_t timeout_ms,
      env_int_in("HPS_COMM_TIMEOUT_MS", defaults.timeout.count(), 1, kMaxCommTimeout.count()));
  HPS_ASSIGN_OR_RETURN(bool check, env_flag("HPS_COMM_CHECK", defaults.check_arguments));
  HPS_ASSIGN_OR_RETURN(bool shm, env_flag("HPS_COMM_SHM", defaults.shared_memory));
  HPS_ASSIGN_OR_RETURN(
      int64_t slot_bytes,
      env_int_in("HPS_COMM_SHM_SLOT_BYTES", static_cast<int64_t>(defaults.shared_memory_slot_bytes),
                 0, static_cast<int64_t>(shm::kMaxSlotBytes)));
  HPS_ASSIGN_OR_RETURN(bool direct, env_flag("HPS_COMM_SHM_DIRECT", defaults.shared_memory_direct));
  defaults.timeout = Milliseconds(timeout_ms);
  defaults.check_arguments = check;
  defaults.shared_memory = shm;
  defaults.shared_memory_slot_bytes = static_cast<size_t>(slot_bytes);
  defaults.shared_memory_direct = direct;
  return defaults;
}

Status check_comm_name(std::string_view name, std::string_view what) {
  return check_shown_name(name, what, kMaxCommNameBytes);
}

std::string derived_comm_name(std::string_view base, std::string_view suffix) {
  const size_t keep =
      utf8_prefix_bytes(base, kMaxCommNameBytes - std::min(suffix.size(), kMaxCommNameBytes));
  return std::string(base.substr(0, keep)) + std::string(suffix);
}

Status check_buffer(const CommArgs& a, const char* which, const void* pointer, size_t count,
                    DType dtype, size_t multiple) {
  const size_t element = dtype_size(dtype);
  const size_t limit = std::numeric_limits<size_t>::max() / element / (multiple ? multiple : 1);
  if (count > limit || count > (size_t{1} << 60)) {
    return invalid_argument(std::string(a.operation) + " on group '" + a.group + "': " + which +
                            " count " + std::to_string(count) + " overflows the byte size");
  }
  if (pointer == nullptr && count > 0) {
    return invalid_argument(std::string(a.operation) + " on group '" + a.group + "': " + which +
                            " is null with count " + std::to_string(count));
  }
  // The reductions and copies load and store whole elements.
  if (count > 0 && reinterpret_cast<uintptr_t>(pointer) % element != 0) {
    return invalid_argument(std::string(a.operation) + " on group '" + a.group + "': " + which +
                            " is not aligned to its " + std::string(dtype_name(dtype)) +
                            " elements (" + std::to_string(element) + " bytes)");
  }
  return Status::Ok();
}

namespace {

// Send and recv disjoint, or send exactly at `in_place`; sizes already checked (no range
// end wraps).
Status check_overlap(const CommArgs& a, const void* send, size_t send_bytes, const void* recv,
                     size_t recv_bytes, uintptr_t in_place) {
  const auto s = reinterpret_cast<uintptr_t>(send), r = reinterpret_cast<uintptr_t>(recv);
  if (send_bytes == 0 || recv_bytes == 0 || s == in_place) return Status::Ok();
  if (s + send_bytes <= r || r + recv_bytes <= s) return Status::Ok();
  const std::string where = r >= s ? "recv starts " + std::to_string(r - s) + " bytes into send"
                                   : "send starts " + std::to_string(s - r) + " bytes into recv";
  return invalid_argument(std::string(a.operation) + " on group '" + a.group + "': send (" +
                          std::to_string(send_bytes) + " bytes) and recv (" +
                          std::to_string(recv_bytes) + " bytes) overlap (" + where +
                          ") and are not the in-place form");
}

}  // namespace

Status check_reduce_buffers(const CommArgs& a, const void* send, const void* recv, size_t count,
                            DType dtype, bool receives) {
  HPS_RETURN_IF_ERROR(check_buffer(a, "send", send, count, dtype));
  if (!receives) return Status::Ok();
  HPS_RETURN_IF_ERROR(check_buffer(a, "recv", recv, count, dtype));
  const size_t bytes = count * dtype_size(dtype);
  return check_overlap(a, send, bytes, recv, bytes, reinterpret_cast<uintptr_t>(recv));
}

Status check_all_gather_buffers(const CommArgs& a, int32_t rank, const void* send, const void* recv,
                                size_t count, DType dtype) {
  const auto ranks = static_cast<size_t>(a.size);
  HPS_RETURN_IF_ERROR(check_buffer(a, "send", send, count, dtype));
  HPS_RETURN_IF_ERROR(check_buffer(a, "recv", recv, count, dtype, ranks));
  const size_t bytes = count * dtype_size(dtype);
  return check_overlap(a, send, bytes, recv, bytes * ranks,
                       reinterpret_cast<uintptr_t>(recv) + static_cast<size_t>(rank) * bytes);
}

Status check_reduce_scatter_buffers(const CommArgs& a, int32_t rank, const void* send,
                                    const void* recv, size_t count, DType dtype) {
  const auto ranks = static_cast<size_t>(a.size);
  HPS_RETURN_IF_ERROR(check_buffer(a, "send", send, count, dtype, ranks));
  HPS_RETURN_IF_ERROR(check_buffer(a, "recv", recv, count, dtype));
  const size_t bytes = count * dtype_size(dtype);
  return check_overlap(a, send, bytes * ranks, recv, bytes,
                       reinterpret_cast<uintptr_t>(recv) - static_cast<size_t>(rank) * bytes);
}

namespace {

// "all_gather #44 with count 87424, dtype float32, op sum, root 0"; a peer's fields are
// named where they are known values and shown as numbers otherwise.
std::string describe(const CollectiveDescriptor& d) {
  static constexpr const char* kKinds[] = {"all_reduce", "reduce",         "broadcast",
                                           "all_gather", "reduce_scatter", "barrier"};
  const bool known = d.kind >= kAllReduceKind && d.kind <= kBarrierKind;
  const std::string kind =
      known ? kKinds[d.kind - kAllReduceKind] : "operation kind " + std::to_string(d.kind);
  const std::string_view dtype = dtype_name(static_cast<DType>(d.dtype));
  const std::string_view op = reduce_op_name(static_cast<ReduceOp>(d.op));
  return kind + " #" + std::to_string(d.sequence) + " with count " + std::to_string(d.count) +
         ", dtype " + (dtype == "unknown" ? std::to_string(d.dtype) : std::string(dtype)) +
         ", op " + (op == "unknown" ? std::to_string(d.op) : std::string(op)) + ", root " +
         std::to_string(d.root) + (d.tag != 0 ? ", " + tag_text(d.tag) : std::string());
}

}  // namespace

Status check_agreement(const std::string& place, const CollectiveDescriptor& mine,
                       const CollectiveDescriptor* all, int32_t size, const RankNames& names) {
  std::string differences;
  for (int32_t r = 0; r < size; ++r) {
    const CollectiveDescriptor& d = all[r];
    if (std::memcmp(&d, &mine, sizeof(d)) == 0) continue;
    differences += "; " + names(r) + " called " + describe(d);
  }
  if (differences.empty()) return Status::Ok();
  return invalid_argument((place.empty() ? std::string() : place + ": ") +
                          "ranks disagree on the call (nothing was sent): this rank called " +
                          describe(mine) + differences);
}

Status check_rank_in_group(const CommArgs& a, const char* which, int32_t rank) {
  if (rank < 0 || rank >= a.size) {
    return out_of_range(std::string(a.operation) + " on group '" + a.group + "': " + which + " " +
                        std::to_string(rank) + " is outside the group of " +
                        std::to_string(a.size));
  }
  return Status::Ok();
}

StatusOr<std::unique_ptr<Communicator>> create_communicator(std::shared_ptr<Store> store,
                                                            int32_t rank, int32_t size,
                                                            Device device,
                                                            const CommOptions& options) {
  if (!store) return invalid_argument("create_communicator: the store is null");
  if (size < 1) return invalid_argument("create_communicator: size must be at least 1");
  if (size > kMaxGroupSize) {
    return out_of_range("create_communicator: a group of " + std::to_string(size) +
                        " ranks is larger than the largest hpshard creates (" +
                        std::to_string(kMaxGroupSize) + ")");
  }
  if (rank < 0 || rank >= size) {
    return out_of_range("create_communicator: rank " + std::to_string(rank) +
                        " is outside a group of " + std::to_string(size));
  }
  HPS_RETURN_IF_ERROR(check_comm_timeout(options.timeout, "create_communicator: the timeout"));
  HPS_RETURN_IF_ERROR(check_comm_name(options.name, "create_communicator: the group's name"));
  if (options.shared_memory_slot_bytes > shm::kMaxSlotBytes) {
    return invalid_argument("create_communicator: shared-memory slots of " +
                            std::to_string(options.shared_memory_slot_bytes) +
                            " bytes are larger than the limit of " +
                            std::to_string(shm::kMaxSlotBytes));
  }
  if (!options.world_ranks.empty() && options.world_ranks.size() != static_cast<size_t>(size)) {
    return invalid_argument(
        "create_communicator: the world rank list (CommOptions::world_ranks) has " +
        std::to_string(options.world_ranks.size()) + " ranks for a group of " +
        std::to_string(size));
  }
  for (const int32_t w : options.world_ranks) {
    if (w < 0) {
      return invalid_argument(
          "create_communicator: the world rank list (CommOptions::world_ranks) holds " +
          std::to_string(w) + ", which is no rank");
    }
  }
  HPS_RETURN_IF_ERROR(check_device(device));
  if (device.type == DeviceType::kCpu) {
#if HPS_HAVE_GLOO
    return gloo_backend::GlooCommunicator::create(std::move(store), rank, size, options);
#else
    // A group of one moves nothing, so it needs no transport.
    if (size == 1) return self_backend::SelfCommunicator::create(options);
    return unavailable(
        "CPU communicators of more than one rank need Gloo, and this build of "
        "hpshard has none");
#endif
  }
#if HPS_HAVE_NCCL
  return nccl_backend::NcclCommunicator::create(std::move(store), rank, size, device.index,
                                                options);
#else
  return unavailable("CUDA communicators need NCCL, and this build of hpshard has none");
#endif
}

// Who a communicator's abort and failure reach: itself while it lives, the nodes of the
// communicators tied to it, and its failure links' listeners. Recursive: an abort holds a
// node's lock while it runs that communicator's abort, which takes the same lock to list
// its own dependents.
struct Communicator::AbortNode {
  std::recursive_mutex mutex;
  Communicator* comm = nullptr;
  std::vector<std::weak_ptr<AbortNode>> dependents;
  bool aborting = false;  // this thread is in its abort (ties that loop end here)
  std::atomic<bool> aborted{false};
  // Requested by the abort, after the backend's: ends the stream's waits for ready streams.
  std::stop_source stop;

  // The failure links' listeners, and the failure they were told of (the first only).
  std::mutex listeners_mutex;
  std::map<uint64_t, std::function<void(const Status&)>> listeners;
  uint64_t next_listener = 0;
  std::optional<Status> told;

  // Tells the listeners of `failure`, unless they were told of one; called with no lock held
  // (a listener fails other communicators, whose listeners may reach this one).
  void notify(const Status& failure) {
    std::vector<std::function<void(const Status&)>> calls;
    {
      std::lock_guard lock(listeners_mutex);
      if (told) return;
      told = failure;
      for (const auto& [id, listener] : listeners) calls.push_back(listener);
    }
    for (const auto& call : calls) call(failure);
  }
  // Communicator::fail() through the node: nothing once the communicator is destroyed.
  void fail(const Status& cause) {
    {
      std::lock_guard lock(mutex);
      if (comm == nullptr) return;
      comm->fail_operations(cause);
    }
    notify(cause);
  }
};

Communicator::Communicator() : abort_node_(std::make_shared<AbortNode>()) {
  abort_node_->comm = this;
}

Communicator::~Communicator() { untie(); }

Status Communicator::finish() {
  // The stream's queue is the operations: an event at its end completes when they have
  // ended. Their errors are theirs (their works report them).
  HPS_ASSIGN_OR_RETURN(auto end, create_event(device()));
  HPS_RETURN_IF_ERROR(end->record(stream()));
  (void)end->synchronize_uncounted();
  return Status::Ok();
}

void Communicator::untie() {
  std::lock_guard lock(abort_node_->mutex);
  abort_node_->comm = nullptr;
}

void Communicator::tie(Communicator& dependent) {
  std::lock_guard lock(abort_node_->mutex);
  auto& list = abort_node_->dependents;
  list.erase(std::remove_if(list.begin(), list.end(), [](const auto& w) { return w.expired(); }),
             list.end());
  list.push_back(dependent.abort_node_);
}

void Communicator::abort() {
  // The links hear of every abort once all of them are done, with no node's lock held: a
  // listener fails other communicators, which takes their locks.
  std::vector<std::pair<std::shared_ptr<AbortNode>, Status>> aborts;
  abort_tree(aborts);
  for (const auto& [node, failure] : aborts) node->notify(failure);
}

void Communicator::abort_tree(std::vector<std::pair<std::shared_ptr<AbortNode>, Status>>& aborts) {
  std::vector<std::shared_ptr<AbortNode>> dependents;
  {
    std::lock_guard lock(abort_node_->mutex);
    if (abort_node_->comm == nullptr || abort_node_->aborting) return;
    aborts.emplace_back(abort_node_, aborted("group '" + name() + "' was aborted"));
    abort_node_->aborting = true;
    abort_node_->aborted = true;
    abort_operations();
    abort_node_->stop.request_stop();
    for (const auto& w : abort_node_->dependents) {
      if (auto node = w.lock()) dependents.push_back(std::move(node));
    }
  }
  for (const auto& node : dependents) {
    std::lock_guard lock(node->mutex);
    if (node->comm != nullptr) node->comm->abort_tree(aborts);
  }
  std::lock_guard lock(abort_node_->mutex);
  abort_node_->aborting = false;
}

void Communicator::fail(const Status& cause) {
  if (cause.ok()) return;
  abort_node_->fail(cause);
}

void Communicator::notify_failure(const Status& failure) {
  if (failure.ok()) return;
  abort_node_->notify(failure);
}

Communicator::FailureLink::~FailureLink() {
  for (const auto& [node, id] : listeners_) {
    std::lock_guard lock(node->listeners_mutex);
    node->listeners.erase(id);
  }
}

std::unique_ptr<Communicator::FailureLink> Communicator::link_failures(
    const std::vector<Communicator*>& groups, std::string who) {
  std::vector<Communicator*> present;
  for (Communicator* c : groups) {
    if (c != nullptr && std::find(present.begin(), present.end(), c) == present.end()) {
      present.push_back(c);
    }
  }
  std::unique_ptr<FailureLink> link(new FailureLink());
  if (present.size() < 2) return link;
  struct Member {
    std::weak_ptr<AbortNode> node;
    std::string name;
  };
  auto members = std::make_shared<std::vector<Member>>();
  for (Communicator* c : present) members->push_back({c->abort_node_, c->name()});
  // Member i's failure fails the others (a node whose communicator is gone is skipped).
  auto fail_others = [members, who = std::move(who)](size_t i, const Status& failure) {
    const Member& from = (*members)[i];
    for (size_t j = 0; j < members->size(); ++j) {
      if (j == i) continue;
      const Member& to = (*members)[j];
      if (auto node = to.node.lock()) {
        node->fail(aborted(who + ": group '" + to.name + "' fails with group '" + from.name +
                           "': " + failure.message()));
      }
    }
  };
  std::optional<std::pair<size_t, Status>> failed_already;
  for (size_t i = 0; i < present.size(); ++i) {
    const auto& node = present[i]->abort_node_;
    std::lock_guard lock(node->listeners_mutex);
    if (node->told) {
      if (!failed_already) failed_already.emplace(i, *node->told);
      continue;  // the others fail below; a listener here would never run
    }
    const uint64_t id = node->next_listener++;
    node->listeners.emplace(id, [fail_others, i](const Status& f) { fail_others(i, f); });
    link->listeners_.emplace_back(node, id);
  }
  if (failed_already) fail_others(failed_already->first, failed_already->second);
  return link;
}

bool Communicator::was_aborted() const { return abort_node_->aborted.load(); }

Status Communicator::wait_for_ready(cpu::CpuStream& own, Stream* ready,
                                    std::string_view operation) {
  if (ready == nullptr) return Status::Ok();
  if (ready->device().type != DeviceType::kCpu) {
    return invalid_argument(std::string(operation) + ": the ready stream is on " +
                            ready->device().to_string() + ", not the cpu");
  }
  cpu::CpuEvent ready_event;
  HPS_RETURN_IF_ERROR(ready_event.record(*ready));
  return own.wait(ready_event, abort_node_->stop.get_token());
}

namespace {

// How many ranks of a list a message about lists that differ shows.
constexpr size_t kShownSplitRanks = 16;

// A rank's list as a message about lists that differ shows it: its first ranks, or only
// its length where it is longer than the group (such a list is not read).
std::string shown_rank_list(const uint64_t* ranks, uint64_t count, int32_t group_size) {
  if (count > static_cast<uint64_t>(group_size)) {
    return "a list of " + std::to_string(count) + " ranks";
  }
  const size_t shown = static_cast<size_t>(std::min<uint64_t>(count, kShownSplitRanks));
  std::string text = "[";
  for (size_t i = 0; i < shown; ++i) {
    if (i) text += ", ";
    text += std::to_string(static_cast<int64_t>(ranks[i]));
  }
  if (count > shown) text += ", ... (" + std::to_string(count) + " ranks)";
  return text + "]";
}

// The ranks of `comm` compare their split lists (count and XXH3 of the list, one small
// all-gather) so that lists that differ fail on every rank, members and others alike,
// before anything of the split is made: otherwise ranks that agree among themselves make
// their group while the others wait in vain or pair with the wrong ranks. Only when the
// lists differ does a second all-gather bring their first ranks, for the message. A list
// longer than the group (`count` > its size) is not read: it takes part by its count.
Status check_same_split_lists(Communicator& comm, const int32_t* ranks, uint64_t count,
                              const std::string& what) {
  const bool readable = count <= static_cast<uint64_t>(comm.size());
  const uint64_t hash = readable ? XXH3_64bits(ranks, count * sizeof(int32_t)) : 0;
  auto summaries = gather_values(comm, std::vector<uint64_t>{count, hash});
  if (!summaries.ok()) {
    return summaries.status().with_context(what + ": comparing the ranks' lists");
  }
  const size_t size = static_cast<size_t>(comm.size());
  const auto summary = [&](size_t r) {
    return std::pair((*summaries)[2 * r], (*summaries)[2 * r + 1]);
  };
  size_t first_other = 0, others = 0;
  uint64_t widest = 0;
  for (size_t r = 0; r < size; ++r) {
    if (summary(r).first <= size) widest = std::max(widest, summary(r).first);
    if (summary(r) == summary(0)) continue;
    if (others++ == 0) first_other = r;
  }
  if (others == 0) return Status::Ok();
  const size_t width = static_cast<size_t>(std::min<uint64_t>(widest, kShownSplitRanks));
  std::vector<uint64_t> mine(width, 0);
  for (size_t i = 0; readable && i < std::min<uint64_t>(width, count); ++i) {
    mine[i] = static_cast<uint64_t>(static_cast<int64_t>(ranks[i]));
  }
  auto lists = gather_values(comm, mine);
  if (!lists.ok()) return lists.status().with_context(what + ": comparing the ranks' lists");
  const std::string theirs =
      shown_rank_list(lists->data() + first_other * width, summary(first_other).first, comm.size());
  const std::string first = shown_rank_list(lists->data(), summary(0).first, comm.size());
  const RankNames& names = comm.rank_names();
  std::string message = what + ": " + names(static_cast<int32_t>(first_other)) + " gave " +
                        (theirs[0] == '[' ? "ranks " : "") + theirs + ", " + names(0) + " gave " +
                        first;
  if (theirs == first) message += " (they differ after the first " + std::to_string(width) + ")";
  if (others > 1) {
    message += " (" + std::to_string(others) + " of the " + std::to_string(size) +
               " ranks gave another list than rank 0's)";
  }
  return invalid_argument(message + ": every rank gives the same list");
}

// A list every rank gave: not empty, each rank in the group once.
Status check_split_list(const Communicator& comm, const int32_t* ranks, uint64_t count) {
  const CommArgs a{"split", comm.name(), comm.size()};
  if (count == 0) return invalid_argument("split of group '" + comm.name() + "': no ranks");
  std::vector<int32_t> sorted(ranks, ranks + count);
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    HPS_RETURN_IF_ERROR(check_rank_in_group(a, "rank", sorted[i]));
    if (i && sorted[i] == sorted[i - 1]) {
      return invalid_argument("split of group '" + comm.name() + "': rank " +
                              std::to_string(sorted[i]) + " is listed twice");
    }
  }
  return Status::Ok();
}

}  // namespace

StatusOr<std::unique_ptr<Communicator>> Communicator::split(const std::vector<int32_t>& ranks,
                                                            std::string name) {
  return split(ranks.data(), ranks.size(), std::move(name));
}

StatusOr<std::unique_ptr<Communicator>> Communicator::split(const int32_t* ranks, uint64_t count,
                                                            std::string name) {
  HPS_RETURN_IF_ERROR(check_comm_name(name, "split of group '" + this->name() + "': the name"));
  if (was_aborted()) return aborted("split of group '" + this->name() + "': the group was aborted");
  if (ranks == nullptr && count > 0) {
    return invalid_argument("split of group '" + this->name() + "': the rank list is null");
  }
  // Every rank of the group takes part, a one-rank part's too: the lists are compared first,
  // then checked (the same list gives the same answer on every rank).
  const std::string what = "split of group '" + this->name() + "' into '" + name + "'";
  HPS_RETURN_IF_ERROR(check_same_split_lists(*this, ranks, count, what));
  if (count > static_cast<uint64_t>(size())) {
    return invalid_argument(what + ": count " + std::to_string(count) +
                            " is more than the group's " + std::to_string(size()) + " ranks");
  }
  HPS_RETURN_IF_ERROR(check_split_list(*this, ranks, count));
  std::vector<int32_t> members(ranks, ranks + count);
  std::vector<int32_t> world_ranks = rank_names_.world_of(members);
  HPS_ASSIGN_OR_RETURN(auto part, split_group(members, std::move(name), std::move(world_ranks)));
  if (part) tie(*part);
  return part;
}

Status check_topology_axis(const Communicator& comm, std::string_view axis, std::string_view who) {
  const std::string& mine = comm.topology_axis();
  if (mine.empty() || mine == axis) return Status::Ok();
  // The pp group given as mp (or the sep group as either) would sum over the wrong ranks.
  return invalid_argument(std::string(who) + ": the " + std::string(axis) +
                          " communicator is the hybrid topology's '" + mine + "' group, not its " +
                          std::string(axis) + " group");
}

}  // namespace hps
