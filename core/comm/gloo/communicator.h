// The CPU communicator: ring collectives over Gloo's TCP transport (unbound buffers),
// run by the communicator's own CPU stream worker so they overlap the caller's compute.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "core/comm/communicator.h"
#include "core/comm/descriptor.h"
#include "core/comm/host.h"
#include "core/comm/shm/shm_group.h"
#include "core/device/cpu/stream.h"

namespace gloo {
class Context;
namespace transport {
class UnboundBuffer;
}  // namespace transport
}  // namespace gloo

namespace hps::gloo_backend {

// The address this process's Gloo TCP device and the control mesh bind to
// (HPS_COMM_HOST, default 127.0.0.1).
std::string device_host();

class ControlMesh;
class WaitWatch;

class GlooCommunicator final : public Communicator {
 public:
  static StatusOr<std::unique_ptr<Communicator>> create(std::shared_ptr<Store> store, int32_t rank,
                                                        int32_t size, const CommOptions& options);
  ~GlooCommunicator() override;

  int32_t rank() const override { return rank_; }
  int32_t size() const override { return size_; }
  Device device() const override { return Device::cpu(); }
  const std::string& name() const override { return options_.name; }
  std::string_view transport() const override { return shm_ ? "shm" : "tcp"; }
  // Over shared memory, whether all-gather and broadcast read the peers' buffers in place.
  bool shared_memory_direct() const { return shm_ && shm_->direct(); }
  Stream& stream() override { return *stream_; }
  Milliseconds timeout() const override { return Milliseconds(timeout_ms_.load()); }
  void set_timeout(Milliseconds timeout) override {
    timeout_ms_ = std::clamp(timeout, Milliseconds(1), kMaxCommTimeout).count();
  }

  StatusOr<std::shared_ptr<Work>> all_reduce(const void* send, void* recv, size_t count,
                                             DType dtype, ReduceOp op, Stream* ready,
                                             uint64_t tag) override;
  StatusOr<std::shared_ptr<Work>> reduce(const void* send, void* recv, size_t count, DType dtype,
                                         ReduceOp op, int32_t root, Stream* ready) override;
  StatusOr<std::shared_ptr<Work>> broadcast(void* buffer, size_t count, DType dtype, int32_t root,
                                            Stream* ready) override;
  StatusOr<std::shared_ptr<Work>> all_gather(const void* send, void* recv, size_t count,
                                             DType dtype, Stream* ready, uint64_t tag) override;
  StatusOr<std::shared_ptr<Work>> reduce_scatter(const void* send, void* recv, size_t count,
                                                 DType dtype, ReduceOp op, Stream* ready,
                                                 uint64_t tag) override;
  StatusOr<std::shared_ptr<Work>> send(const void* buffer, size_t count, DType dtype, int32_t peer,
                                       Stream* ready) override;
  StatusOr<std::shared_ptr<Work>> recv(void* buffer, size_t count, DType dtype, int32_t peer,
                                       Stream* ready) override;
  StatusOr<std::shared_ptr<Work>> barrier(Stream* ready) override;
  // Also waits for the point-to-point transfers the waiter thread completes.
  Status finish() override;

  // One running operation's view of the transport (defined in communicator.cc).
  class Op;

 protected:
  StatusOr<std::unique_ptr<Communicator>> split_group(const std::vector<int32_t>& ranks,
                                                      std::string name,
                                                      std::vector<int32_t> world_ranks) override;
  void abort_operations() override;
  void fail_operations(const Status& cause) override;

 private:
  friend class WaitWatch;
  GlooCommunicator(std::shared_ptr<Store> store, int32_t rank, int32_t size, CommOptions options);

  // The transfers a wait under way (Op::wait_one) is owed. Gloo tells a failed connection
  // to the transfers still queued on it, but not to one under way (a send partly written, a
  // receive partly read): such a wait would last the whole timeout. WaitWatch fails it once
  // the connection to a peer it is owed by has failed, or once that peer's process (on this
  // host) has ended, whose connection a child it forked may hold open.
  struct OwedTransfers {
    ::gloo::transport::UnboundBuffer* buffer;
    std::vector<int32_t> peers;
  };
  uint64_t begin_wait(OwedTransfers owed);
  void end_wait(uint64_t id);
  // The watch's round: aborts the waits owed by a peer whose connection has been seen failed
  // for a round, or that has been seen to end the group or whose process has been seen
  // ended for the grace period.
  void check_waits();
  // Why `peer` has ended the group, as its shared-memory control block or its control
  // connection says (it aborted, failed or left); nullopt while neither does.
  std::optional<std::string> peer_ended_group(int32_t peer);
  // Gloo's message once the connection to `peer` has failed; nullopt while it works (or
  // while its lock is busy: the next round asks again).
  std::optional<std::string> connection_failure(int32_t peer);
  // Why the watch failed a wait owed by `peers`: the rank whose connection failed (else -1)
  // and what failed; an empty message when it failed none of them.
  std::pair<int32_t, std::string> watched_failure(const std::vector<int32_t>& peers);
  std::mutex waits_mutex_;
  uint64_t next_wait_ = 0;
  std::map<uint64_t, OwedTransfers> waits_;
  std::map<int32_t, std::chrono::steady_clock::time_point> seen_ended_;
  std::map<int32_t, std::chrono::steady_clock::time_point> seen_broken_;
  std::map<int32_t, std::chrono::steady_clock::time_point> seen_leaving_;
  std::vector<std::optional<host::Process>> gone_;  // by rank: peers whose waits fail
  std::vector<std::string> broken_;  // by rank: Gloo's message once its waits were failed
  std::string ended_while_waiting_;  // "rank P (process N on this host) has ended", or ""

  using Descriptor = CollectiveDescriptor;

  using Body = std::function<Status(Op&)>;
  // Validates nothing; queues `body` on the stream with a fresh Work. `descriptor` is
  // checked across ranks first when it is given and checking is on.
  StatusOr<std::shared_ptr<Work>> enqueue(std::string operation, Stream* ready,
                                          const Descriptor* descriptor, uint64_t slot_base,
                                          Body body);
  Status run(Op& op, const Descriptor* descriptor, const Body& body);
  // Runs fn, turning Gloo's exceptions and an abort into TIMEOUT / ABORTED statuses
  // that name the operation, its sequence number and the group.
  Status guarded(Op& op, const std::function<Status()>& fn);
  // Keeps the first failure (every later operation is refused with it) and ends the
  // connections; true when `s` was the first. The caller tells the links (notify_failure).
  bool record_failure(const Status& s);
  // Ends the data and control connections, so that the peers' operations with this rank fail;
  // the control connections' farewell says this rank failed with `failure`, or aborted the
  // group when there is none.
  void end_connections(std::optional<std::string_view> failure);
  // What a failed transfer with `peer` (-1: not known) says: the peer's farewell when it
  // sent one (it failed or aborted the group), else that its connection failed (`what`).
  std::string peer_ended(int32_t peer, const std::string& what);
  // `failure` preceded by the peers of this host whose processes have ended, if any.
  std::string with_ended_peers(const std::string& failure) const;
  // Records a finished operation's status on its work (and the communicator's failure).
  void end_work(Work& work, Status s) noexcept;
  // Inside a catch block: what was caught, in words.
  static std::string describe_exception() noexcept;
  // The next collective's descriptor (its sequence number taken). Operations without a
  // dtype or reduction describe them as 0.
  Descriptor next_descriptor(CollectiveKind kind, DType dtype, ReduceOp op, int32_t root,
                             size_t count, uint64_t tag);
  // send() and recv(): the checks, the message number per peer, the transfer.
  StatusOr<std::shared_ptr<Work>> point_to_point(bool sending, const void* buffer, size_t count,
                                                 DType dtype, int32_t peer, Stream* ready);
  // `bytes` and `number` (the message's, per peer and direction) name it in the timeline.
  StatusOr<std::shared_ptr<Work>> enqueue_point_to_point(std::string operation, Stream* ready,
                                                         uint64_t slot_base, uint64_t bytes,
                                                         uint64_t number,
                                                         std::function<void(Op&)> post);
  void complete_transfers();  // the waiter thread
  // True when `descriptor` is checked across ranks over control_ (TCP, checking on).
  bool checks_over_control_mesh(const Descriptor* descriptor) const;
  Status check_descriptors(Op& op, const Descriptor& mine);

  // The TCP paths of all_reduce (and reduce) and reduce_scatter: the algorithm for the
  // group, and float16 / bfloat16 SUM and AVG widened to fp32 (widens()): the 16-bit
  // algorithms would round every partial sum to the dtype (so a float16 sum past 65504
  // would become Inf where the mean fits, and any sum could be an ulp or more off); summed
  // in fp32, the result is rounded once, as over shared memory.
  bool widens(DType dtype, ReduceOp reduce_op) const;
  Status tcp_all_reduce(Op& op, const void* send, void* recv, size_t count, DType dtype,
                        ReduceOp reduce_op);
  Status tcp_reduce_scatter(Op& op, const void* send, void* recv, size_t count, DType dtype,
                            ReduceOp reduce_op);
  // Ring algorithms; they run on the stream worker.
  // Out of place without a first copy: the first step sends from `send`, every step
  // reduces `send`'s own chunk with what arrives into `recv`. send == recv is allowed.
  Status ring_all_reduce(Op& op, const void* send, void* recv, size_t count, DType dtype,
                         ReduceOp reduce_op);
  Status ring_reduce_scatter(Op& op, const void* send, void* recv, size_t count, DType dtype,
                             ReduceOp reduce_op);
  Status ring_all_gather(Op& op, void* recv, size_t bytes_per_rank, uint32_t phase);
  // Passes blocks around the ring in `buffer` (an Op buffer index) until every rank has
  // all of them; this rank starts with block `first`; block(i) = {byte offset, bytes}.
  void ring_pass_blocks(Op& op, size_t buffer, int32_t first,
                        const std::function<std::pair<size_t, size_t>(int32_t)>& block,
                        uint32_t phase);
  Status halving_reduce_scatter(Op& op, const void* send, void* recv, size_t count, DType dtype,
                                ReduceOp reduce_op);  // power-of-two groups
  Status tree_broadcast(Op& op, void* buffer, size_t bytes, int32_t root);

  void* scratch(size_t index, size_t bytes);  // worker-owned, grows as needed
  void register_buffer(::gloo::transport::UnboundBuffer* buffer);
  void unregister_buffer(::gloo::transport::UnboundBuffer* buffer);
  std::string where(const std::string& operation, uint64_t sequence) const;
  Status located(const Op& op, Status s) const;  // prefixes where `op` failed

  std::shared_ptr<Store> store_;
  // Each rank's process as it published it when the communicator was made (nullopt where
  // unread or malformed): names a peer that ended when connections fail.
  std::vector<std::optional<host::Process>> peer_processes_;
  // Each peer's address as Gloo's errors name it ("[ip]:port"; empty for this rank).
  std::vector<std::string> peer_addresses_;
  int32_t rank_;
  int32_t size_;
  CommOptions options_;
  std::atomic<int64_t> timeout_ms_;
  std::shared_ptr<::gloo::Context> context_;
  // By rank: a receive on a slot no operation uses, posted on the connection to that peer
  // (none for this rank): Gloo tells it when the connection fails (connection_failure).
  std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> watch_buffers_;
  // Set when every rank runs on this host: collectives go through shared memory.
  std::unique_ptr<shm::ShmGroup> shm_;
  // Otherwise, with checking on, the argument check's own connections.
  std::unique_ptr<ControlMesh> control_;
  std::unique_ptr<cpu::CpuStream> stream_;

  uint64_t next_sequence_ = 1;        // collectives, host thread
  uint64_t next_split_ = 0;           // host thread
  std::map<int32_t, uint64_t> sent_;  // p2p messages per peer, host thread
  std::map<int32_t, uint64_t> received_;

  std::atomic<bool> aborted_{false};
  std::mutex failure_mutex_;
  Status failure_;  // sticky: once an operation failed, later ones are refused

  std::mutex buffers_mutex_;
  std::set<::gloo::transport::UnboundBuffer*> active_buffers_;
  bool ended_ = false;  // end_connections() ran: waits on later buffers return at once too
  // The buffers of operations whose transfers failed, kept until the transport goes.
  std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> parked_;
  void park_buffers(std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> buffers);
  std::vector<std::vector<uint8_t>> scratch_;

  // Posted point-to-point transfers, completed off the stream by `waiter_`.
  struct PendingTransfer {
    std::shared_ptr<Op> op;
    std::shared_ptr<Work> work;
    std::shared_ptr<cpu::EventMark> mark;
    Status posted;
  };
  std::mutex waiter_mutex_;
  std::condition_variable waiter_cv_;
  std::deque<PendingTransfer> waiting_;
  uint64_t transfers_posted_ = 0;     // handed to the waiter so far
  uint64_t transfers_completed_ = 0;  // of those, completed (in order)
  std::condition_variable transfer_done_cv_;
  bool stopping_ = false;
  std::thread waiter_;  // last: started after everything it uses
};

}  // namespace hps::gloo_backend
