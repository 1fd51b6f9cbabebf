// A full mesh of small TCP connections beside Gloo's, for the messages that gate a
// collective: the argument agreement. A rank posts its descriptor when the collective is
// enqueued and collects its peers' when the collective runs, so the exchange is mostly
// over before the stream gets to it. Gloo's unbound buffers move a message only after the
// receiver has announced it (a round trip) and through the device's event-loop thread;
// here a message is written straight to the socket and read by the waiting thread itself,
// one wake-up instead of three. Each message travels in a frame (an 8-byte header: its kind
// and length); a rank that ends the group (aborts it, or fails) sends each peer a farewell
// frame saying why before it shuts its connections, so a survivor can quote it.
#pragma once

#include <poll.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/comm/host.h"
#include "core/comm/rank_names.h"
#include "core/comm/store.h"
#include "core/common/status.h"

namespace hps::gloo_backend {

class ControlMesh {
 public:
  using Clock = std::chrono::steady_clock;

  // Collective over `store`: every rank listens on `host`, publishes its address, connects
  // to every lower rank and accepts every higher one, by `deadline`. While it waits to accept,
  // `still_ok` (when given) is asked every 100 ms; its failure (a peer that ended) ends the
  // creation with it. `names`: how its messages name the peers.
  static StatusOr<std::unique_ptr<ControlMesh>> create(
      Store& store, int32_t rank, int32_t size, const std::string& host, Clock::time_point deadline,
      const std::function<Status()>& still_ok = nullptr, RankNames names = {});
  ~ControlMesh();
  ControlMesh(const ControlMesh&) = delete;
  ControlMesh& operator=(const ControlMesh&) = delete;

  // Sends `bytes` at `mine` to every peer (the messages queue in the sockets; a peer reads
  // them in order). ABORTED when a peer's connection failed or abort() ran. One thread at
  // a time calls post(), one (possibly another) collect().
  Status post(const void* mine, size_t bytes, Clock::time_point deadline);
  // Receives each peer's next `bytes` into all + peer * bytes (all + rank * bytes is left
  // alone). TIMEOUT past `deadline` naming the ranks still missing, ABORTED when a peer's
  // connection closed or abort() ran, or with the peer's farewell when it ended the group
  // ("rank 1 failed an earlier operation (its error: ...)", "rank 1 aborted the
  // communicator").
  Status collect(void* all, size_t bytes, Clock::time_point deadline);
  // After this rank's transfers with `peer` failed (any thread): the farewell `peer` sent as
  // it ended the group (what collect() would say), read past the messages it had posted for
  // collectives not collected here, waiting until `deadline` for it; nothing when its
  // connection ended without one, or the deadline passed (a collect() reading meanwhile is
  // waited for: it may read the farewell first).
  std::optional<std::string> farewell(int32_t peer, Clock::time_point deadline);

  // Before the first collect(): the peers' processes, by rank (nullopt where unknown). A
  // collect() waiting for a peer of this host whose process has ended fails ABORTED, naming
  // it, a second after its end (what it wrote before is read meanwhile): a process it forked
  // may hold its connection open, so no end of file would come before the deadline.
  void watch_processes(const std::vector<std::optional<host::Process>>& processes);

  // Any thread: a running collect() returns ABORTED at once, and so do later calls; the
  // peers get a farewell saying this rank aborted the group (unless a post() is writing),
  // and the connections are shut down, so the peers' collect() ends ABORTED too.
  void abort();
  // abort(), the farewell saying this rank failed, with `reason` (cut to kPeerReasonBytes).
  void fail(std::string_view reason);

  // Any thread, beside post()/collect(): ABORTED naming the first of `peers` whose
  // connection has closed with nothing left unread in it (a peer that died with a message
  // unread is seen by the next collect()); OK otherwise.
  Status check_peers_alive(const std::vector<int32_t>& peers) const;
  // Any thread: ABORTED when `peer` has ended its control connection (shut it down as it
  // ended the group, or closed it), whatever it sent before is still unread (collectives it
  // posted that this rank has not called); OK otherwise, and once this rank's own ended.
  Status check_peer_ended(int32_t peer) const;

 private:
  ControlMesh(int32_t rank, int32_t size, RankNames names);
  // abort() and fail(): a farewell of `kind` to every peer, then the connections shut down.
  void end(uint32_t kind, std::string_view reason);
  // collect()'s look at a peer whose frame came: ABORTED when its connection ended or a
  // farewell follows (read), else OK, setting `ahead` once its next frame has begun.
  Status check_next_frame(int32_t peer, Clock::time_point deadline, uint8_t* ahead);
  // The farewell whose header collect() or farewell() read from `peer`: its reason read
  // (by `deadline`, at most a second from now), then said as the survivors say it.
  std::string read_farewell(int32_t peer, uint32_t kind, uint32_t bytes,
                            Clock::time_point deadline);
  int32_t rank_;
  int32_t size_;
  RankNames names_;           // how messages name the peers
  std::vector<int> sockets_;  // by peer rank; -1 for this rank
  int wake_fd_ = -1;          // an eventfd abort() writes to
  std::mutex send_mutex_;     // post()'s writes, and the farewell's
  std::mutex read_mutex_;     // collect()'s reads, and farewell()'s
  // What each peer said as it ended the group, once read (under read_mutex_).
  std::vector<std::optional<std::string>> farewells_;
  std::vector<char> frame_;  // post()'s frame, kept to spare an allocation per call
  // collect()'s frame headers by peer, and the peers it left within a frame (ABORTED or
  // TIMEOUT before all of it came): farewell() cannot read those.
  std::vector<std::array<char, 8>> heads_;
  std::vector<uint8_t> torn_;
  std::vector<uint8_t> ahead_;  // collect(): peers no longer watched (see check_next_frame)
  // collect()'s bytes received per peer and poll set, kept to spare allocations per call.
  std::vector<size_t> got_;
  std::vector<struct pollfd> poll_fds_;
  std::vector<int32_t> poll_peers_;
  std::vector<std::optional<host::Process>> watched_;  // by rank: peers of this host
  std::atomic<bool> aborted_{false};
};

}  // namespace hps::gloo_backend
