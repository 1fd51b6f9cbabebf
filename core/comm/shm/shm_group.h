// Shared-memory collectives for a group whose ranks all run on one host, as processes
// or as threads. One POSIX shared-memory segment per group holds, for every rank, a
// control block (round counters, a descriptor) and two staging slots. A collective
// moves its data through the slots in rounds: a rank writes its piece into its slot for
// round k and publishes it, every rank reads what it needs from the others' slots and
// says it has finished; slot k % 2 is written again in round k + 2, once every rank has
// finished round k. Each byte is copied twice (into the segment, out of it), with no
// kernel transport in between, where a TCP loopback transfer costs two copies plus the
// socket stack.
//
// Every collective checks the ranks' descriptors in its first round, for free. Waits
// spin briefly, then sleep on a futex in the segment; they end at the deadline, on
// abort(), or as soon as the rank waited for has failed, aborted, left, or its process
// died. Each round's outcome is one word in the segment, set by the first rank to see every
// post (complete) or to stop waiting (given up): a rank that joins a round its peers gave up
// on fails too, and one that timed out as the last post arrived completes with its peers.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "core/comm/communicator.h"
#include "core/comm/descriptor.h"
#include "core/comm/rank_names.h"
#include "core/comm/store.h"

namespace hps::shm {

using Deadline = std::chrono::steady_clock::time_point;

inline constexpr size_t kDefaultSlotBytes = size_t{2} << 20;
// A slot larger than this is refused (INVALID_ARGUMENT): it gains nothing and its segment
// (ranks x 2 slots) would not fit in /dev/shm.
inline constexpr size_t kMaxSlotBytes = size_t{1} << 30;

// Segments are named "/hpshard-JOB-PIDNS-PID-N-NONCE": JOB is the job id (HPS_JOB_ID, with
// every byte outside [A-Za-z0-9_.] made '_', at most 64 of them; "0" without one), PIDNS and
// PID the creating process's pid namespace and pid. A segment's name exists only while its
// group is being set up; one a killed process left is removed by the next group created on
// the host (its creator is gone) and by hpshard-run when the job it named ends.
std::string segment_job_tag(const std::string& job_id);
// Removes (shm_unlink) the segments of job `job_id` this user owns; returns how many.
int remove_job_segments(const std::string& job_id);
// Removes the segments this user owns whose creating process has ended (same pid
// namespace only); returns how many.
int remove_stale_segments();

class ShmGroup {
 public:
  // Collective over `store`: every rank of the group calls it. Returns the group when
  // every rank asked for it (`enabled`), runs on this host and mapped the segment;
  // otherwise nullptr, on every rank alike (the caller keeps its other transport).
  // `direct`: all-gather and broadcast read the peers' buffers in place (one copy instead
  // of two) when every rank can read every other's memory (threads of one process, or
  // processes that cross-memory attach allows); the ranks agree here.
  static StatusOr<std::unique_ptr<ShmGroup>> create(Store& store, int32_t rank, int32_t size,
                                                    bool enabled, size_t slot_bytes,
                                                    Milliseconds timeout, bool direct = false,
                                                    RankNames names = {});
  ~ShmGroup();  // tells the peers this rank has left
  ShmGroup(const ShmGroup&) = delete;
  ShmGroup& operator=(const ShmGroup&) = delete;

  int32_t rank() const { return rank_; }
  int32_t size() const { return size_; }
  size_t slot_bytes() const { return slot_bytes_; }
  bool direct() const { return direct_; }
  // ABORTED naming the first of `peers` that destroyed its communicator or whose process
  // (of this pid namespace) has ended; OK otherwise. Any thread, beside running collectives.
  Status check_peers_alive(const std::vector<int32_t>& peers) const;

  // Run on one thread (the communicator's stream worker), in the same order on every
  // rank, each until done or the deadline. Messages name no operation: the caller
  // prefixes where it was. Same buffer rules as Communicator.
  Status all_reduce(const CollectiveDescriptor& d, Deadline deadline, const void* send, void* recv,
                    size_t count, DType dtype, ReduceOp op);
  Status reduce_scatter(const CollectiveDescriptor& d, Deadline deadline, const void* send,
                        void* recv, size_t count, DType dtype, ReduceOp op);
  Status all_gather(const CollectiveDescriptor& d, Deadline deadline, const void* send, void* recv,
                    size_t bytes_per_rank);
  Status broadcast(const CollectiveDescriptor& d, Deadline deadline, void* buffer, size_t bytes,
                   int32_t root);
  Status barrier(const CollectiveDescriptor& d, Deadline deadline);

  // From any thread: the running and later collectives end with ABORTED, here and on
  // the peers waiting for this rank.
  void abort();
  // This rank's communicator failed (`why`, the first time): peers waiting for it stop at
  // once, their errors quoting `why`.
  void mark_failed(std::string_view why);
  // Any thread: ABORTED saying how `peer` ended the group (it failed, quoting its message;
  // aborted; left), after a rank of the group that exited when one did; OK while it has not.
  Status peer_gone(int32_t peer) const;

  // Tests only: runs inside every wait of this rank's collectives, between its read of
  // whether the peer waited for is gone and its read of that peer's progress (the window in
  // which a peer can finish and leave). Set before the collectives run.
  void set_between_reads_for_testing(std::function<void()> hook) {
    between_reads_for_testing_ = std::move(hook);
  }

  struct Control;
  struct Header;

 private:
  ShmGroup(int32_t rank, int32_t size, size_t slot_bytes, void* base, RankNames names);

  Control& control(int32_t q) const;
  Header& header() const;
  uint8_t* slot(int32_t q, uint64_t round) const;

  // Round protocol.
  Status acquire(uint64_t round, Deadline deadline);  // my slot for `round` may be written
  void post(uint64_t round, const CollectiveDescriptor* d);
  // Every rank (or only `only`, when >= 0) has published `round`, and the round is settled:
  // it ends alike on every rank.
  Status wait_posted(uint64_t round, Deadline deadline, int32_t only = -1);
  // Decides, once for every rank, whether `round` completes: `waited` is what this rank's wait
  // for its posts returned. The first rank to decide wins; a rank that saw every post after a
  // peer gave up gets ABORTED, and one whose wait timed out after a peer saw them all gets OK.
  Status settle(uint64_t round, Status waited);
  // ABORTED naming the rank that gave up the round whose outcome word is `word`.
  Status given_up(uint64_t word) const;
  Status check(uint64_t round, const CollectiveDescriptor& mine);
  void finish(uint64_t round);
  // Waits until `peer`'s posted (or consumed) counter reaches `target`; ABORTED once it is
  // gone, or with `watch_others` once another rank short of `target` is.
  Status wait_for(bool posted, uint64_t target, int32_t peer, Deadline deadline, bool watch_others);
  // The first rank but this one and `peer` that is gone short of `target`; OK if none.
  Status others_gone(bool posted, uint64_t target, int32_t peer) const;
  // wait_for on every other rank (or only `only`, when >= 0).
  Status wait_peers(bool posted, uint64_t target, Deadline deadline, int32_t only = -1);
  // The message `peer` failed with (mark_failed), or "" when it wrote none.
  std::string reason_of(int32_t peer) const;
  // `failure` (a peer that failed, aborted or withdrew its buffer: often a survivor of
  // another rank's death), or, when a rank of the group has exited or left, that rank's
  // end first with `failure` after it: the cause, not a fellow survivor, is named.
  Status with_cause(Status failure) const;
  // Copies `bytes` at `remote` in rank q's address space to `local`.
  Status read_peer(int32_t q, void* local, const void* remote, size_t bytes) const;
  // Every other rank has finished `round` (it read what this rank posted).
  Status wait_all_consumed(uint64_t round, Deadline deadline);
  // Direct mode. Reads rank q's buffer for `round` (its posted address); ABORTED when q
  // withdrew it before or during the copy (then what was copied may not be q's data).
  Status read_posted(int32_t q, uint64_t round, void* local, size_t bytes);
  // The poster's end of a direct round: waits until every peer has read this rank's buffer
  // for `round`; when that fails (abort, deadline, a peer gone), withdraws the buffer and
  // waits for the peers already reading it, so that the caller may free it on return.
  Status wait_read_by_all(uint64_t round, Deadline deadline);
  // Withdraws this rank's buffer for `round` and waits for the peers already reading it.
  void withdraw(uint64_t round, Deadline deadline);
  void notify();

  int32_t rank_;
  RankNames names_;  // how messages name the peers
  int32_t size_;
  size_t slot_bytes_;
  void* base_;
  uint64_t next_round_ = 0;  // worker thread only
  bool direct_ = false;
  std::atomic<bool> aborted_{false};
  std::function<void()> between_reads_for_testing_;
};

}  // namespace hps::shm
