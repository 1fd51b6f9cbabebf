#include "core/comm/gloo/communicator.h"

#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/address.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <netdb.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstring>
#include <functional>
#include <new>
#include <optional>

#include "core/comm/gloo/control_mesh.h"
#include "core/comm/reduce_ops.h"
#include "core/common/env.h"
#include "core/common/logging.h"
#include "core/trace/trace.h"

namespace hps::gloo_backend {

namespace {

using Clock = std::chrono::steady_clock;

// Gloo's rendezvous store interface over ours (exceptions are how Gloo expects errors).
class GlooStoreAdapter final : public ::gloo::rendezvous::Store {
 public:
  GlooStoreAdapter(std::shared_ptr<hps::Store> store, Milliseconds timeout, int32_t rank,
                   int32_t size)
      : store_(std::move(store)),
        timeout_(timeout),
        rank_(rank),
        size_(size),
        peer_addresses_(static_cast<size_t>(size)) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    throw_if_error(store_->set(key, std::string_view(data.data(), data.size())));
    if (key == std::to_string(rank_)) remember_own_addresses(data);
  }
  std::vector<char> get(const std::string& key) override {
    auto value = store_->get(key, timeout_);
    throw_if_error(value.status());
    std::vector<char> bytes(value->begin(), value->end());
    remember_address(key, bytes);
    return bytes;
  }

  // Each peer's address as Gloo names it in its errors ("[ip]:port"): that of the peer's
  // pair for this rank, read from the peer's published addresses (key "<peer>": one per
  // other rank, this rank's at its place among them). Empty where not read.
  std::vector<std::string> take_peer_addresses() { return std::move(peer_addresses_); }

  // The address this rank's pair for `peer` listens on (from this rank's published
  // addresses); none before they are published, or where they do not parse. Any thread.
  std::optional<sockaddr_storage> own_address_for(int32_t peer) const {
    std::lock_guard lock(own_mutex_);
    if (peer < 0 || static_cast<size_t>(peer) >= own_addresses_.size()) return std::nullopt;
    return own_addresses_[static_cast<size_t>(peer)];
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  // Always the communicator's timeout: Gloo passes its context's, which create() shortens
  // for the connections (see there), not for the waits for late ranks.
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds&) override {
    throw_if_error(store_->wait(keys, timeout_));
  }

 private:
  static void throw_if_error(const Status& s) {
    if (!s.ok()) throw ::gloo::IoException(s.to_string());
  }
  // Gloo publishes one address per other rank, in rank order, under this rank's number.
  void remember_own_addresses(const std::vector<char>& all) {
    if (size_ < 2 || all.size() % static_cast<size_t>(size_ - 1) != 0) return;
    const size_t width = all.size() / static_cast<size_t>(size_ - 1);
    std::vector<std::optional<sockaddr_storage>> own(static_cast<size_t>(size_));
    for (int32_t peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      const size_t place = static_cast<size_t>(peer > rank_ ? peer - 1 : peer);
      try {
        const ::gloo::transport::tcp::Address address(
            std::vector<char>(all.begin() + static_cast<std::ptrdiff_t>(place * width),
                              all.begin() + static_cast<std::ptrdiff_t>((place + 1) * width)));
        own[static_cast<size_t>(peer)] = address.getSockaddr();
      } catch (const std::exception&) {
      }
    }
    std::lock_guard lock(own_mutex_);
    own_addresses_ = std::move(own);
  }
  void remember_address(const std::string& key, const std::vector<char>& all) {
    if (key.empty() || key.find_first_not_of("0123456789") != std::string::npos || key.size() > 9 ||
        size_ < 2) {
      return;
    }
    const int32_t peer = std::stoi(key);
    if (peer < 0 || peer >= size_ || peer == rank_ ||
        all.size() % static_cast<size_t>(size_ - 1) != 0) {
      return;
    }
    const size_t width = all.size() / static_cast<size_t>(size_ - 1);
    const size_t place = static_cast<size_t>(rank_ > peer ? rank_ - 1 : rank_);
    try {
      const ::gloo::transport::tcp::Address address(
          std::vector<char>(all.begin() + static_cast<std::ptrdiff_t>(place * width),
                            all.begin() + static_cast<std::ptrdiff_t>((place + 1) * width)));
      std::string text = address.str();
      // "[ip]:port", without the sequence number Gloo may append.
      const size_t close = text.find("]:");
      if (close == std::string::npos) return;
      size_t end = close + 2;
      while (end < text.size() && text[end] >= '0' && text[end] <= '9') ++end;
      text.resize(end);
      peer_addresses_[static_cast<size_t>(peer)] = std::move(text);
    } catch (const std::exception&) {
    }
  }
  std::shared_ptr<hps::Store> store_;
  Milliseconds timeout_;
  int32_t rank_;
  int32_t size_;
  std::vector<std::string> peer_addresses_;
  mutable std::mutex own_mutex_;
  std::vector<std::optional<sockaddr_storage>> own_addresses_;
};

// The rank whose address (see GlooStoreAdapter) a Gloo error names; -1 when none does.
int32_t rank_named_in(const std::string& what, const std::vector<std::string>& peer_addresses) {
  for (size_t r = 0; r < peer_addresses.size(); ++r) {
    const std::string& a = peer_addresses[r];
    if (a.empty()) continue;
    // Followed by neither a digit (another port) nor anything that continues the number.
    for (size_t at = what.find(a); at != std::string::npos; at = what.find(a, at + 1)) {
      const size_t end = at + a.size();
      if (end == what.size() || what[end] < '0' || what[end] > '9') return static_cast<int32_t>(r);
    }
  }
  return -1;
}

// What a broken connection says: the rank when known (>= 0), else "a peer".
std::string connection_failed(int32_t peer, const std::string& what, const RankNames& names) {
  if (peer < 0) {
    return "the connection to a peer failed (did a rank exit, abort or fail an operation?): " +
           what;
  }
  return "the connection to " + names(peer) +
         " failed (did it exit, abort or fail an operation?): " + what;
}

std::string process_key(int32_t rank) { return "process/" + std::to_string(rank); }

// "rank 2 (process 77 on this host) has ended", or "rank 2 (...), rank 5 (...) have ended":
// the peers (ranks but `self`) of this host whose process has ended; empty when none has (or
// none can be checked from here).
std::string ended_peers(const std::vector<std::optional<host::Process>>& processes, int32_t self,
                        const RankNames& names) {
  std::string ended;
  int count = 0;
  for (size_t r = 0; r < processes.size(); ++r) {
    if (static_cast<int32_t>(r) == self || !processes[r] || !processes[r]->ended()) continue;
    ended += (count++ == 0 ? "" : ", ") + names(static_cast<int32_t>(r), processes[r]->describe());
  }
  if (count == 0) return ended;
  return ended + (count == 1 ? " has ended" : " have ended");
}

// A rank marks its side of a communicator (or of a split) made in the creation's store, as
// its last write there; a peer that has made its side may leave at once, and the watches
// of those still making theirs skip it.
std::string made_key(int32_t rank) { return "made/" + std::to_string(rank); }
Status mark_made(Store& store, int32_t rank) { return store.set(made_key(rank), "1"); }
bool is_made(Store& store, int32_t rank) {
  auto set = store.check({made_key(rank)});
  return set.ok() && *set;
}

// Over TCP a rank that checks its collectives' arguments exchanges a descriptor on the control
// connections before each one, so the ranks must agree on it (CommOptions::check_arguments,
// HPS_COMM_CHECK): each publishes its choice before it connects and reads the others' once
// the connections are made. INVALID_ARGUMENT on every rank when they differ (they waited for
// each other until the timeout, or one rank's collectives hung).
std::string check_key(int32_t rank) { return "check/" + std::to_string(rank); }
Status agree_on_checking(Store& store, int32_t rank, int32_t size, bool mine, Milliseconds timeout,
                         const RankNames& names) {
  for (int32_t q = 0; q < size; ++q) {
    if (q == rank) continue;
    const StatusOr<std::string> theirs = store.get(check_key(q), timeout);
    if (!theirs.ok()) return theirs.status();
    if ((*theirs == "1") == mine) continue;
    return invalid_argument(
        "the ranks disagree on checking their collectives' arguments (CommOptions::"
        "check_arguments, hps_comm_options_t.check_arguments, default HPS_COMM_CHECK): " +
        names(rank) + (mine ? " checks" : " does not") + ", " + names(q) +
        (mine ? " does not" : " checks") + "; over TCP every rank must choose alike");
  }
  return Status::Ok();
}

// A creation's failure that is not the transport's: returned as it is, not as a backend error.
struct Refused {
  Status status;
};

// The processes of a communicator's ranks while it is created: each rank publishes its
// own before it connects; a peer of this host whose process ends before the communicator
// is made is named at once, not after the timeout.
class PeerWatch {
 public:
  PeerWatch(std::shared_ptr<Store> store, int32_t rank, int32_t size, RankNames names)
      : store_(std::move(store)),
        rank_(rank),
        names_(std::move(names)),
        processes_(static_cast<size_t>(size)) {}

  Status publish() { return store_->set(process_key(rank_), host::Process::self().encode()); }

  // Reads the records published since the last call; ABORTED naming the peers that ended
  // before making their side of the communicator (one that made it may end at once: it
  // needs nothing more of the creation, and nothing here waits for it).
  // Any thread (the creation's, and ConnectWatch's).
  Status check() {
    std::lock_guard lock(mutex_);
    const std::string ended = ended_peers(still_making(), rank_, names_);
    if (ended.empty()) return Status::Ok();
    return aborted(ended + " before the communicator was made");
  }

  // The ranks check() names. Any thread.
  std::vector<int32_t> ended_ranks() {
    std::lock_guard lock(mutex_);
    const std::vector<std::optional<host::Process>> making = still_making();
    std::vector<int32_t> ended;
    for (size_t r = 0; r < making.size(); ++r) {
      if (static_cast<int32_t>(r) != rank_ && making[r] && making[r]->ended()) {
        ended.push_back(static_cast<int32_t>(r));
      }
    }
    return ended;
  }

  // Marks this rank's side of the communicator made (its last write to the store).
  Status made_here() { return mark_made(*store_, rank_); }

  // "rank 2 never began", "ranks 2, 5 never began": the peers that have published no
  // record (not started, or ended before); empty when every peer has.
  std::string unpublished() {
    std::lock_guard lock(mutex_);
    read_new();
    std::vector<int32_t> missing;
    for (size_t r = 0; r < processes_.size(); ++r) {
      if (static_cast<int32_t>(r) == rank_ || processes_[r]) continue;
      missing.push_back(static_cast<int32_t>(r));
    }
    return missing.empty() ? std::string() : names_.list(missing) + " never began";
  }

  // Every rank's process as read (after the connections every peer had published its own).
  std::vector<std::optional<host::Process>> take() {
    std::lock_guard lock(mutex_);
    read_new();
    return std::move(processes_);
  }

 private:
  // The processes read so far of the peers that have not marked their side made (under the
  // lock).
  std::vector<std::optional<host::Process>> still_making() {
    read_new();
    if (ended_peers(processes_, rank_, names_).empty()) return {};
    std::vector<std::optional<host::Process>> making = processes_;
    for (size_t r = 0; r < making.size(); ++r) {
      if (making[r] && is_made(*store_, static_cast<int32_t>(r))) making[r].reset();
    }
    return making;
  }

  void read_new() {
    for (size_t r = 0; r < processes_.size(); ++r) {
      if (static_cast<int32_t>(r) == rank_ || processes_[r]) continue;
      const std::string key = process_key(static_cast<int32_t>(r));
      auto set = store_->check({key});
      if (!set.ok() || !*set) continue;
      auto text = store_->get(key, Milliseconds(0));
      // A malformed record names nothing: that rank is told apart by the timeout.
      if (text.ok()) processes_[r] = host::Process::parse(*text);
    }
  }

  std::mutex mutex_;
  std::shared_ptr<Store> store_;
  int32_t rank_;
  RankNames names_;
  std::vector<std::optional<host::Process>> processes_;
};

// While Gloo connects the pairs: Gloo's pair that listens for a peer waits for it to connect
// until the timeout, looking at nothing else. A peer of this host seen to have ended before
// making its side gets, every 100 ms, a connection from here to that pair's listening socket
// (which Gloo takes as the peer's, then sees closed), so the connect returns and the creation
// names the peer (ABORTED) instead of timing out.
class ConnectWatch {
 public:
  ConnectWatch(std::shared_ptr<PeerWatch> peers, const GlooStoreAdapter& adapter)
      : peers_(std::move(peers)), adapter_(adapter), thread_([this] { run(); }) {}
  ~ConnectWatch() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }
  ConnectWatch(const ConnectWatch&) = delete;
  ConnectWatch& operator=(const ConnectWatch&) = delete;

 private:
  void run() {
    std::vector<int32_t> woken;
    std::unique_lock lock(mutex_);
    while (!wake_.wait_for(lock, Milliseconds(100), [this] { return stop_; })) {
      lock.unlock();
      for (const int32_t peer : peers_->ended_ranks()) {
        if (std::find(woken.begin(), woken.end(), peer) != woken.end()) continue;
        const std::optional<sockaddr_storage> own = adapter_.own_address_for(peer);
        if (!own) continue;  // not published yet: Gloo waits for nothing of it so far
        woken.push_back(peer);
        connect_and_close(*own);
      }
      lock.lock();
    }
  }

  static void connect_and_close(const sockaddr_storage& address) {
    const int fd = ::socket(address.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return;
    const socklen_t length =
        address.ss_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
    // Refused where the pair does not listen (it connects to the peer, or is connected).
    (void)::connect(fd, reinterpret_cast<const sockaddr*>(&address), length);
    ::close(fd);
  }

  std::shared_ptr<PeerWatch> peers_;
  const GlooStoreAdapter& adapter_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace

std::string device_host() { return env_string("HPS_COMM_HOST").value_or("127.0.0.1"); }

namespace {

// Gloo writes to its sockets without MSG_NOSIGNAL: a peer that died mid-collective would
// end this process with SIGPIPE instead of failing the collective (ABORTED). Ignored,
// unless the program chose a disposition of its own.
void ignore_sigpipe_at_default() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && (current.sa_flags & SA_SIGINFO) == 0 &&
      current.sa_handler == SIG_DFL) {
    std::signal(SIGPIPE, SIG_IGN);
  }
}

// One TCP device per process and address: every communicator shares its event loop.
using DeviceMap = std::map<std::string, std::shared_ptr<::gloo::transport::Device>>;
std::mutex& devices_mutex() {
  static std::mutex mutex;
  return mutex;
}
DeviceMap& devices_by_host() {
  static DeviceMap devices;
  return devices;
}

StatusOr<std::shared_ptr<::gloo::transport::Device>> shared_device() {
  const std::string host = device_host();
  std::lock_guard lock(devices_mutex());
  DeviceMap& devices = devices_by_host();
  auto& slot = devices[host];
  if (!slot) {
    // Resolved here first: Gloo's own lookup of a name that does not resolve reads an
    // address list it never got (a crash, not an error).
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    const int rc = host.empty() ? EAI_NONAME : ::getaddrinfo(host.c_str(), nullptr, &hints, &found);
    if (found != nullptr) ::freeaddrinfo(found);
    if (rc != 0) {
      devices.erase(host);
      return invalid_argument("HPS_COMM_HOST: '" + shown_value(host) +
                              "' does not resolve to an address of this host (" +
                              ::gai_strerror(rc) + "); set it to this host's address");
    }
    try {
      ::gloo::transport::tcp::attr attr;
      attr.hostname = host;
      slot = ::gloo::transport::tcp::CreateDevice(attr);
    } catch (const std::exception& e) {
      return backend_error("cannot open a Gloo TCP device on '" + shown_value(host) +
                           "' (set HPS_COMM_HOST to this host's address): " + e.what());
    }
  }
  return slot;
}

// Slot layout: p2p bit 63 | sequence (23 bits) << 40 | fingerprint (20 bits) << 20 |
// phase << 16 | ring step. The fingerprint hashes what fixes every message's size (the
// collective's descriptor, a transfer's byte count), so ranks that called with different
// counts never pair their messages: Gloo's event loop would throw (and abort the process)
// on a message longer than the receive posted for it, and would take a shorter one as
// complete. They time out instead, naming the ranks. (A mismatch whose fingerprints collide,
// one in 2^20, is not caught this way; the argument check, on by default, catches all.)
constexpr uint64_t kPointToPointBit = uint64_t{1} << 63;
constexpr uint32_t kAllGatherPhase = 3;
// Phase 15, which no operation uses: the slot of the receives WaitWatch posts to learn that a
// connection failed (no peer sends on it).
constexpr uint64_t kWatchSlot = uint64_t{15} << 16;

uint64_t mix(uint64_t h, uint64_t v) {
  // splitmix64's finaliser over the running hash and the next field.
  uint64_t z = h ^ (v + 0x9E3779B97F4A7C15ULL + (h << 6) + (h >> 2));
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

uint64_t slot_base(uint64_t sequence, uint64_t fingerprint) {
  return ((sequence & ((uint64_t{1} << 23) - 1)) << 40) | ((fingerprint & 0xFFFFF) << 20);
}

uint64_t collective_slot_base(const CollectiveDescriptor& d) {
  uint64_t h = 0;
  for (uint64_t field :
       {static_cast<uint64_t>(d.kind), static_cast<uint64_t>(d.dtype), static_cast<uint64_t>(d.op),
        static_cast<uint64_t>(d.root), static_cast<uint64_t>(d.count), d.tag}) {
    h = mix(h, field);
  }
  return slot_base(d.sequence, h);
}

// A ring step's slot (step * kMaxSegments + segment) must fit its 16 bits.
constexpr int32_t kMaxGlooGroupSize = 8192;

uint64_t transfer_slot_base(uint64_t index, size_t bytes) {
  return kPointToPointBit | slot_base(index, mix(0, bytes));
}

// Chunk i of `count` elements cut into n nearly equal parts.
struct Chunks {
  Chunks(size_t count, int32_t n) : base(count / n), extra(count % n) {}
  size_t size(int32_t i) const { return base + (static_cast<size_t>(i) < extra ? 1 : 0); }
  size_t offset(int32_t i) const {
    return static_cast<size_t>(i) * base + std::min(static_cast<size_t>(i), extra);
  }
  size_t largest() const { return base + (extra ? 1 : 0); }
  size_t base;
  size_t extra;
};

int32_t wrap(int64_t i, int32_t n) { return static_cast<int32_t>(((i % n) + n) % n); }

// Ring steps move a chunk in up to 8 segments, so the reduction of one segment overlaps
// the transfer of the next (at least 256 KiB each), or, where nothing is reduced, the
// peer's reading of one overlaps the writing of the next (at least 1 MiB each: every
// segment costs Gloo an announce message handled by its one event-loop thread, and
// smaller ones measured slower at 4 ranks, docs/benchmarks.md).
constexpr size_t kMaxSegments = 8;
constexpr size_t kMinSegmentBytes = 256 * 1024;
constexpr size_t kMinCopySegmentBytes = 1024 * 1024;
size_t segments_for(size_t bytes, size_t min_segment = kMinSegmentBytes) {
  return std::max<size_t>(1, std::min(kMaxSegments, bytes / min_segment));
}
// Element range [begin, end) of segment k of `count` elements cut into `parts`.
std::pair<size_t, size_t> segment(size_t count, size_t parts, size_t k) {
  const size_t base = count / parts, extra = count % parts;
  const size_t begin = k * base + std::min(k, extra);
  return {begin, begin + base + (k < extra ? 1 : 0)};
}

}  // namespace

// The transport as one running operation sees it: unbound buffers registered for
// abort(), a deadline, and the operation's slot space.
class GlooCommunicator::Op {
 public:
  Op(GlooCommunicator& comm, std::string operation_name, uint64_t sequence_number,
     uint64_t slot_base, Clock::time_point deadline)
      : comm_(comm),
        operation(std::move(operation_name)),
        sequence(sequence_number),
        slot_base_(slot_base),
        deadline_(deadline) {}

  ~Op() {
    for (auto& b : buffers_) comm_.unregister_buffer(b.get());
    // Gloo's event loop may still be signalling a failed connection's other buffers (under
    // their own locks): those live on until the communicator's transport is gone.
    if (broken_) comm_.park_buffers(std::move(buffers_));
  }

  // Registers `bytes` at `pointer` with the transport; returns its index.
  size_t buffer(const void* pointer, size_t bytes) {
    // Gloo wants a non-null pointer and never writes through a buffer used only to send.
    static uint8_t empty = 0;
    void* p = bytes ? const_cast<void*>(pointer) : &empty;
    buffers_.push_back(comm_.context_->createUnboundBuffer(p, bytes ? bytes : 1));
    comm_.register_buffer(buffers_.back().get());
    return buffers_.size() - 1;
  }

  uint64_t slot(uint32_t phase, uint32_t step) const {
    return slot_base_ | (uint64_t{phase} << 16) | step;
  }

  // Gloo refuses a transfer at once on a pair that has failed already: that peer is named.
  void post_send(size_t buffer_index, int32_t peer, uint64_t slot, size_t offset, size_t bytes) {
    if (bytes == 0) return;
    try {
      buffers_[buffer_index]->send(peer, slot, offset, bytes);
    } catch (const ::gloo::IoException& e) {
      broken_ = true;
      throw PeerFailure{{peer}, e.what()};
    }
    pending_sends_.push_back({buffer_index, peer});
  }
  void post_recv(size_t buffer_index, int32_t peer, uint64_t slot, size_t offset, size_t bytes) {
    if (bytes == 0) return;
    try {
      buffers_[buffer_index]->recv(peer, slot, offset, bytes);
    } catch (const ::gloo::IoException& e) {
      broken_ = true;
      throw PeerFailure{{peer}, e.what()};
    }
    pending_recvs_.push_back({buffer_index, peer});
  }

  // Waits for every posted transfer; Gloo throws on a broken peer, PeerTimeout names the
  // ranks still owed at the deadline.
  void wait_all() {
    while (!pending_recvs_.empty()) wait_one(pending_recvs_, true);
    while (!pending_sends_.empty()) wait_one(pending_sends_, false);
  }

  // Waits for the oldest posted receive alone. Receives from one peer complete in the
  // order they were posted (one TCP stream), which lets a caller reduce segment k while
  // segments k+1.. are still arriving.
  void wait_next_recv() { wait_one(pending_recvs_, true); }

  struct AbortedByUser {};
  // The deadline passed with transfers to or from these ranks outstanding.
  struct PeerTimeout {
    std::vector<int32_t> peers;
    bool receiving;
  };
  // Gloo failed a wait (a connection broke) while transfers with these ranks were owed on
  // that buffer.
  struct PeerFailure {
    std::vector<int32_t> peers;
    std::string what;
  };

  Clock::time_point deadline() const { return deadline_; }

  GlooCommunicator& comm_;
  const std::string operation;
  const uint64_t sequence;
  const Descriptor* descriptor = nullptr;  // the collective's, when it has one

 private:
  std::chrono::milliseconds remaining() const {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - Clock::now());
    // Gloo treats a non-positive timeout as "use the context's"; keep a real bound.
    return std::max(left, std::chrono::milliseconds(1));
  }

  struct Pending {
    size_t buffer;
    int32_t peer;
  };

  // Waits for one transfer on the buffer of list's oldest entry and crosses off the one that
  // completed (Gloo says which peer it was).
  void wait_one(std::vector<Pending>& list, bool receiving) {
    const size_t buffer = list.front().buffer;
    std::vector<int32_t> owed;
    for (const Pending& p : list) {
      if (p.buffer == buffer && std::find(owed.begin(), owed.end(), p.peer) == owed.end()) {
        owed.push_back(p.peer);
      }
    }
    int peer = -1;
    bool done = false;
    {
      // Watched while it blocks: a peer whose connection fails or (on this host) whose
      // process ends fails it (WaitWatch).
      const uint64_t watched = comm_.begin_wait({buffers_[buffer].get(), owed});
      struct EndWait {
        GlooCommunicator& comm;
        uint64_t id;
        ~EndWait() { comm.end_wait(id); }
      } end_wait{comm_, watched};
      try {
        done = receiving ? buffers_[buffer]->waitRecv(&peer, remaining())
                         : buffers_[buffer]->waitSend(&peer, remaining());
      } catch (const ::gloo::IoException& e) {
        broken_ = true;
        if (std::string_view(e.what()).find("Timed out") == std::string_view::npos) {
          throw PeerFailure{std::move(owed), e.what()};
        }
        throw PeerTimeout{std::move(owed), receiving};
      }
    }
    if (!done) {
      broken_ = true;
      if (!comm_.aborted_) {
        auto [failed, what] = comm_.watched_failure(owed);
        if (failed >= 0) owed = {failed};
        if (!what.empty()) throw PeerFailure{std::move(owed), std::move(what)};
      }
      throw AbortedByUser();
    }
    auto it = std::find_if(list.begin(), list.end(),
                           [&](const Pending& p) { return p.buffer == buffer && p.peer == peer; });
    list.erase(it != list.end() ? it : list.begin());
  }

  uint64_t slot_base_;
  Clock::time_point deadline_;
  std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> buffers_;
  std::vector<Pending> pending_sends_;
  std::vector<Pending> pending_recvs_;
  bool broken_ = false;  // a wait or a post failed: the transport may still touch the buffers
};

namespace {

// Reduces `count` elements in `parts` segments as each arrives (receives from one peer
// complete in the order they were posted): target = first op second, segment by segment.
void reduce_as_received(GlooCommunicator::Op& op, DType dtype, ReduceOp reduce_op, size_t count,
                        size_t parts, uint8_t* target, const uint8_t* first,
                        const uint8_t* second) {
  const size_t element = dtype_size(dtype);
  for (size_t k = 0; k < parts; ++k) {
    const auto [b, e] = segment(count, parts, k);
    if (e == b) continue;  // never posted
    op.wait_next_recv();
    reduce_elements(dtype, reduce_op, target + b * element, first + b * element,
                    second + b * element, e - b);
  }
}

}  // namespace

GlooCommunicator::GlooCommunicator(std::shared_ptr<Store> store, int32_t rank, int32_t size,
                                   CommOptions options)
    : store_(std::move(store)),
      rank_(rank),
      size_(size),
      options_(std::move(options)),
      timeout_ms_(options_.timeout.count()),
      stream_(std::make_unique<cpu::CpuStream>()),
      scratch_(6),
      waiter_([this] { complete_transfers(); }) {
  gone_.resize(static_cast<size_t>(size_));
  broken_.resize(static_cast<size_t>(size_));
  stream_->set_trace_name("communicator '" + options_.name + "' rank " + std::to_string(rank_) +
                          " of " + std::to_string(size_));
  set_rank_names(RankNames(options_.world_ranks));
}

// A communicator's Gloo transport and the watch's receives posted on it. Gloo may tell those
// receives of a failed connection for as long as the connection is open, so they are
// destroyed only after the connections are closed, and closed gracefully: whatever is still
// queued for a peer is sent, then a FIN (Context::closeConnections resets them, discarding
// it). Gloo closes them so when a wait times out: it fails every connection of the context,
// telling the receives posted on them under the connections' locks. A wait of 1 ms on a
// watch receive, which no peer completes, does that.
struct Transport {
  std::shared_ptr<::gloo::Context> context;
  std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> watch_buffers;
  Transport(std::shared_ptr<::gloo::Context> c,
            std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> w)
      : context(std::move(c)), watch_buffers(std::move(w)) {}
  Transport(Transport&&) = default;
  Transport& operator=(Transport&&) = delete;
  ~Transport() {
    // Each wait throws at once where its connection has failed (or the first wait's
    // timeout failed it); then the buffers go, then the context.
    for (auto& watch : watch_buffers) {
      if (!watch) continue;
      try {
        (void)watch->waitRecv(nullptr, std::chrono::milliseconds(1));
      } catch (const std::exception&) {
        // Its connection is closed: what the loop was for.
      }
    }
  }
  // Left open, never destroyed (at process exit; held where a leak check sees it).
  void abandon() {
    static auto* left_open = new std::deque<Transport>();
    left_open->push_back(std::move(*this));
  }
};

// A rank whose last collective has completed may still have bytes in flight to a peer (a
// completed send means written to the socket, not received). A communicator destroyed in
// health keeps its transport open for a grace period, held by one process-wide thread, which
// then closes it as Transport does (a FIN after whatever is queued; Gloo's own close()
// resets the connections, discarding what the peer has not read).
class ContextReaper {
 public:
  static ContextReaper& instance() {
    std::lock_guard lock(slot_mutex());
    auto& reaper = slot();
    if (!reaper) reaper.reset(new ContextReaper());
    return *reaper;
  }
  // The forked child's: see forget_the_parents_transport().
  static void forget_the_parents() {
    new (&slot_mutex()) std::mutex();  // the parent's may have been held at the fork
    (void)slot().release();            // never destroyed here: its thread is the parent's
  }
  void retire(Transport transport) {
    std::lock_guard lock(mutex_);
    retired_.push_back({std::move(transport), Clock::now() + kGrace});
    cv_.notify_one();
  }
  ~ContextReaper() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }

 private:
  static constexpr std::chrono::seconds kGrace{5};
  static std::mutex& slot_mutex() {
    static std::mutex mutex;
    return mutex;
  }
  static std::unique_ptr<ContextReaper>& slot() {
    static std::unique_ptr<ContextReaper> reaper;
    return reaper;
  }
  struct Retired {
    Transport transport;
    Clock::time_point close_at;
  };
  ContextReaper() : thread_([this] { run(); }) {}
  void run() {
    std::unique_lock lock(mutex_);
    while (!stopping_ || !retired_.empty()) {
      if (stopping_) {
        // Process exit: the rest stay open for the exit to close them (a FIN after whatever
        // is still queued for a peer) instead of a reset that would discard it.
        for (Retired& r : retired_) r.transport.abandon();
        retired_.clear();
        break;
      }
      if (retired_.empty()) {
        cv_.wait(lock);
        continue;
      }
      const auto next = retired_.front().close_at;
      if (Clock::now() < next) {
        cv_.wait_until(lock, next);
        continue;
      }
      {
        Transport expired = std::move(retired_.front().transport);
        retired_.pop_front();
        lock.unlock();
      }  // closes the sockets, outside the lock
      lock.lock();
    }
  }
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Retired> retired_;
  bool stopping_ = false;
  std::thread thread_;
};

// One thread for the process: every 100 ms it asks each communicator with peers whether a
// wait under way is owed a transfer by a peer whose connection has failed (seen failed a
// round before, so that a transfer completed just before is taken first), that ended the
// group (its shared-memory control block or its control connection says so) or whose
// process on this host has ended (those two seen for a second: what the peer wrote before
// is read meanwhile), and fails such a wait. Gloo tells a failed connection to the transfers
// queued on it, but not to one under way: such a wait would last until the communicator's
// timeout (minutes by default).
class WaitWatch {
 public:
  static constexpr std::chrono::milliseconds kPeriod{100};
  static constexpr std::chrono::milliseconds kGrace{1000};

  static WaitWatch& instance() {
    std::lock_guard lock(slot_mutex());
    WaitWatch*& watch = slot();
    if (watch == nullptr) watch = new WaitWatch();  // never destroyed: its thread runs on
    return *watch;
  }
  // The forked child's: see forget_the_parents_transport().
  static void forget_the_parents() {
    new (&slot_mutex()) std::mutex();
    slot() = nullptr;  // the parent's, whose thread the child lacks, is left alone
  }
  void add(GlooCommunicator* comm) {
    std::lock_guard lock(mutex_);
    comms_.insert(comm);
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
  }
  // Once it returns, no round uses `comm` any more.
  void remove(GlooCommunicator* comm) {
    std::lock_guard lock(mutex_);
    comms_.erase(comm);
  }

 private:
  static std::mutex& slot_mutex() {
    static std::mutex mutex;
    return mutex;
  }
  static WaitWatch*& slot() {
    static WaitWatch* watch = nullptr;
    return watch;
  }
  void run() {
    std::unique_lock lock(mutex_);
    for (;;) {
      cv_.wait_for(lock, kPeriod);
      for (GlooCommunicator* comm : comms_) comm->check_waits();
    }
  }
  std::mutex mutex_;
  std::condition_variable cv_;
  std::set<GlooCommunicator*> comms_;
  std::thread thread_;
};

// After fork() the child holds copies of the parent's TCP devices and reaper but none of
// their threads, and their sockets and event loops (epoll) are the parent's too: closing one
// in the child would unregister the parent's descriptors, and a communicator made on one
// would wait for a loop that never runs. The child leaves them alone (never closed) and
// makes its own on first use.
namespace {

void forget_the_parents_transport() {
  new (&devices_mutex()) std::mutex();
  (void)new DeviceMap(std::move(devices_by_host()));  // kept, never destroyed
  devices_by_host().clear();
  ContextReaper::forget_the_parents();
  WaitWatch::forget_the_parents();
}
[[maybe_unused]] const bool g_fork_handler_registered =
    ::pthread_atfork(nullptr, nullptr, forget_the_parents_transport) == 0;

}  // namespace

GlooCommunicator::~GlooCommunicator() {
  untie();
  // Finish (or, once aborted, fail fast) the queued operations before the transport goes.
  stream_.reset();
  {
    std::lock_guard lock(waiter_mutex_);
    stopping_ = true;
  }
  waiter_cv_.notify_all();
  waiter_.join();
  if (size_ > 1) WaitWatch::instance().remove(this);  // added once made
  shm_.reset();  // tells same-host peers still waiting for this rank that it has gone
  bool healthy = !aborted_ && parked_.empty();
  {
    std::lock_guard lock(failure_mutex_);
    healthy = healthy && failure_.ok();
  }
  {
    Transport transport(std::move(context_), std::move(watch_buffers_));
    // After an abort or a failure the peers must learn at once that this rank is gone.
    if (healthy && transport.context) ContextReaper::instance().retire(std::move(transport));
  }                 // otherwise closed here
  parked_.clear();  // the transport is gone: nothing signals them any more
}

uint64_t GlooCommunicator::begin_wait(OwedTransfers owed) {
  if (size_ <= 1) return 0;
  std::lock_guard lock(waits_mutex_);
  const uint64_t id = ++next_wait_;
  waits_.emplace(id, std::move(owed));
  return id;
}

void GlooCommunicator::end_wait(uint64_t id) {
  if (id == 0) return;
  std::lock_guard lock(waits_mutex_);
  waits_.erase(id);
}

std::pair<int32_t, std::string> GlooCommunicator::watched_failure(
    const std::vector<int32_t>& peers) {
  std::lock_guard lock(waits_mutex_);
  for (int32_t p : peers) {
    if (p >= 0 && static_cast<size_t>(p) < broken_.size() && !broken_[p].empty()) {
      return {p, broken_[p]};
    }
  }
  if (ended_while_waiting_.empty()) return {-1, ""};
  return {-1, "its process ended while this rank waited for a transfer with it"};
}

std::optional<std::string> GlooCommunicator::connection_failure(int32_t peer) {
  if (peer < 0 || static_cast<size_t>(peer) >= watch_buffers_.size() || !watch_buffers_[peer]) {
    return std::nullopt;
  }
  // Aborted first, the wait returns at once: false while the connection works, Gloo's
  // exception once it has failed.
  ::gloo::transport::UnboundBuffer& watch = *watch_buffers_[peer];
  watch.abortWaitRecv();
  try {
    (void)watch.waitRecv(nullptr, std::chrono::milliseconds(1000));
  } catch (const std::exception& e) {
    return std::string(e.what());
  }
  return std::nullopt;
}

std::optional<std::string> GlooCommunicator::peer_ended_group(int32_t peer) {
  // Gloo's connections are not always seen to close: a process the peer forked holds them
  // open, and waits for it lasted the whole timeout. What the peer says as it ends the group
  // is told on its own: over shared memory its control block (aborted, failed or left), over
  // TCP its control connection (a farewell, or shut down).
  if (aborted_) return std::nullopt;
  Status gone = Status::Ok();
  if (shm_) gone = shm_->peer_gone(peer);
  if (gone.ok() && control_) gone = control_->check_peer_ended(peer);
  if (!gone.ok()) return gone.message();
  return std::nullopt;
}

void GlooCommunicator::check_waits() {
  std::lock_guard lock(waits_mutex_);
  if (waits_.empty()) return;
  const auto now = Clock::now();
  auto failed = [&](int32_t p) { return gone_[p] || !broken_[p].empty(); };
  bool any = false;
  for (const auto& [id, wait] : waits_) {
    for (int32_t p : wait.peers) {
      if (p < 0 || p >= size_) continue;
      if (!failed(p)) {
        if (auto what = connection_failure(p)) {
          if (now - seen_broken_.emplace(p, now).first->second >= WaitWatch::kPeriod) {
            broken_[p] = *what;
          }
        } else if (auto said = peer_ended_group(p)) {
          // A peer that destroyed its communicator ends its control connection too: what it
          // sent before is read meanwhile.
          if (now - seen_leaving_.emplace(p, now).first->second >= WaitWatch::kGrace) {
            broken_[p] = *said;
          }
        } else if (static_cast<size_t>(p) < peer_processes_.size() && peer_processes_[p] &&
                   peer_processes_[p]->ended()) {
          // What it wrote before it ended is read meanwhile.
          if (now - seen_ended_.emplace(p, now).first->second >= WaitWatch::kGrace) {
            gone_[p] = peer_processes_[p];
            ended_while_waiting_ = ended_peers(gone_, rank_, rank_names());
          }
        }
      }
      any = any || failed(p);
    }
  }
  if (!any) return;
  for (const auto& [id, wait] : waits_) {
    if (std::any_of(wait.peers.begin(), wait.peers.end(),
                    [&](int32_t p) { return p >= 0 && p < size_ && failed(p); })) {
      wait.buffer->abortWaitRecv();
      wait.buffer->abortWaitSend();
    }
  }
}

void GlooCommunicator::park_buffers(
    std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> buffers) {
  std::lock_guard lock(buffers_mutex_);
  for (auto& b : buffers) parked_.push_back(std::move(b));
}

StatusOr<std::unique_ptr<Communicator>> GlooCommunicator::create(std::shared_ptr<Store> store,
                                                                 int32_t rank, int32_t size,
                                                                 const CommOptions& options) {
  if (size > kMaxGlooGroupSize) {
    return out_of_range("the CPU communicator serves groups of up to " +
                        std::to_string(kMaxGlooGroupSize) + " ranks, not " + std::to_string(size));
  }
  ignore_sigpipe_at_default();
  HPS_ASSIGN_OR_RETURN(auto device, shared_device());
  // Ranks create communicators on one store in the same order, so a per-rank count in
  // the store gives every creation the same fresh key space on all of them.
  HPS_ASSIGN_OR_RETURN(int64_t generation,
                       store->add("communicators/rank" + std::to_string(rank), 1));
  store = make_prefix_store(std::move(store), "comm" + std::to_string(generation));
  std::unique_ptr<GlooCommunicator> comm(new GlooCommunicator(store, rank, size, options));
  auto peers = std::make_shared<PeerWatch>(store, rank, size, comm->rank_names());
  HPS_RETURN_IF_ERROR(peers->publish());
  HPS_RETURN_IF_ERROR(store->set(check_key(rank), options.check_arguments ? "1" : "0"));
  // The creation's waits for peers end when one of them is seen to have ended.
  auto watched = std::make_shared<WatchedStore>(store, [peers] { return peers->check(); });
  try {
    auto context = std::make_shared<::gloo::rendezvous::Context>(rank, size);
    // Gloo waits five times its context's timeout for a peer to connect (a peer killed
    // between publishing its address and connecting made the survivors wait 5x): a fifth of
    // it here, so that wait is the timeout. The adapter's waits for late ranks keep the
    // whole timeout; the transfers pass their own.
    context->setTimeout(std::max(Milliseconds(1), options.timeout / 5));
    GlooStoreAdapter adapter(make_prefix_store(watched, "gloo"), options.timeout, rank, size);
    try {
      ConnectWatch connecting(peers, adapter);
      context->connectFullMesh(adapter, device);
    } catch (const std::exception& e) {
      const std::string what = e.what();
      const int32_t peer = rank_named_in(what, adapter.take_peer_addresses());
      if (peer < 0) throw;
      throw std::runtime_error(connection_failed(peer, what, comm->rank_names()));
    }
    // A connect that ConnectWatch ended returned as if made: the peer's end says why.
    const Status gone = peers->check();
    if (!gone.ok()) throw std::runtime_error(gone.message());
    comm->peer_addresses_ = adapter.take_peer_addresses();
    context->setTimeout(options.timeout);
    comm->context_ = std::move(context);
    // Gloo tells a failed connection to the receives posted on it: one per peer, never
    // completed, lets WaitWatch ask.
    comm->watch_buffers_.resize(static_cast<size_t>(size));
    for (int32_t p = 0; p < size; ++p) {
      if (p == rank) continue;
      static uint8_t never_written = 0;
      auto watch = comm->context_->createUnboundBuffer(&never_written, 1);
      watch->recv(p, kWatchSlot, 0, 1);
      comm->watch_buffers_[static_cast<size_t>(p)] = std::move(watch);
    }
    // Ranks that all run here also share memory for collectives (send / recv stay on TCP).
    const size_t slot_bytes = options.shared_memory_slot_bytes ? options.shared_memory_slot_bytes
                                                               : shm::kDefaultSlotBytes;
    auto shm_store = make_prefix_store(watched, "shm");
    auto shm =
        shm::ShmGroup::create(*shm_store, rank, size, options.shared_memory, slot_bytes,
                              options.timeout, options.shared_memory_direct, comm->rank_names());
    if (!shm.ok()) throw std::runtime_error(shm.status().to_string());
    comm->shm_ = std::move(shm).value();
    // Over TCP the argument check travels on its own connections (shared memory checks
    // in its first round).
    if (!comm->shm_ && size > 1) {
      const Status agreed = agree_on_checking(*watched, rank, size, options.check_arguments,
                                              options.timeout, comm->rank_names());
      if (agreed.code() == StatusCode::kInvalidArgument) throw Refused{agreed};
      if (!agreed.ok()) throw std::runtime_error(agreed.to_string());
    }
    if (!comm->shm_ && options.check_arguments && size > 1) {
      auto control = ControlMesh::create(
          *make_prefix_store(watched, "control"), rank, size, device_host(),
          Clock::now() + options.timeout, [peers] { return peers->check(); }, comm->rank_names());
      if (!control.ok()) throw std::runtime_error(control.status().to_string());
      comm->control_ = std::move(control).value();
    }
    watched->stop_watching();  // no check runs beside the reads below
    comm->peer_processes_ = peers->take();
    if (comm->control_) comm->control_->watch_processes(comm->peer_processes_);
    const Status marked = peers->made_here();
    if (!marked.ok()) throw std::runtime_error(marked.to_string());
  } catch (const Refused& refused) {
    watched->stop_watching();
    return Status(refused.status.code(), "creating communicator '" + options.name + "' (rank " +
                                             std::to_string(rank) + " of " + std::to_string(size) +
                                             "): " + refused.status.message());
  } catch (const std::exception& e) {
    watched->stop_watching();
    const std::string what = e.what();
    const std::string prefix = "creating communicator '" + options.name + "' (rank " +
                               std::to_string(rank) + " of " + std::to_string(size) + "): ";
    const std::string m = prefix + what;
    // A peer that ended explains whatever failed (a refused connection, a wait).
    const Status gone = peers->check();
    if (!gone.ok()) {
      if (what.find(gone.message()) != std::string::npos) return aborted(m);
      return aborted(prefix + gone.message() + ": " + what);
    }
    if (what.find("timed out") != std::string::npos ||
        what.find("Timed out") != std::string::npos ||
        what.find("Connect timeout") != std::string::npos) {
      const std::string missing = peers->unpublished();
      if (missing.empty()) return timeout_error(m);
      return timeout_error(m + " (" + missing + " creating it: not started, or ended before)");
    }
    // A member gone (a split's, or a peer that refused or reset its connection).
    if (what.rfind("aborted: ", 0) == 0 || what.rfind("the connection to rank ", 0) == 0) {
      return aborted(m);
    }
    return backend_error(m);
  }
  HPS_LOG(kDebug) << "communicator '" << options.name << "' rank " << rank << "/" << size
                  << " connected over " << comm->transport();
  if (size > 1) WaitWatch::instance().add(comm.get());
  return std::unique_ptr<Communicator>(std::move(comm));
}

void GlooCommunicator::register_buffer(::gloo::transport::UnboundBuffer* buffer) {
  std::lock_guard lock(buffers_mutex_);
  active_buffers_.insert(buffer);
  if (ended_) {  // abort() or a failure ran before this buffer existed: its waits return at once
    buffer->abortWaitRecv();
    buffer->abortWaitSend();
  }
}

void GlooCommunicator::unregister_buffer(::gloo::transport::UnboundBuffer* buffer) {
  std::lock_guard lock(buffers_mutex_);
  active_buffers_.erase(buffer);
}

void GlooCommunicator::abort_operations() {
  {
    std::lock_guard lock(buffers_mutex_);
    aborted_ = true;
    if (shm_) shm_->abort();
  }
  end_connections(std::nullopt);
}

Status GlooCommunicator::located(const Op& op, Status s) const {
  if (s.ok()) return s;
  return Status(s.code(), where(op.operation, op.sequence) + ": " + s.message());
}

std::string GlooCommunicator::where(const std::string& operation, uint64_t sequence) const {
  // Collectives count from 1; a point-to-point operation (sequence 0) carries its own
  // number and peer in `operation` ("send #3 to rank 1").
  return operation + (sequence != 0 ? " #" + std::to_string(sequence) : std::string()) +
         " on group '" + options_.name + "' (rank " + std::to_string(rank_) + " of " +
         std::to_string(size_) + ")";
}

void* GlooCommunicator::scratch(size_t index, size_t bytes) {
  auto& s = scratch_[index];
  if (s.size() < bytes) s.resize(bytes);
  return s.data();
}

StatusOr<std::shared_ptr<Work>> GlooCommunicator::enqueue(std::string operation, Stream* ready,
                                                          const Descriptor* descriptor,
                                                          uint64_t slot_base, Body body) {
  if (aborted_) return aborted(operation + " on group '" + options_.name + "': it was aborted");
  {
    std::lock_guard lock(failure_mutex_);
    if (!failure_.ok()) {
      return aborted(operation + " on group '" + options_.name +
                     "': an earlier operation failed: " + failure_.message());
    }
  }
  HPS_RETURN_IF_ERROR(wait_for_ready(*stream_, ready, operation));
  const uint64_t sequence = descriptor ? descriptor->sequence : 0;
  auto work = std::make_shared<Work>(where(operation, sequence), std::make_unique<cpu::CpuEvent>());
  std::optional<Descriptor> checked;
  if (descriptor) checked = *descriptor;
  if (checks_over_control_mesh(descriptor)) {
    // The descriptor leaves now, so the peers have it before the stream runs the check.
    Status posted = control_->post(descriptor, sizeof(Descriptor), Clock::now() + timeout());
    if (!posted.ok()) {
      posted = Status(posted.code(), where(operation, sequence) + ": " + posted.message());
      if (record_failure(posted)) notify_failure(posted);
      return posted;
    }
  }
  stream_->enqueue([this, work, operation = std::move(operation), sequence, slot_base, checked,
                    body = std::move(body)] {
    // Nothing may escape into the stream's worker thread: whatever is thrown becomes this
    // operation's error, and with it the communicator's.
    Status s;
    try {
      const auto deadline = Clock::now() + timeout();
      Op op(*this, operation, sequence, slot_base, deadline);
      op.descriptor = checked ? &*checked : nullptr;
      if (trace::enabled() && checked) {
        // All the bytes of the operation (all-gather, reduce-scatter: per rank × ranks).
        const uint64_t ranks =
            checked->kind == kAllGatherKind || checked->kind == kReduceScatterKind ? size_ : 1;
        trace::collective(operation,
                          checked->count * dtype_size(static_cast<DType>(checked->dtype)) * ranks,
                          options_.name, sequence);
      }
      s = run(op, op.descriptor, body);
    } catch (...) {
      s = aborted(where(operation, sequence) + ": " + describe_exception());
    }
    end_work(*work, std::move(s));
  });
  HPS_RETURN_IF_ERROR(work->done_event().record(*stream_));
  return work;
}

Status GlooCommunicator::run(Op& op, const Descriptor* descriptor, const Body& body) {
  return guarded(op, [&]() -> Status {
    // Shared memory checks every collective's descriptor itself, in its first round.
    if (checks_over_control_mesh(descriptor)) {
      HPS_RETURN_IF_ERROR(check_descriptors(op, *descriptor));
    }
    return body(op);
  });
}

Status GlooCommunicator::guarded(Op& op, const std::function<Status()>& fn) {
  const std::string place = where(op.operation, op.sequence);
  if (aborted_) return aborted(place + ": the communicator was aborted");
  {
    std::lock_guard lock(failure_mutex_);
    if (!failure_.ok()) {
      return aborted(place + ": an earlier operation failed: " + failure_.message());
    }
  }
  try {
    return fn();
  } catch (const Op::AbortedByUser&) {
    if (!aborted_) {  // its wait was ended by another operation's failure
      std::lock_guard lock(failure_mutex_);
      if (!failure_.ok()) {
        return aborted(place + ": an earlier operation failed: " + failure_.message());
      }
    }
    return aborted(place + ": the communicator was aborted");
  } catch (const Op::PeerTimeout& t) {
    if (aborted_) return aborted(place + ": the communicator was aborted");
    const std::string who = rank_names().list(t.peers);
    return timeout_error(place + ": timed out after " + std::to_string(timeout().count()) + " ms " +
                         (t.receiving ? "waiting for data from " : "sending to ") + who +
                         " (a peer is missing or called a different operation)");
  } catch (const Op::PeerFailure& f) {
    if (aborted_) return aborted(place + ": the communicator was aborted");
    // The rank Gloo's message names by address, else the one rank owed on that buffer.
    int32_t peer = rank_named_in(f.what, peer_addresses_);
    if (peer < 0 && f.peers.size() == 1) peer = f.peers[0];
    return aborted(place + ": " + with_ended_peers(peer_ended(peer, f.what)));
  } catch (const std::exception& e) {
    if (aborted_) return aborted(place + ": the communicator was aborted");
    const std::string what = e.what();
    if (what.find("Timed out") != std::string::npos ||
        what.find("timed out") != std::string::npos) {
      return timeout_error(place + ": timed out after " + std::to_string(timeout().count()) +
                           " ms (a peer is missing or called a different operation): " + what);
    }
    return aborted(place + ": " +
                   with_ended_peers(peer_ended(rank_named_in(what, peer_addresses_), what)));
  } catch (...) {
    return aborted(place + ": " + describe_exception());
  }
}

std::string GlooCommunicator::peer_ended(int32_t peer, const std::string& what) {
  if (peer >= 0 && peer < size_) {
    // Over shared memory (point-to-point transfers go over Gloo's pairs there too) the
    // peer's control block says why.
    if (shm_) {
      const Status gone = shm_->peer_gone(peer);
      if (!gone.ok()) return gone.message();
    }
    // Over TCP a peer that ended the group said why on its control connection before its
    // connections closed; the farewell may trail the reset that brought this here by a
    // moment, unless its process has ended (none is coming: only what has come is read).
    if (control_) {
      const bool ended = static_cast<size_t>(peer) < peer_processes_.size() &&
                         peer_processes_[static_cast<size_t>(peer)] &&
                         peer_processes_[static_cast<size_t>(peer)]->ended();
      constexpr std::chrono::milliseconds kFarewellWait{250};
      if (auto said =
              control_->farewell(peer, Clock::now() + (ended ? Milliseconds(0) : kFarewellWait))) {
        return *said;
      }
    }
  }
  return connection_failed(peer, what, rank_names());
}

std::string GlooCommunicator::with_ended_peers(const std::string& failure) const {
  // A survivor's connections fail too once its peers abort theirs: the rank that ended is
  // named first, whichever connection failed here.
  const std::string ended = ended_peers(peer_processes_, rank_, rank_names());
  if (ended.empty()) return failure;
  return ended + "; " + failure;
}

void GlooCommunicator::end_work(Work& work, Status s) noexcept {
  try {
    // The links hear of it before the work ends: whatever waits on the work (a stream, then
    // another group's collective) finds their groups failed.
    if (record_failure(s)) notify_failure(s);
  } catch (...) {
    // Logging the failure failed (out of memory): the work still carries it.
  }
  work.set_status(std::move(s));
}

std::string GlooCommunicator::describe_exception() noexcept {
  try {
    throw;
  } catch (const std::exception& e) {
    return std::string("unexpected exception: ") + e.what();
  } catch (...) {
    return "unexpected exception of an unknown type";
  }
}

void GlooCommunicator::fail_operations(const Status& cause) {
  {
    std::lock_guard lock(failure_mutex_);
    if (aborted_ || !failure_.ok()) return;
  }
  (void)record_failure(cause);
}

bool GlooCommunicator::record_failure(const Status& s) {
  if (s.ok()) return false;
  bool first = false;
  {
    std::lock_guard lock(failure_mutex_);
    first = failure_.ok();
    if (first) failure_ = s;
    if (shm_) shm_->mark_failed(s.message());
  }
  if (!first) return false;  // refused after it: "an earlier operation failed: ..."
  HPS_LOG(kWarn) << s.to_string();
  // A failed communicator runs nothing more, and its peers must not complete the operation
  // it gave up on (with the data it sent before), nor wait out their own timeouts.
  end_connections(s.message());
  return first;
}

void GlooCommunicator::end_connections(std::optional<std::string_view> failure) {
  // Closing the connections (a reset) fails the peers' transfers with this rank at once, and
  // the control connections' end fails their argument checks; the farewell sent on those
  // first says why (what a peer's error then quotes).
  std::lock_guard lock(buffers_mutex_);
  if (control_) {
    if (failure && !aborted_) {  // (an operation an abort ended fails too: still an abort)
      control_->fail(*failure);
    } else {
      control_->abort();
    }
  }
  if (context_) context_->closeConnections();
  // The transfers waiting here end now: closing a connection tells this rank's waits on it
  // nothing (they lasted the whole timeout once an operation failed).
  ended_ = true;
  for (auto* b : active_buffers_) {
    b->abortWaitRecv();
    b->abortWaitSend();
  }
}

bool GlooCommunicator::checks_over_control_mesh(const Descriptor* descriptor) const {
  return descriptor && options_.check_arguments && size_ > 1 && !shm_;
}

Status GlooCommunicator::check_descriptors(Op& op, const Descriptor& mine) {
  // This rank's descriptor went to every peer when the collective was enqueued; the
  // peers' have most likely arrived by now.
  const size_t bytes = sizeof(Descriptor);
  auto* all = static_cast<Descriptor*>(scratch(2, bytes * static_cast<size_t>(size_)));
  std::memcpy(&all[rank_], &mine, bytes);
  HPS_RETURN_IF_ERROR(located(op, control_->collect(all, bytes, op.deadline())));
  return check_agreement(where(op.operation, op.sequence), mine, all, size_, rank_names());
}

Status GlooCommunicator::ring_all_gather(Op& op, void* recv, size_t bytes_per_rank,
                                         uint32_t phase) {
  if (size_ == 1 || bytes_per_rank == 0) return Status::Ok();
  const size_t all = op.buffer(recv, bytes_per_rank * static_cast<size_t>(size_));
  ring_pass_blocks(
      op, all, rank_,
      [bytes_per_rank](int32_t i) {
        return std::pair{static_cast<size_t>(i) * bytes_per_rank, bytes_per_rank};
      },
      phase);
  return Status::Ok();
}

void GlooCommunicator::ring_pass_blocks(
    Op& op, size_t buffer, int32_t first,
    const std::function<std::pair<size_t, size_t>(int32_t)>& block, uint32_t phase) {
  const int32_t n = size_;
  const int32_t next = wrap(rank_ + 1, n), prev = wrap(rank_ - 1, n);
  // Step s receives block first - s - 1 and forwards it at step s + 1. Every receive is
  // posted up front (the blocks are disjoint), so no step waits for its announce round
  // trip; each block travels in segments, and a segment is forwarded as soon as it has
  // arrived, so the steps pipeline around the ring.
  auto segments = [&](int32_t index) {
    return segments_for(block(index).second, kMinCopySegmentBytes);
  };
  auto slot = [&](int32_t step, size_t k) {
    return op.slot(phase, static_cast<uint32_t>(static_cast<size_t>(step) * kMaxSegments + k));
  };
  for (int32_t s = 0; s < n - 1; ++s) {
    const int32_t index = wrap(first - s - 1, n);
    const auto [offset, bytes] = block(index);
    const size_t parts = segments(index);
    for (size_t k = 0; k < parts; ++k) {
      const auto [b, e] = segment(bytes, parts, k);
      op.post_recv(buffer, prev, slot(s, k), offset + b, e - b);
    }
  }
  for (int32_t s = 0; s < n - 1; ++s) {
    const int32_t index = wrap(first - s, n);
    const auto [offset, bytes] = block(index);
    const size_t parts = segments(index);
    for (size_t k = 0; k < parts; ++k) {
      const auto [b, e] = segment(bytes, parts, k);
      // Segment k of this block, received at step s - 1 (an empty one was never posted).
      if (s > 0 && e > b) op.wait_next_recv();
      op.post_send(buffer, next, slot(s, k), offset + b, e - b);
    }
  }
  op.wait_all();
}

// fp16 and bf16 sums (and means) travel the ring in fp32 and are rounded once at the end,
// as the shared-memory path and reduce_many do: a ring that rounded each partial sum to the
// dtype gave sums up to an ulp or more off, depending on the ring's order.
bool GlooCommunicator::widens(DType dtype, ReduceOp reduce_op) const {
  return (dtype == DType::kFloat16 || dtype == DType::kBFloat16) &&
         (reduce_op == ReduceOp::kSum || reduce_op == ReduceOp::kAvg) && size_ > 1;
}

Status GlooCommunicator::tcp_all_reduce(Op& op, const void* send, void* recv, size_t count,
                                        DType dtype, ReduceOp reduce_op) {
  if (!widens(dtype, reduce_op)) return ring_all_reduce(op, send, recv, count, dtype, reduce_op);
  auto* wide = static_cast<float*>(scratch(4, count * sizeof(float)));
  widen_half(dtype, send, wide, count);
  HPS_RETURN_IF_ERROR(ring_all_reduce(op, wide, wide, count, DType::kFloat32, ReduceOp::kSum));
  narrow_half(dtype, wide, recv, count, reduce_op == ReduceOp::kAvg ? size_ : 1);
  return Status::Ok();
}

Status GlooCommunicator::tcp_reduce_scatter(Op& op, const void* send, void* recv, size_t count,
                                            DType dtype, ReduceOp reduce_op) {
  // Power-of-two groups of 4 or more halve recursively (at 2 it is the same exchange).
  const bool halving = size_ > 2 && (size_ & (size_ - 1)) == 0 && count > 0;
  auto algorithm = [&](const void* s, void* r, DType d, ReduceOp o) {
    return halving ? halving_reduce_scatter(op, s, r, count, d, o)
                   : ring_reduce_scatter(op, s, r, count, d, o);
  };
  if (!widens(dtype, reduce_op)) return algorithm(send, recv, dtype, reduce_op);
  const size_t all = count * static_cast<size_t>(size_);
  auto* wide = static_cast<float*>(scratch(4, all * sizeof(float)));
  auto* sum = static_cast<float*>(scratch(5, count * sizeof(float)));
  widen_half(dtype, send, wide, all);
  HPS_RETURN_IF_ERROR(algorithm(wide, sum, DType::kFloat32, ReduceOp::kSum));
  narrow_half(dtype, sum, recv, count, reduce_op == ReduceOp::kAvg ? size_ : 1);
  return Status::Ok();
}

Status GlooCommunicator::ring_all_reduce(Op& op, const void* send, void* recv, size_t count,
                                         DType dtype, ReduceOp reduce_op) {
  const int32_t n = size_, r = rank_;
  const size_t element = dtype_size(dtype);
  auto* data = static_cast<uint8_t*>(recv);
  const auto* original = static_cast<const uint8_t*>(send);
  if (n == 1 || count == 0) {
    if (send != recv && count) std::memcpy(recv, send, count * element);
    return Status::Ok();
  }
  const Chunks chunks(count, n);
  void* incoming = scratch(0, chunks.largest() * element);
  const size_t whole = op.buffer(recv, count * element);
  // Step 0 sends this rank's own chunk straight from `send`; every later step sends the
  // chunk reduced in the step before, from `recv`. Each chunk is reduced once per rank,
  // from `send`'s values and what arrived, so `recv` needs no first copy: the one chunk
  // never reduced here is overwritten by the all-gather.
  const size_t source = send == recv ? whole : op.buffer(send, count * element);
  const size_t tmp = op.buffer(incoming, chunks.largest() * element);
  const int32_t next = wrap(r + 1, n), prev = wrap(r - 1, n);
  // Reduce-scatter: after n-1 steps this rank holds the reduction of chunk r+1. Each
  // step's chunk travels in segments; segment k is reduced while k+1.. arrive.
  for (int32_t s = 0; s < n - 1; ++s) {
    const int32_t send_index = wrap(r - s, n), recv_index = wrap(r - s - 1, n);
    const size_t recv_count = chunks.size(recv_index), send_count = chunks.size(send_index);
    // Both ends cut a chunk by its own size, so their segments (and slots) agree.
    const size_t recv_parts = segments_for(recv_count * element);
    const size_t send_parts = segments_for(send_count * element);
    const uint32_t base = static_cast<uint32_t>(s) * kMaxSegments;
    for (size_t k = 0; k < recv_parts; ++k) {
      const auto [b, e] = segment(recv_count, recv_parts, k);
      op.post_recv(tmp, prev, op.slot(1, base + static_cast<uint32_t>(k)), b * element,
                   (e - b) * element);
    }
    for (size_t k = 0; k < send_parts; ++k) {
      const auto [b, e] = segment(send_count, send_parts, k);
      op.post_send(s == 0 ? source : whole, next, op.slot(1, base + static_cast<uint32_t>(k)),
                   (chunks.offset(send_index) + b) * element, (e - b) * element);
    }
    reduce_as_received(
        op, dtype, reduce_op, recv_count, recv_parts, data + chunks.offset(recv_index) * element,
        original + chunks.offset(recv_index) * element, static_cast<const uint8_t*>(incoming));
    op.wait_all();  // the sends
  }
  const int32_t own = wrap(r + 1, n);
  if (reduce_op == ReduceOp::kAvg) {
    finish_average(dtype, data + chunks.offset(own) * element, chunks.size(own), n);
  }
  // All-gather of the reduced chunks, in place: this rank holds chunk r + 1.
  ring_pass_blocks(
      op, whole, own,
      [&](int32_t i) {
        return std::pair{chunks.offset(i) * element, chunks.size(i) * element};
      },
      2);
  return Status::Ok();
}

Status GlooCommunicator::ring_reduce_scatter(Op& op, const void* send, void* recv, size_t count,
                                             DType dtype, ReduceOp reduce_op) {
  const int32_t n = size_, r = rank_;
  const size_t element = dtype_size(dtype);
  const size_t bytes = count * element;
  const auto* input = static_cast<const uint8_t*>(send);
  if (count == 0) return Status::Ok();
  if (n == 1) {
    if (recv != send) std::memcpy(recv, send, bytes);
    return Status::Ok();
  }
  // Two partial sums alternate: one is being sent while the next is being reduced.
  void* partial[2] = {scratch(0, bytes), scratch(3, bytes)};
  void* incoming = scratch(1, bytes);  // what it received last
  const size_t whole_input = op.buffer(send, bytes * static_cast<size_t>(n));
  const size_t out[2] = {op.buffer(partial[0], bytes), op.buffer(partial[1], bytes)};
  const size_t in = op.buffer(incoming, bytes);
  const int32_t next = wrap(r + 1, n), prev = wrap(r - 1, n);
  const size_t parts = segments_for(bytes);  // every step moves `count` elements
  const auto* in_bytes = static_cast<const uint8_t*>(incoming);
  for (int32_t s = 0; s < n - 1; ++s) {
    const int32_t send_index = wrap(r - s - 1, n), recv_index = wrap(r - s - 2, n);
    const uint32_t base = static_cast<uint32_t>(s) * kMaxSegments;
    for (size_t k = 0; k < parts; ++k) {
      const auto [b, e] = segment(count, parts, k);
      const uint64_t slot = op.slot(4, base + static_cast<uint32_t>(k));
      op.post_recv(in, prev, slot, b * element, (e - b) * element);
      if (s == 0) {
        op.post_send(whole_input, next, slot, static_cast<size_t>(send_index) * bytes + b * element,
                     (e - b) * element);
      } else {
        op.post_send(out[(s - 1) % 2], next, slot, b * element, (e - b) * element);
      }
    }
    const uint8_t* mine = input + static_cast<size_t>(recv_index) * bytes;
    // The last step lands chunk r in recv.
    auto* target = static_cast<uint8_t*>(s == n - 2 ? recv : partial[s % 2]);
    reduce_as_received(op, dtype, reduce_op, count, parts, target, in_bytes, mine);
    op.wait_all();  // the sends: partial[s % 2] is sent in the next step
  }
  if (reduce_op == ReduceOp::kAvg) finish_average(dtype, recv, count, n);
  return Status::Ok();
}

Status GlooCommunicator::halving_reduce_scatter(Op& op, const void* send, void* recv, size_t count,
                                                DType dtype, ReduceOp reduce_op) {
  // Recursive halving, for a power-of-two group: at distance d = n/2, n/4, .., 1 a rank
  // keeps the half of its current range of blocks that holds its own block, sends the
  // other half to rank ^ d and reduces what that rank sends back into the kept half.
  // log2(n) exchanges instead of the ring's n - 1, the same bytes (measured 4 % ahead of
  // the ring at 4 ranks, docs/benchmarks.md); scratch: two halves of the input.
  const int32_t n = size_, r = rank_;
  const size_t element = dtype_size(dtype);
  const size_t bytes = count * element;  // one block
  const size_t half = bytes * static_cast<size_t>(n / 2);
  const auto* input = static_cast<const uint8_t*>(send);
  // Partial sums keep the layout of the first kept half (block i at (i - base) * bytes), so
  // each later step reduces in place while the half it gives away is still being sent.
  auto* partial = static_cast<uint8_t*>(scratch(0, half));
  auto* incoming = static_cast<uint8_t*>(scratch(1, half));
  const size_t input_buffer = op.buffer(send, bytes * static_cast<size_t>(n));
  const size_t partial_buffer = op.buffer(partial, half);
  const size_t incoming_buffer = op.buffer(incoming, half);
  int32_t lo = 0, base = 0;
  uint32_t step = 0;
  for (int32_t d = n / 2; d >= 1; d /= 2, ++step) {
    const int32_t peer = r ^ d;
    const int32_t keep = (r & d) ? lo + d : lo, give = (r & d) ? lo : lo + d;
    if (step == 0) base = keep;
    const size_t elements = count * static_cast<size_t>(d);
    const size_t parts = segments_for(elements * element);
    const size_t from = step == 0 ? input_buffer : partial_buffer;
    const size_t from_offset = static_cast<size_t>(step == 0 ? give : give - base) * bytes;
    for (size_t k = 0; k < parts; ++k) {
      const auto [b, e] = segment(elements, parts, k);
      const uint64_t slot = op.slot(4, static_cast<uint32_t>(step * kMaxSegments + k));
      op.post_recv(incoming_buffer, peer, slot, b * element, (e - b) * element);
      op.post_send(from, peer, slot, from_offset + b * element, (e - b) * element);
    }
    const uint8_t* mine = step == 0 ? input + static_cast<size_t>(keep) * bytes
                                    : partial + static_cast<size_t>(keep - base) * bytes;
    uint8_t* target =
        d == 1 ? static_cast<uint8_t*>(recv) : partial + static_cast<size_t>(keep - base) * bytes;
    reduce_as_received(op, dtype, reduce_op, elements, parts, target, incoming, mine);
    op.wait_all();  // the sends, before the next step reuses `incoming`
    lo = keep;
  }
  if (reduce_op == ReduceOp::kAvg) finish_average(dtype, recv, count, n);
  return Status::Ok();
}

Status GlooCommunicator::tree_broadcast(Op& op, void* buffer, size_t bytes, int32_t root) {
  const int32_t n = size_;
  if (n == 1 || bytes == 0) return Status::Ok();
  const size_t b = op.buffer(buffer, bytes);
  // A binomial tree over ranks renumbered from the root (v): v's parent is v without its
  // highest bit, its children v + 2^i for every 2^i > v (the smallest 2^i heads the
  // largest subtree, so it is served first). The root
  // sends log2(n) copies instead of n - 1, and an inner rank forwards each segment as
  // soon as it has arrived.
  const int32_t v = wrap(rank_ - root, n);
  int32_t high = 1;
  while (high <= v / 2) high <<= 1;  // v's highest bit (v > 0)
  std::vector<int32_t> children;
  for (int32_t mask = 1; mask < n; mask <<= 1) {
    if (v < mask && v + mask < n) children.push_back(wrap(v + mask + root, n));
  }
  const size_t parts = segments_for(bytes, kMinCopySegmentBytes);
  if (v != 0) {
    const int32_t parent = wrap((v - high) + root, n);
    for (size_t k = 0; k < parts; ++k) {
      const auto [begin, end] = segment(bytes, parts, k);
      op.post_recv(b, parent, op.slot(5, static_cast<uint32_t>(k)), begin, end - begin);
    }
  }
  for (size_t k = 0; k < parts; ++k) {
    const auto [begin, end] = segment(bytes, parts, k);
    if (v != 0 && end > begin) op.wait_next_recv();
    for (int32_t child : children) {
      op.post_send(b, child, op.slot(5, static_cast<uint32_t>(k)), begin, end - begin);
    }
  }
  op.wait_all();
  return Status::Ok();
}

StatusOr<std::shared_ptr<Work>> GlooCommunicator::enqueue_point_to_point(
    std::string operation, Stream* ready, uint64_t slot_base, uint64_t bytes, uint64_t number,
    std::function<void(Op&)> post) {
  // A send completes only once the peer has posted the matching receive. Waiting on the
  // stream would deadlock two ranks that each send before they receive, so the stream
  // only posts the transfer and the waiter thread completes it (NCCL's group semantics).
  auto work_or = enqueue(operation, ready, nullptr, 0, [](Op&) { return Status::Ok(); });
  if (!work_or.ok()) return work_or.status();
  // The placeholder above did the shared checks and the ready-stream wait; replace its
  // completion with a detached mark completed by the waiter.
  auto work = std::move(work_or).value();
  auto mark = static_cast<cpu::CpuEvent&>(work->done_event()).record_detached();
  stream_->enqueue([this, work, mark, operation = std::move(operation), slot_base, bytes, number,
                    post = std::move(post)] {
    try {
      if (trace::enabled()) trace::collective(operation, bytes, options_.name, number);
      auto op = std::make_shared<Op>(*this, operation, 0, slot_base, Clock::now() + timeout());
      Status s = guarded(*op, [&] {
        post(*op);
        return Status::Ok();
      });
      std::lock_guard lock(waiter_mutex_);
      waiting_.push_back({op, work, mark, s});
      ++transfers_posted_;
      waiter_cv_.notify_one();
    } catch (...) {
      end_work(*work, aborted(where(operation, 0) + ": " + describe_exception()));
      mark->complete();
    }
  });
  return work;
}

void GlooCommunicator::complete_transfers() {
  std::unique_lock lock(waiter_mutex_);
  for (;;) {
    waiter_cv_.wait(lock, [&] { return stopping_ || !waiting_.empty(); });
    if (waiting_.empty()) return;
    PendingTransfer t = std::move(waiting_.front());
    waiting_.pop_front();
    lock.unlock();
    Status s = t.posted;
    try {
      if (s.ok()) {
        s = guarded(*t.op, [&] {
          t.op->wait_all();
          return Status::Ok();
        });
      }
    } catch (...) {
      s = aborted(where(t.op->operation, 0) + ": " + describe_exception());
    }
    end_work(*t.work, std::move(s));
    t.op.reset();
    t.mark->complete();
    lock.lock();
    ++transfers_completed_;
    transfer_done_cv_.notify_all();
  }
}

Status GlooCommunicator::finish() {
  // The stream has posted the transfers enqueued so far; the waiter completes them.
  HPS_RETURN_IF_ERROR(Communicator::finish());
  std::unique_lock lock(waiter_mutex_);
  const uint64_t posted = transfers_posted_;
  transfer_done_cv_.wait(lock, [&] { return transfers_completed_ >= posted; });
  return Status::Ok();
}

// ---- public operations: check arguments on the caller's thread, then enqueue ----

GlooCommunicator::Descriptor GlooCommunicator::next_descriptor(CollectiveKind kind, DType dtype,
                                                               ReduceOp op, int32_t root,
                                                               size_t count, uint64_t tag) {
  return Descriptor{
      kind, static_cast<int32_t>(dtype), static_cast<int32_t>(op), root, count, next_sequence_++,
      tag};
}

StatusOr<std::shared_ptr<Work>> GlooCommunicator::all_reduce(const void* send, void* recv,
                                                             size_t count, DType dtype, ReduceOp op,
                                                             Stream* ready, uint64_t tag) {
  const CommArgs a{"all_reduce", options_.name, size_};
  HPS_RETURN_IF_ERROR(check_reduce_buffers(a, send, recv, count, dtype, true));
  Descriptor d = next_descriptor(kAllReduceKind, dtype, op, 0, count, tag);
  return enqueue("all_reduce", ready, &d, collective_slot_base(d),
                 [this, send, recv, count, dtype, op](Op& o) {
                   if (shm_) {
                     return located(o, shm_->all_reduce(*o.descriptor, o.deadline(), send, recv,
                                                        count, dtype, op));
                   }
                   return tcp_all_reduce(o, send, recv, count, dtype, op);
                 });
}

StatusOr<std::shared_ptr<Work>> GlooCommunicator::reduce(const void* send, void* recv, size_t count,
                                                         DType dtype, ReduceOp op, int32_t root,
                                                         Stream* ready) {
  const CommArgs a{"reduce", options_.name, size_};
  HPS_RETURN_IF_ERROR(check_rank_in_group(a, "root", root));
  HPS_RETURN_IF_ERROR(check_reduce_buffers(a, send, recv, count, dtype, rank_ == root));
  Descriptor d = next_descriptor(kReduceKind, dtype, op, root, count, 0);
  return enqueue(
      "reduce", ready, &d, collective_slot_base(d),
      [this, send, recv, count, dtype, op, root](Op& o) {
        // A ring all-reduce into scratch; the root keeps the result.
        const size_t bytes = count * dtype_size(dtype);
        void* work_buffer = scratch(2, bytes);
        if (shm_) {
          HPS_RETURN_IF_ERROR(located(o, shm_->all_reduce(*o.descriptor, o.deadline(), send,
                                                          work_buffer, count, dtype, op)));
        } else {
          HPS_RETURN_IF_ERROR(tcp_all_reduce(o, send, work_buffer, count, dtype, op));
        }
        if (rank_ == root) std::memcpy(recv, work_buffer, bytes);
        return Status::Ok();
      });
}

StatusOr<std::shared_ptr<Work>> GlooCommunicator::broadcast(void* buffer, size_t count, DType dtype,
                                                            int32_t root, Stream* ready) {
  const CommArgs a{"broadcast", options_.name, size_};
  HPS_RETURN_IF_ERROR(check_rank_in_group(a, "root", root));
  HPS_RETURN_IF_ERROR(check_buffer(a, "buffer", buffer, count, dtype));
  Descriptor d = next_descriptor(kBroadcastKind, dtype, ReduceOp::kSum, root, count, 0);
  return enqueue(
      "broadcast", ready, &d, collective_slot_base(d), [this, buffer, count, dtype, root](Op& o) {
        const size_t bytes = count * dtype_size(dtype);
        if (shm_) {
          return located(o, shm_->broadcast(*o.descriptor, o.deadline(), buffer, bytes, root));
        }
        return tree_broadcast(o, buffer, bytes, root);
      });
}

StatusOr<std::shared_ptr<Work>> GlooCommunicator::all_gather(const void* send, void* recv,
                                                             size_t count, DType dtype,
                                                             Stream* ready, uint64_t tag) {
  const CommArgs a{"all_gather", options_.name, size_};
  HPS_RETURN_IF_ERROR(check_all_gather_buffers(a, rank_, send, recv, count, dtype));
  Descriptor d = next_descriptor(kAllGatherKind, dtype, ReduceOp::kSum, 0, count, tag);
  return enqueue(
      "all_gather", ready, &d, collective_slot_base(d), [this, send, recv, count, dtype](Op& o) {
        const size_t bytes = count * dtype_size(dtype);
        if (shm_) {
          return located(o, shm_->all_gather(*o.descriptor, o.deadline(), send, recv, bytes));
        }
        auto* own = static_cast<uint8_t*>(recv) + static_cast<size_t>(rank_) * bytes;
        if (own != send && bytes) std::memcpy(own, send, bytes);
        return ring_all_gather(o, recv, bytes, kAllGatherPhase);
      });
}

StatusOr<std::shared_ptr<Work>> GlooCommunicator::reduce_scatter(const void* send, void* recv,
                                                                 size_t count, DType dtype,
                                                                 ReduceOp op, Stream* ready,
                                                                 uint64_t tag) {
  const CommArgs a{"reduce_scatter", options_.name, size_};
  HPS_RETURN_IF_ERROR(check_reduce_scatter_buffers(a, rank_, send, recv, count, dtype));
  Descriptor d = next_descriptor(kReduceScatterKind, dtype, op, 0, count, tag);
  return enqueue("reduce_scatter", ready, &d, collective_slot_base(d),
                 [this, send, recv, count, dtype, op](Op& o) {
                   if (shm_) {
                     return located(o, shm_->reduce_scatter(*o.descriptor, o.deadline(), send, recv,
                                                            count, dtype, op));
                   }
                   return tcp_reduce_scatter(o, send, recv, count, dtype, op);
                 });
}

namespace {

// "send #3 to rank 1": the operation with its number among this rank's messages to (or
// from) that peer, counted from 1 as collectives are.
std::string p2p_name(const char* operation, uint64_t number, const char* direction, int32_t peer,
                     const RankNames& names) {
  return std::string(operation) + " #" + std::to_string(number + 1) + " " + direction + " " +
         names(peer);
}

}  // namespace

StatusOr<std::shared_ptr<Work>> GlooCommunicator::send(const void* buffer, size_t count,
                                                       DType dtype, int32_t peer, Stream* ready) {
  return point_to_point(true, buffer, count, dtype, peer, ready);
}

StatusOr<std::shared_ptr<Work>> GlooCommunicator::recv(void* buffer, size_t count, DType dtype,
                                                       int32_t peer, Stream* ready) {
  return point_to_point(false, buffer, count, dtype, peer, ready);
}

StatusOr<std::shared_ptr<Work>> GlooCommunicator::point_to_point(bool sending, const void* buffer,
                                                                 size_t count, DType dtype,
                                                                 int32_t peer, Stream* ready) {
  const char* operation = sending ? "send" : "recv";
  const char* direction = sending ? "to" : "from";
  const CommArgs a{operation, options_.name, size_};
  HPS_RETURN_IF_ERROR(check_rank_in_group(a, "peer", peer));
  if (peer == rank_) {
    return invalid_argument(std::string(operation) + " on group '" + options_.name +
                            "': " + direction + " itself");
  }
  HPS_RETURN_IF_ERROR(check_buffer(a, "buffer", buffer, count, dtype));
  const uint64_t number = (sending ? sent_ : received_)[peer]++;
  const uint64_t slot = transfer_slot_base(number, count * dtype_size(dtype));
  return enqueue_point_to_point(p2p_name(operation, number, direction, peer, rank_names()), ready,
                                slot, count * dtype_size(dtype), number + 1,
                                [sending, buffer, count, dtype, peer](Op& o) {
                                  const size_t bytes = count * dtype_size(dtype);
                                  const size_t b = o.buffer(buffer, bytes);
                                  if (sending) {
                                    o.post_send(b, peer, o.slot(6, 0), 0, bytes);
                                  } else {
                                    o.post_recv(b, peer, o.slot(6, 0), 0, bytes);
                                  }
                                });
}

StatusOr<std::shared_ptr<Work>> GlooCommunicator::barrier(Stream* ready) {
  Descriptor d = next_descriptor(kBarrierKind, static_cast<DType>(0), ReduceOp::kSum, 0, 0, 0);
  return enqueue("barrier", ready, &d, collective_slot_base(d), [this](Op& o) {
    if (shm_) return located(o, shm_->barrier(*o.descriptor, o.deadline()));
    // The descriptors were posted when each rank enqueued, not when its stream got here,
    // so one byte per rank goes round the ring as well.
    auto* tokens = static_cast<uint8_t*>(scratch(3, static_cast<size_t>(size_)));
    tokens[rank_] = 1;
    return ring_all_gather(o, tokens, 1, kAllGatherPhase);
  });
}

StatusOr<std::unique_ptr<Communicator>> GlooCommunicator::split_group(
    const std::vector<int32_t>& ranks, std::string name, std::vector<int32_t> world_ranks) {
  const uint64_t index = next_split_++;
  auto position = std::find(ranks.begin(), ranks.end(), rank_);
  if (position == ranks.end()) return std::unique_ptr<Communicator>();
  CommOptions child = options_;
  child.name = std::move(name);
  child.timeout = timeout();
  child.world_ranks = std::move(world_ranks);
  auto split_store = make_prefix_store(store_, "split" + std::to_string(index));
  auto alive = [this](const std::vector<int32_t>& members) -> Status {
    if (shm_) HPS_RETURN_IF_ERROR(shm_->check_peers_alive(members));
    if (control_) HPS_RETURN_IF_ERROR(control_->check_peers_alive(members));
    return Status::Ok();
  };
  // The members meet through the store: a member that died would be waited for until the
  // timeout. While the split is made, this group tells, and an abort of it ends the wait.
  // A member that has made its side of the split may leave this group at once (it needs
  // nothing more of it): only the members still making theirs are waited for in vain.
  auto child_store =
      std::make_shared<WatchedStore>(split_store, [this, ranks, split_store, alive]() -> Status {
        if (aborted_) {
          return aborted("split of group '" + options_.name + "': the group was aborted");
        }
        if (alive(ranks).ok()) return Status::Ok();
        // A member is seen gone first, then its mark is read: it marks before it leaves, so
        // one gone with no mark had not made its side. (Marks read before the liveness could
        // miss a member that marked and left in between.)
        for (const int32_t q : ranks) {
          const Status gone = alive({q});
          if (!gone.ok() && !is_made(*split_store, q)) return gone;
        }
        return Status::Ok();
      });
  auto made = create(child_store, static_cast<int32_t>(position - ranks.begin()),
                     static_cast<int32_t>(ranks.size()), child);
  child_store->stop_watching();
  if (made.ok()) HPS_RETURN_IF_ERROR(mark_made(*split_store, rank_));
  return made;
}

}  // namespace hps::gloo_backend
