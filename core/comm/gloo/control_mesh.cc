#include "core/comm/gloo/control_mesh.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <thread>
#include <utility>

#include "core/comm/auth.h"
#include "core/comm/peer_failure.h"
#include "core/comm/socket.h"
#include "core/common/logging.h"

namespace hps::gloo_backend {
namespace {

using net::Clock;

// Each rank publishes "host:port nonce" under control/<rank>. A connecting rank proves it
// read the store (the job's, which strangers cannot) by sending the listener's nonce with its
// rank; the listener answers with the connecting rank's nonce, proving the same. Anything
// else that connects is closed without costing the job more than kHandshakeTimeout.
constexpr size_t kNonceBytes = 16;
constexpr Milliseconds kHandshakeTimeout{5'000};
using Nonce = std::array<uint8_t, kNonceBytes>;

std::string address_key(int32_t rank) { return "control/" + std::to_string(rank); }

// A frame's header: its kind and the bytes that follow, in host order (the ranks' hosts share
// a byte order: their descriptors are exchanged raw too).
constexpr size_t kHeadBytes = 8;
constexpr uint32_t kMessageFrame = 0x316d7068;  // "hpm1": a posted message
constexpr uint32_t kFailedFrame = 0x31667068;   // "hpf1": the sender failed; why follows
constexpr uint32_t kAbortedFrame = 0x31617068;  // "hpa1": the sender aborted the group
// What farewell() reads past at most: the messages of this many collectives, each no longer
// than this (a descriptor is 40 bytes).
constexpr int kMaxSkippedFrames = 1 << 16;
constexpr uint32_t kMaxMessageBytes = 4096;

void put_head(char* at, uint32_t kind, uint32_t bytes) {
  std::memcpy(at, &kind, 4);
  std::memcpy(at + 4, &bytes, 4);
}

std::pair<uint32_t, uint32_t> head_of(const char* at) {
  uint32_t kind = 0, bytes = 0;
  std::memcpy(&kind, at, 4);
  std::memcpy(&bytes, at + 4, 4);
  return {kind, bytes};
}

// What a recv() that returned `r` says of its connection: ended (closed, or an error that
// is not a retry), and the survivor's error then (errno as recv() left it).
bool connection_ended(ssize_t r) {
  return r == 0 || (r < 0 && errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK);
}
Status ended_connection(const std::string& peer, ssize_t r) {
  return aborted(peer + " closed its control connection (" +
                 (r == 0 ? std::string("it failed or aborted the group, or exited")
                         : net::errno_message(errno)) +
                 ")");
}

bool is_farewell(uint32_t kind) { return kind == kFailedFrame || kind == kAbortedFrame; }

std::string farewell_text(const std::string& peer, uint32_t kind, std::string_view reason) {
  return kind == kFailedFrame ? peer_failed_text(peer, reason_received(reason))
                              : peer_aborted_text(peer);
}

int poll_timeout_ms(Clock::time_point deadline) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count() + 1;
  return static_cast<int>(std::clamp<int64_t>(left, 0, 1'000'000));
}

std::string to_hex(const Nonce& nonce) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (uint8_t b : nonce) {
    out += kHex[b >> 4];
    out += kHex[b & 0xF];
  }
  return out;
}

bool from_hex(std::string_view text, Nonce* nonce) {
  if (text.size() != 2 * kNonceBytes) return false;
  auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  for (size_t i = 0; i < kNonceBytes; ++i) {
    const int hi = digit(text[2 * i]), lo = digit(text[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    (*nonce)[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return true;
}

// Splits "host:port nonce" (the host may be "[v6]").
bool parse_address(const std::string& text, std::string* host, uint16_t* port, Nonce* nonce) {
  const size_t space = text.find(' ');
  if (space == std::string::npos || !from_hex(std::string_view(text).substr(space + 1), nonce)) {
    return false;
  }
  const std::string address = text.substr(0, space);
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return false;
  *host = address.substr(0, colon);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') {
    *host = host->substr(1, host->size() - 2);
  }
  uint32_t value = 0;
  const std::string digits = address.substr(colon + 1);
  auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (error != std::errc() || end != digits.data() + digits.size() || value == 0 || value > 65535) {
    return false;
  }
  *port = static_cast<uint16_t>(value);
  return true;
}

std::string_view bytes_of(const Nonce& nonce) {
  return {reinterpret_cast<const char*>(nonce.data()), nonce.size()};
}

}  // namespace

ControlMesh::ControlMesh(int32_t rank, int32_t size, RankNames names)
    : rank_(rank),
      size_(size),
      names_(std::move(names)),
      sockets_(static_cast<size_t>(size), -1),
      farewells_(static_cast<size_t>(size)),
      heads_(static_cast<size_t>(size)),
      torn_(static_cast<size_t>(size)) {}

ControlMesh::~ControlMesh() {
  for (int fd : sockets_) net::close_fd(fd);
  net::close_fd(wake_fd_);
}

StatusOr<std::unique_ptr<ControlMesh>> ControlMesh::create(Store& store, int32_t rank, int32_t size,
                                                           const std::string& host,
                                                           Clock::time_point deadline,
                                                           const std::function<Status()>& still_ok,
                                                           RankNames names) {
  std::unique_ptr<ControlMesh> mesh(new ControlMesh(rank, size, std::move(names)));
  const RankNames& name = mesh->names_;
  mesh->wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (mesh->wake_fd_ < 0) return backend_error("eventfd: " + net::errno_message(errno));
  if (size == 1) return mesh;
  HPS_ASSIGN_OR_RETURN(auto listener, net::listen_on(host, 0, size));
  struct Closer {
    int fd;
    ~Closer() { net::close_fd(fd); }
  } listening{listener.fd};
  Nonce mine{};
  HPS_RETURN_IF_ERROR(auth::random_bytes(mine.data(), mine.size()));
  HPS_RETURN_IF_ERROR(
      store.set(address_key(rank), net::endpoint(host, listener.port) + " " + to_hex(mine)));

  // Connect to every lower rank (its listen backlog completes the connection before it
  // accepts), proving this rank's number; then accept every higher one.
  for (int32_t peer = 0; peer < rank; ++peer) {
    const auto left = std::chrono::duration_cast<Milliseconds>(deadline - Clock::now());
    HPS_ASSIGN_OR_RETURN(std::string address,
                         store.get(address_key(peer), std::max(left, Milliseconds(1))));
    std::string peer_host;
    uint16_t port = 0;
    Nonce theirs{};
    if (!parse_address(address, &peer_host, &port, &theirs)) {
      return backend_error("control connection: " + name(peer) +
                           " published a malformed address '" + address + "'");
    }
    auto fd = net::connect_once(peer_host, port, deadline);
    if (!fd.ok()) {
      return Status(fd.status().code(), "control connection to " + name(peer) + " at " + address +
                                            ": " + fd.status().message());
    }
    mesh->sockets_[static_cast<size_t>(peer)] = *fd;
    char hello[4 + kNonceBytes];
    for (int i = 0; i < 4; ++i)
      hello[i] = static_cast<char>(static_cast<uint32_t>(rank) >> (24 - 8 * i));
    std::memcpy(hello + 4, theirs.data(), kNonceBytes);
    HPS_RETURN_IF_ERROR(net::send_all(*fd, std::string_view(hello, sizeof hello), deadline));
    Nonce answer{};
    Status s = net::recv_all(*fd, reinterpret_cast<char*>(answer.data()), answer.size(), deadline);
    if (!s.ok()) {  // no answer at all: the peer went (or timed out), not an impostor
      return Status(s.code() == StatusCode::kTimeout ? s.code() : StatusCode::kAborted,
                    "control connection to " + name(peer) + " at " + address +
                        ": no answer to this rank's hello (did it exit or fail?): " + s.message());
    }
    if (!auth::equal_secrets(answer.data(), mine.data(), kNonceBytes)) {
      return aborted("control connection to " + name(peer) + " at " + address +
                     ": the peer did not prove it belongs to this group (wrong answer)");
    }
  }
  for (int32_t accepted = rank + 1; accepted < size;) {
    bool readable = false;
    while (!readable && Clock::now() < deadline) {
      readable = net::poll_until(listener.fd, POLLIN,
                                 std::min(deadline, Clock::now() + std::chrono::milliseconds(100)));
      if (!readable && still_ok) HPS_RETURN_IF_ERROR(still_ok());
    }
    if (!readable) {
      return timeout_error("control connections: " + name(rank) + " accepted " +
                           std::to_string(accepted - rank - 1) + " of the " +
                           std::to_string(size - rank - 1) + " higher ranks before the timeout");
    }
    const int fd = ::accept4(listener.fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == ECONNABORTED) continue;
      return backend_error("control connections: accept: " + net::errno_message(errno));
    }
    net::set_no_delay(fd);
    const auto handshake_deadline = std::min(deadline, Clock::now() + kHandshakeTimeout);
    char hello[4 + kNonceBytes];
    Status s = net::recv_all(fd, hello, sizeof hello, handshake_deadline);
    int32_t peer = -1;
    if (s.ok()) {
      uint32_t raw = 0;
      for (int i = 0; i < 4; ++i) raw = raw << 8 | static_cast<uint8_t>(hello[i]);
      peer = static_cast<int32_t>(raw);
    }
    std::string why;
    if (!s.ok()) {
      why = s.message();
    } else if (!auth::equal_secrets(hello + 4, mine.data(), kNonceBytes)) {
      why = "it does not know this rank's nonce";
    } else if (peer <= rank || peer >= size || mesh->sockets_[static_cast<size_t>(peer)] >= 0) {
      why = "it claims rank " + std::to_string(peer);
    }
    std::string their_address;
    Nonce theirs{};
    if (why.empty()) {
      // It knew this rank's nonce, so it read the store after publishing its own address: the
      // address is there, and a store slow to answer (its server paused) only delays it, up
      // to the mesh's deadline (a stranger never gets here: the handshake's bound is for it).
      const auto left = std::chrono::duration_cast<Milliseconds>(deadline - Clock::now());
      auto published = store.get(address_key(peer), std::max(left, Milliseconds(1)));
      std::string ignored_host;
      uint16_t ignored_port = 0;
      if (!published.ok()) {
        why = "its published address could not be read: " + published.status().message();
      } else if (!parse_address(*published, &ignored_host, &ignored_port, &theirs)) {
        why = name(peer) + " published a malformed address";
      }
    }
    if (why.empty()) {
      s = net::send_all(fd, bytes_of(theirs), deadline);
      if (!s.ok()) why = s.message();
    }
    if (!why.empty()) {
      // Not a rank of this group (or one that gave up): close it and keep waiting.
      HPS_LOG(kWarn) << "control connections: rank " << rank
                     << " closed a connection that is not a peer of its group (" << why << ")";
      net::close_fd(fd);
      continue;
    }
    mesh->sockets_[static_cast<size_t>(peer)] = fd;
    ++accepted;
  }
  return mesh;
}

Status ControlMesh::post(const void* mine, size_t bytes, Clock::time_point deadline) {
  if (aborted_) return aborted("the communicator was aborted");
  if (bytes > kMaxMessageBytes) {
    return invalid_argument("control connections: a message of " + std::to_string(bytes) +
                            " bytes (at most " + std::to_string(kMaxMessageBytes) + ")");
  }
  std::lock_guard lock(send_mutex_);
  frame_.resize(kHeadBytes + bytes);
  put_head(frame_.data(), kMessageFrame, static_cast<uint32_t>(bytes));
  std::memcpy(frame_.data() + kHeadBytes, mine, bytes);
  const std::string_view message(frame_.data(), frame_.size());
  for (int32_t peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    Status s = net::send_all(sockets_[static_cast<size_t>(peer)], message, deadline);
    if (!s.ok()) {
      if (aborted_) return aborted("the communicator was aborted");  // this rank's own end
      // A peer that ended the group said why before it closed (read unless a collect()
      // is reading: it will find it).
      if (auto said = farewell(peer, Clock::now() + std::chrono::milliseconds(250))) {
        return aborted(*said);
      }
      return aborted("the control connection to " + names_(peer) +
                     " failed (did it exit?): " + s.message());
    }
  }
  return Status::Ok();
}

void ControlMesh::watch_processes(const std::vector<std::optional<host::Process>>& processes) {
  watched_.assign(static_cast<size_t>(size_), std::nullopt);
  for (size_t r = 0; r < processes.size() && r < watched_.size(); ++r) {
    if (static_cast<int32_t>(r) != rank_ && processes[r] && processes[r]->on_this_host()) {
      watched_[r] = processes[r];
    }
  }
  if (std::none_of(watched_.begin(), watched_.end(), [](const auto& p) { return p.has_value(); })) {
    watched_.clear();
  }
}

Status ControlMesh::collect(void* all, size_t bytes, Clock::time_point deadline) {
  if (aborted_) return aborted("the communicator was aborted");
  // A missing peer of this host is looked at every kCheck; ended for kGrace, it fails this.
  constexpr std::chrono::milliseconds kCheck{200}, kGrace{1000};
  auto next_check = Clock::now() + kCheck;
  std::vector<std::optional<Clock::time_point>> ended_at(watched_.size());
  // Read every peer's message as it comes, waking on abort().
  // Per-call state in members reused across collectives (one collect() at a time).
  std::lock_guard reading(read_mutex_);
  const size_t frame = kHeadBytes + bytes;
  std::vector<size_t>& got = got_;
  got.assign(static_cast<size_t>(size_), 0);
  got[static_cast<size_t>(rank_)] = frame;
  // Returning before every frame came leaves peers within one.
  struct Torn {
    std::vector<size_t>& got;
    std::vector<uint8_t>& torn;
    size_t frame;
    ~Torn() {
      for (size_t p = 0; p < got.size(); ++p) torn[p] |= got[p] > 0 && got[p] < frame;
    }
  } torn{got, torn_, frame};
  int32_t missing = size_ - 1;
  std::vector<pollfd>& fds = poll_fds_;
  std::vector<int32_t>& peers = poll_peers_;
  // The peers whose frame came are watched too, until their next one begins: a farewell
  // there (or the connection's end) means this collective cannot complete, as the late
  // rank's may not come before the deadline.
  std::vector<uint8_t>& ahead = ahead_;
  ahead.assign(static_cast<size_t>(size_), 0);
  ahead[static_cast<size_t>(rank_)] = 1;
  // A peer that ended so: the ranks still missing get a moment more (their messages are
  // most likely on the way: a disagreement is then found here too, and named), then its
  // end is this collect()'s.
  constexpr std::chrono::milliseconds kEndedGrace{250};
  std::optional<Status> ended;
  auto until = deadline;
  while (missing > 0) {
    fds.clear();
    peers.clear();
    for (int32_t peer = 0; peer < size_; ++peer) {
      if (got[static_cast<size_t>(peer)] < frame || !ahead[static_cast<size_t>(peer)]) {
        fds.push_back({sockets_[static_cast<size_t>(peer)], POLLIN, 0});
        peers.push_back(peer);
      }
    }
    fds.push_back({wake_fd_, POLLIN, 0});
    int timeout_ms = poll_timeout_ms(until);
    if (!watched_.empty()) timeout_ms = std::min<int>(timeout_ms, kCheck.count());
    const int n = ::poll(fds.data(), fds.size(), timeout_ms);
    if (aborted_) return aborted("the communicator was aborted");
    if (n < 0) {
      if (errno == EINTR) continue;
      return backend_error("control connections: poll: " + net::errno_message(errno));
    }
    if (ended && Clock::now() >= until) return *ended;
    if (n == 0 && Clock::now() >= deadline) {
      std::vector<int32_t> who;
      for (int32_t peer : peers) {
        if (got[static_cast<size_t>(peer)] == frame) continue;  // watched, not waited for
        who.push_back(peer);
      }
      return timeout_error("no word from " + names_.list(who) +
                           " (a peer is missing or called a different operation)");
    }
    for (size_t i = 0; i < peers.size(); ++i) {
      if (fds[i].revents == 0) continue;
      const size_t peer = static_cast<size_t>(peers[i]);
      size_t& g = got[peer];
      if (g == frame) {
        Status next = check_next_frame(peers[i], deadline, &ahead[peer]);
        if (!next.ok()) {
          ahead[peer] = 1;  // watched no more
          if (!ended) {
            ended = std::move(next);
            until = std::min(deadline, Clock::now() + kEndedGrace);
          }
        }
        continue;
      }
      auto* into = static_cast<char*>(all) + peer * bytes;
      const bool head = g < kHeadBytes;
      const ssize_t r = head ? ::recv(fds[i].fd, heads_[peer].data() + g, kHeadBytes - g, 0)
                             : ::recv(fds[i].fd, into + (g - kHeadBytes), frame - g, 0);
      if (connection_ended(r)) return ended_connection(names_(peers[i]), r);
      if (r <= 0) continue;
      g += static_cast<size_t>(r);
      if (head && g == kHeadBytes) {
        const auto [kind, length] = head_of(heads_[peer].data());
        if (is_farewell(kind)) {
          g = 0;  // the farewell is read whole below: no frame is left torn
          return aborted(read_farewell(peers[i], kind, length, deadline));
        }
        if (kind != kMessageFrame || length != bytes) {
          return aborted(names_(static_cast<int32_t>(peer)) +
                         " sent a control message this rank cannot read (a frame of kind " +
                         std::to_string(kind) + " and " + std::to_string(length) + " bytes, " +
                         std::to_string(bytes) + " expected): do the ranks run one hpshard?");
        }
      }
      if (g == frame) --missing;
    }
    const auto now = Clock::now();
    if (watched_.empty() || now < next_check) continue;
    next_check = now + kCheck;
    for (const int32_t peer : peers) {
      const auto& process = watched_[static_cast<size_t>(peer)];
      if (got[static_cast<size_t>(peer)] == frame || !process ||
          host::process_running(process->pid, process->start)) {
        continue;
      }
      auto& since = ended_at[static_cast<size_t>(peer)];
      if (!since) since = now;
      if (now - *since >= kGrace) {
        return aborted(names_(peer, process->describe()) +
                       " has ended while this rank waited for its word (a process it forked "
                       "may hold its control connection open)");
      }
    }
  }
  return Status::Ok();
}

Status ControlMesh::check_next_frame(int32_t peer, Clock::time_point deadline, uint8_t* ahead) {
  const int fd = sockets_[static_cast<size_t>(peer)];
  std::array<char, kHeadBytes> next{};
  const ssize_t n = ::recv(fd, next.data(), next.size(), MSG_PEEK | MSG_DONTWAIT);
  if (connection_ended(n)) return ended_connection(names_(peer), n);
  if (n < static_cast<ssize_t>(kHeadBytes)) {
    if (n > 0) *ahead = 1;  // a frame begins: the next collect() reads it
    return Status::Ok();
  }
  const auto [kind, bytes] = head_of(next.data());
  if (!is_farewell(kind)) {
    *ahead = 1;
    return Status::Ok();
  }
  (void)::recv(fd, next.data(), next.size(), MSG_DONTWAIT);  // the header peeked at
  return aborted(read_farewell(peer, kind, bytes, deadline));
}

std::string ControlMesh::read_farewell(int32_t peer, uint32_t kind, uint32_t bytes,
                                       Clock::time_point deadline) {
  std::string reason;
  if (kind == kFailedFrame && bytes <= kPeerReasonBytes) {
    reason.resize(bytes);
    const auto by = std::min(deadline, Clock::now() + std::chrono::seconds(1));
    if (!net::recv_all(sockets_[static_cast<size_t>(peer)], reason.data(), bytes, by).ok()) {
      reason.clear();  // the rank is named without its message
    }
  }
  std::string said = farewell_text(names_(peer), kind, reason);
  farewells_[static_cast<size_t>(peer)] = said;
  return said;
}

std::optional<std::string> ControlMesh::farewell(int32_t peer, Clock::time_point deadline) {
  if (peer < 0 || peer >= size_ || peer == rank_ || aborted_) return std::nullopt;
  // Tried until the deadline, not a timed lock (thread sanitizers miss its lock and report
  // its unlock).
  std::unique_lock reading(read_mutex_, std::defer_lock);
  while (!reading.try_lock()) {
    if (Clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (farewells_[static_cast<size_t>(peer)]) return farewells_[static_cast<size_t>(peer)];
  if (torn_[static_cast<size_t>(peer)]) return std::nullopt;
  const int fd = sockets_[static_cast<size_t>(peer)];
  std::array<char, kHeadBytes> head{};
  std::vector<char> skipped;
  for (int frames = 0; frames < kMaxSkippedFrames; ++frames) {
    if (!net::recv_all(fd, head.data(), kHeadBytes, deadline).ok()) return std::nullopt;
    const auto [kind, bytes] = head_of(head.data());
    if (is_farewell(kind)) return read_farewell(peer, kind, bytes, deadline);
    if (kind != kMessageFrame || bytes > kMaxMessageBytes) return std::nullopt;
    skipped.resize(bytes);
    if (!net::recv_all(fd, skipped.data(), bytes, deadline).ok()) return std::nullopt;
  }
  return std::nullopt;
}

Status ControlMesh::check_peers_alive(const std::vector<int32_t>& peers) const {
  for (const int32_t q : peers) {
    if (q < 0 || q >= size_) continue;
    const int fd = sockets_[static_cast<size_t>(q)];
    if (fd < 0) continue;
    // A farewell at the head of what is unread: the peer ended the group.
    std::array<char, kHeadBytes + kPeerReasonBytes> unread{};
    ssize_t n;
    do {
      n = ::recv(fd, unread.data(), unread.size(), MSG_PEEK | MSG_DONTWAIT);
    } while (n < 0 && errno == EINTR);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) {
      return aborted(names_(q) + " closed its control connection");
    }
    if (n >= static_cast<ssize_t>(kHeadBytes)) {
      const auto [kind, bytes] = head_of(unread.data());
      if (is_farewell(kind)) {
        const size_t have = static_cast<size_t>(n) - kHeadBytes;
        const std::string_view reason =
            bytes <= have ? std::string_view(unread.data() + kHeadBytes, bytes) : "";
        return aborted(farewell_text(names_(q), kind, reason));
      }
    }
  }
  return Status::Ok();
}

Status ControlMesh::check_peer_ended(int32_t peer) const {
  if (peer < 0 || peer >= size_ || peer == rank_ || aborted_) return Status::Ok();
  const int fd = sockets_[static_cast<size_t>(peer)];
  if (fd < 0) return Status::Ok();
  pollfd p{fd, POLLRDHUP, 0};
  int n;
  do {
    n = ::poll(&p, 1, 0);
  } while (n < 0 && errno == EINTR);
  if (n <= 0 || (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) == 0) return Status::Ok();
  return ended_connection(names_(peer), 0);
}

void ControlMesh::abort() { end(kAbortedFrame, {}); }

void ControlMesh::fail(std::string_view reason) { end(kFailedFrame, reason); }

void ControlMesh::end(uint32_t kind, std::string_view reason) {
  if (aborted_.exchange(true)) return;  // the first end says why
  const uint64_t one = 1;
  while (::write(wake_fd_, &one, sizeof one) < 0 && errno == EINTR) {
  }
  // The farewell, where no post() is writing (its frame would be cut): queued in each
  // socket without waiting (a peer that reads nothing gets none), ahead of the shutdown's end.
  std::unique_lock writing(send_mutex_, std::try_to_lock);
  if (writing.owns_lock()) {
    const std::string why = kind == kFailedFrame ? reason_to_send(reason) : std::string();
    std::string frame(kHeadBytes, '\0');
    put_head(frame.data(), kind, static_cast<uint32_t>(why.size()));
    frame += why;
    for (const int fd : sockets_) {
      if (fd >= 0) (void)::send(fd, frame.data(), frame.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    }
  }
  // The peers learn it at once, as they would of a rank that died: each connection ends
  // (its descriptor stays open until the destructor), so a peer's collect() or
  // check_peers_alive() finds it ended instead of waiting for this rank until its timeout.
  for (const int fd : sockets_) {
    if (fd >= 0) (void)::shutdown(fd, SHUT_RDWR);
  }
}

}  // namespace hps::gloo_backend
