// Communicator: collectives and point-to-point transfers among a group of ranks. Every
// operation is asynchronous: it is enqueued on the communicator's own stream and
// returns a Work whose completion is an Event there. Backends: gloo/ (CPU buffers,
// ranks over TCP) and nccl/ (CUDA buffers). Argument checks shared by both live here.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/comm/rank_names.h"
#include "core/comm/store.h"
#include "core/comm/work.h"
#include "core/common/dtype.h"
#include "core/device/device.h"
#include "core/device/stream.h"

namespace hps {

namespace cpu {
class CpuStream;
}

// Numeric values are the C API's hps_reduce_op_t.
enum class ReduceOp : int32_t { kSum = 0, kAvg = 1, kMax = 2, kMin = 3 };
std::string_view reduce_op_name(ReduceOp op);
StatusOr<ReduceOp> reduce_op_from_int(int32_t raw);

inline constexpr Milliseconds kDefaultCommTimeout{300'000};
// Timeouts beyond a year are refused (deadlines computed from them must not overflow).
inline constexpr Milliseconds kMaxCommTimeout{365LL * 24 * 3600 * 1000};
// The largest group a communicator is created for: each rank keeps per-peer state
// (connections, counters), and a larger request is a mistake (OUT_OF_RANGE), not a job.
inline constexpr int32_t kMaxGroupSize = 1 << 16;

// The tags (Communicator::all_reduce's `tag`) of hpshard's own collectives besides an
// engine's buckets (which count from 1): with argument checks on, a rank whose call at one
// place is another of them, or a caller's untagged collective of the same size, is refused.
inline constexpr uint64_t kOwnTags = uint64_t{1} << 48;
inline constexpr uint64_t kEngineClipTag = kOwnTags + 1;      // an engine's clip norm
inline constexpr uint64_t kClipTag = kOwnTags + 2;            // a standalone clip's norm
inline constexpr uint64_t kEngineFoundInfTag = kOwnTags + 3;  // an engine's found-inf flag
// "tag 5", or for one of hpshard's own: "tag 281474976710657 (an engine's clip norm)".
std::string tag_text(uint64_t tag);

// INVALID_ARGUMENT naming `what` unless 0 < timeout <= kMaxCommTimeout.
Status check_comm_timeout(Milliseconds timeout, std::string_view what);

// A group's name goes into every message about its operations: 1 to kMaxCommNameBytes
// bytes of UTF-8 without control characters, or INVALID_ARGUMENT naming `what`.
inline constexpr size_t kMaxCommNameBytes = 1024;
Status check_comm_name(std::string_view name, std::string_view what);
// The name of a group made from `base`'s: base + suffix, base cut (at a UTF-8 character's
// start) so that the whole stays within kMaxCommNameBytes. `suffix` is shorter than that.
std::string derived_comm_name(std::string_view base, std::string_view suffix);

struct CommOptions {
  // Every operation ends by this deadline: TIMEOUT on the ranks still waiting.
  Milliseconds timeout = kDefaultCommTimeout;
  // The group's name in messages ("world", "dp", "sharding", ...); see check_comm_name.
  std::string name = "world";
  // Before each collective, ranks exchange a small descriptor (operation, dtype, count,
  // root, sequence number) so mismatched calls fail on every rank with nothing sent.
  // Costs one small all-gather per collective over TCP; over shared memory the descriptor
  // rides in the collective's first round and is compared whatever this says. Default from
  // HPS_COMM_CHECK (1 = on).
  bool check_arguments = true;
  // CPU groups whose ranks all run on one host (processes or threads) move collective
  // data through a shared-memory segment instead of TCP (send / recv stay on TCP). The
  // ranks agree at creation; any rank that cannot map the segment makes all use TCP.
  // Default from HPS_COMM_SHM (1 = on).
  bool shared_memory = true;
  // Bytes of each of a rank's two staging slots in that segment; 0 = the default
  // (2 MiB), or HPS_COMM_SHM_SLOT_BYTES; at most 1 GiB (shm::kMaxSlotBytes).
  size_t shared_memory_slot_bytes = 0;
  // Over shared memory, all-gather and broadcast read the peers' buffers in place (one
  // copy instead of two) where every rank can read every other's memory: threads of one
  // process, or processes that cross-memory attach (process_vm_readv) allows; elsewhere
  // they go through the staging slots. Default from HPS_COMM_SHM_DIRECT (1 = on; 0 keeps
  // every collective in the slots).
  bool shared_memory_direct = true;
  // The job's number (world rank) of each of the group's ranks, for messages about peers:
  // "rank 0 (world rank 2)" (RankNames). Empty: the group's numbers are the world's. A split
  // sets it for the group it makes; one of another length than the group is INVALID_ARGUMENT.
  std::vector<int32_t> world_ranks;
};

// Reads HPS_COMM_TIMEOUT_MS (1 ms to a year), HPS_COMM_CHECK, HPS_COMM_SHM and
// HPS_COMM_SHM_DIRECT (each 0 or 1) and HPS_COMM_SHM_SLOT_BYTES (0 to 1 GiB) over the
// defaults; a value outside its range is INVALID_ARGUMENT naming the variable.
StatusOr<CommOptions> comm_options_from_env(CommOptions defaults = {});

class Communicator {
  // Shared by a communicator and whoever reaches it (ties, failure links); defined in
  // communicator.cc.
  struct AbortNode;

 public:
  Communicator();
  virtual ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  virtual int32_t rank() const = 0;
  virtual int32_t size() const = 0;
  virtual Device device() const = 0;
  virtual const std::string& name() const = 0;
  // How messages name this group's ranks (CommOptions::world_ranks).
  const RankNames& rank_names() const { return rank_names_; }
  // How collectives move data: "shm" (one host, shared memory), "tcp" (Gloo), "nccl",
  // "self" (a CPU group of one rank in a build without Gloo: nothing moves).
  virtual std::string_view transport() const = 0;
  // The communicator's own stream: every operation runs there, in call order.
  virtual Stream& stream() = 0;
  virtual Milliseconds timeout() const = 0;
  virtual void set_timeout(Milliseconds timeout) = 0;

  // `ready`: when given, the operation starts only after the work enqueued on it so far
  // (the caller's compute stream); the host never blocks for it. In-place is allowed
  // where noted (send == recv; for all_gather send == recv + rank * count). `tag`: what
  // the caller means by this call (the engine: a bucket's number + 1); collectives pair
  // by their order, and with argument checks on, ranks whose calls at one place carry
  // different tags are refused like ranks with different counts (0: none).
  virtual StatusOr<std::shared_ptr<Work>> all_reduce(const void* send, void* recv, size_t count,
                                                     DType dtype, ReduceOp op,
                                                     Stream* ready = nullptr, uint64_t tag = 0) = 0;
  virtual StatusOr<std::shared_ptr<Work>> reduce(const void* send, void* recv, size_t count,
                                                 DType dtype, ReduceOp op, int32_t root,
                                                 Stream* ready = nullptr) = 0;
  virtual StatusOr<std::shared_ptr<Work>> broadcast(void* buffer, size_t count, DType dtype,
                                                    int32_t root, Stream* ready = nullptr) = 0;
  // recv holds size() * count elements, rank r's contribution at r * count.
  virtual StatusOr<std::shared_ptr<Work>> all_gather(const void* send, void* recv, size_t count,
                                                     DType dtype, Stream* ready = nullptr,
                                                     uint64_t tag = 0) = 0;
  // send holds size() * count elements; rank r receives the reduction of slice r.
  virtual StatusOr<std::shared_ptr<Work>> reduce_scatter(const void* send, void* recv, size_t count,
                                                         DType dtype, ReduceOp op,
                                                         Stream* ready = nullptr,
                                                         uint64_t tag = 0) = 0;
  virtual StatusOr<std::shared_ptr<Work>> send(const void* buffer, size_t count, DType dtype,
                                               int32_t peer, Stream* ready = nullptr) = 0;
  virtual StatusOr<std::shared_ptr<Work>> recv(void* buffer, size_t count, DType dtype,
                                               int32_t peer, Stream* ready = nullptr) = 0;
  virtual StatusOr<std::shared_ptr<Work>> barrier(Stream* ready = nullptr) = 0;

  // Collective over this communicator: every rank calls it with the same rank list (in
  // this communicator's numbering), in the same order. Members get the new
  // communicator (rank = position in `ranks`); the others get nullptr. The new one is
  // tied to this one: aborting this one aborts it. `name` as check_comm_name takes it.
  // Every rank takes part, members or not: the ranks first compare their lists (one small
  // all-gather over this communicator), and lists that differ are INVALID_ARGUMENT on
  // every rank, naming the split and two of the lists, with nothing made. So it returns
  // once every rank has called it, and fails (ABORTED, TIMEOUT) on a group that has lost
  // a rank or failed an operation. A list that every rank gives is then checked: an empty
  // one, or one that repeats a rank, is INVALID_ARGUMENT, a rank outside the group
  // OUT_OF_RANGE, on every rank alike.
  StatusOr<std::unique_ptr<Communicator>> split(const std::vector<int32_t>& ranks,
                                                std::string name);
  // The same with the list as `count` ranks at `ranks`. A count beyond the group's size is
  // INVALID_ARGUMENT with the list unread (the other ranks' lists differ from it, so theirs
  // fail too, naming its count).
  StatusOr<std::unique_ptr<Communicator>> split(const int32_t* ranks, uint64_t count,
                                                std::string name);

  // Blocks until the operations enqueued so far have ended (completed, failed or timed
  // out), whatever their outcome; abort() from another thread ends it early. Not a host sync
  // of the training step (uncounted). A close calls it before destroying the communicator.
  virtual Status finish();

  // Local, from any thread: pending and later operations end with ABORTED, on this
  // communicator and on every live one tied to it (split from it, or tie()d), and theirs.
  // It counts as this communicator's failure for its links (link_failures).
  void abort();
  // Whether abort() was called on this communicator (or reached it through a tie); any
  // thread. Lets work that runs no collective for a while (reading a checkpoint) end early.
  bool was_aborted() const;
  // `dependent`'s abort follows this one's from now until `dependent` is destroyed.
  void tie(Communicator& dependent);

  // Local, from any thread: this communicator fails with `cause` as when one of its own
  // operations fails: its pending and later operations end ABORTED naming it, and its peers'
  // operations with this rank fail (its connections end). Nothing when it has failed or was
  // aborted already. Unlike abort(), the communicators tied to it go on. `cause` is an error.
  void fail(const Status& cause);

  // Communicators that fail together (link_failures). Destroying it ends the link.
  class FailureLink {
   public:
    ~FailureLink();
    FailureLink(const FailureLink&) = delete;
    FailureLink& operator=(const FailureLink&) = delete;

   private:
    friend class Communicator;
    FailureLink() = default;
    std::vector<std::pair<std::shared_ptr<AbortNode>, uint64_t>> listeners_;
  };
  // While the returned link lives, the first failure of any of `groups` (an operation that
  // fails, fail(), or abort()) fails the others with ABORTED, the message naming `who`, the
  // group that failed and its failure. Null entries are skipped; a group that has failed
  // already fails the others at once. What needs it: a rank whose collective on one group
  // failed would otherwise run its later collectives on the others with what the failed one
  // left (a stream that waits on a failed work goes on), and peers that share no group with
  // the rank that failed would complete with wrong values, told nothing. Linked, every peer
  // of every group of the rank fails too, and so on across the groups of each.
  static std::unique_ptr<FailureLink> link_failures(const std::vector<Communicator*>& groups,
                                                    std::string who);

  // The axis of a hybrid topology this communicator is ("dp", "pp", "sharding", "sep",
  // "mp", ...), as HybridGroup made it; empty for any other communicator. Lets a user of
  // the group check that it was given the axis it needs.
  const std::string& topology_axis() const { return topology_axis_; }
  void set_topology_axis(std::string axis) { topology_axis_ = std::move(axis); }

 protected:
  // The backend's split (see split()). `world_ranks`: the new group's CommOptions::world_ranks.
  virtual StatusOr<std::unique_ptr<Communicator>> split_group(const std::vector<int32_t>& ranks,
                                                              std::string name,
                                                              std::vector<int32_t> world_ranks) = 0;
  // A backend's constructor sets it from its CommOptions::world_ranks.
  void set_rank_names(RankNames names) { rank_names_ = std::move(names); }
  // The backend's abort of its own operations (see abort()).
  virtual void abort_operations() = 0;
  // The backend's fail() (see there): records `cause` as its failure unless it has one and
  // ends its connections. Runs no failure listener (fail() tells them after it returns).
  virtual void fail_operations(const Status& cause) = 0;
  // A backend calls it when it records its first failure (an operation's), with no lock
  // held: the links of this communicator (link_failures) fail their other groups. Only the
  // first call, or abort(), or fail(), of a communicator tells them; later ones do nothing.
  void notify_failure(const Status& failure);
  // The first thing a backend's destructor does: no abort reaches this object after it
  // returns (one running now finishes first).
  void untie();
  // For CPU backends: `own` (the communicator's stream) waits for the work enqueued on
  // `ready` so far (nothing when it is null), without blocking the host. abort() ends that
  // wait, so the operations queued behind it end ABORTED at once rather than when `ready`
  // gets there (it may be blocked behind another group's operation), and whatever else is
  // queued on `own` after it runs without waiting for `ready` either. Call it after the
  // backend's own abort check (an operation behind it must find the backend aborted).
  // INVALID_ARGUMENT naming `operation` when `ready` is not on the CPU.
  Status wait_for_ready(cpu::CpuStream& own, Stream* ready, std::string_view operation);

 private:
  // abort() of this communicator and of those tied to it, each added to `aborts` with its
  // failure for the links, which abort() tells after.
  void abort_tree(std::vector<std::pair<std::shared_ptr<AbortNode>, Status>>& aborts);
  std::shared_ptr<AbortNode> abort_node_;
  std::string topology_axis_;
  RankNames rank_names_;
};

// INVALID_ARGUMENT ("<who>: the <axis> communicator is the hybrid topology's '<other>'
// group, ...") when `comm` is a hybrid group's communicator of another axis than `axis`.
Status check_topology_axis(const Communicator& comm, std::string_view axis, std::string_view who);

// Creates this rank's member of a group of `size` ranks meeting through `store`.
// Collective: every rank calls it. CPU → Gloo (in a build without Gloo, a group of one
// rank gets self/'s communicator and larger ones UNAVAILABLE); CUDA → NCCL. Blocks until
// all ranks have connected or options.timeout has passed. A size above kMaxGroupSize is
// OUT_OF_RANGE; options out of range are INVALID_ARGUMENT, before anything is allocated.
StatusOr<std::unique_ptr<Communicator>> create_communicator(std::shared_ptr<Store> store,
                                                            int32_t rank, int32_t size,
                                                            Device device,
                                                            const CommOptions& options = {});

// Argument checks shared by the backends; each returns INVALID_ARGUMENT or OUT_OF_RANGE
// naming the operation and the group.
struct CommArgs {
  const char* operation;
  const std::string& group;
  int32_t size;
};
Status check_buffer(const CommArgs& a, const char* which, const void* pointer, size_t count,
                    DType dtype, size_t multiple = 1);
Status check_rank_in_group(const CommArgs& a, const char* which, int32_t rank);
// The buffers of all_reduce (`receives`: true) and reduce (`receives`: this rank is the
// root), all_gather (send is count elements, recv size x count) and reduce_scatter (send
// size x count, recv count) on rank `rank`: each checked as check_buffer does, and send
// and recv either disjoint or in the collective's in-place form (all_reduce, reduce: the
// same buffer; all_gather: send is the rank's slot of recv; reduce_scatter: recv is the
// rank's slice of send). Any other overlap is INVALID_ARGUMENT: the transports copy and
// add between them as if they were apart.
Status check_reduce_buffers(const CommArgs& a, const void* send, const void* recv, size_t count,
                            DType dtype, bool receives);
Status check_all_gather_buffers(const CommArgs& a, int32_t rank, const void* send, const void* recv,
                                size_t count, DType dtype);
Status check_reduce_scatter_buffers(const CommArgs& a, int32_t rank, const void* send,
                                    const void* recv, size_t count, DType dtype);

}  // namespace hps
