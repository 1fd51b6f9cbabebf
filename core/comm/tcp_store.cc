// TcpStore: one rank serves the key-value map, every rank (the serving one too) is a client.
// The wire protocol is in tcp_store_protocol.h. The server is one event-loop thread over
// epoll: requests are applied in arrival order, a GET/WAIT whose keys are missing is parked
// until they are set or its deadline passes, and every connection has a deadline (handshake,
// idle, a reply the client does not read), so no client can hold a thread or memory it was
// not given. The client keeps a pool of connections, one per concurrent call.
#include <fcntl.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core/comm/host.h"
#include "core/comm/socket.h"
#include "core/comm/store.h"
#include "core/comm/tcp_store_protocol.h"
#include "core/common/env.h"
#include "core/common/logging.h"

namespace hps {
namespace {

using namespace net;        // NOLINT: the socket helpers
using namespace tcp_store;  // NOLINT: the protocol

// How long a call that does not wait may take before the server is deemed hung, and the
// extra time a GET/WAIT gives the server beyond its own timeout to answer: the store's
// timeout (the one its first connection was given) within these bounds; the slack is also
// at most a quarter of the wait (at least kMinReplySlack), so that a wait on a stopped server
// ends near its own timeout.
constexpr Milliseconds kMinCallTimeout{1'000};
constexpr Milliseconds kMaxCallTimeout{60'000};
constexpr Milliseconds kMinReplySlack{1'000};
constexpr Milliseconds kMaxReplySlack{10'000};
// How long the server tries to hand an answer to a client that does not read it.
constexpr Milliseconds kServerSendTimeout{5'000};
// A pooled connection unused for this long is replaced rather than reused: the server
// closes idle ones (TcpStoreOptions::idle_timeout, ten minutes by default).
constexpr Milliseconds kClientReuseLimit{60'000};
// Bytes read from a socket at a time.
constexpr size_t kReadChunk = 64 * 1024;

// A client store's number in its process, named in its handshakes.
uint64_t next_client_number() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1);
}

// The "store N" line of a proof's process text (see TcpStoreClient::handshake), 0 if none.
uint64_t client_store_number(std::string_view text) {
  constexpr std::string_view kName = "\nstore ";
  const size_t at = text.find(kName);
  if (at == std::string_view::npos) return 0;
  const char* begin = text.data() + at + kName.size();
  const char* end = text.data() + text.size();
  uint64_t n = 0;
  auto [stop, error] = std::from_chars(begin, end, n);
  return error == std::errc() && (stop == end || *stop == '\n') ? n : 0;
}

// ---- server ------------------------------------------------------------------------

class TcpStoreServerImpl final : public TcpStoreServer {
 public:
  TcpStoreServerImpl(int listen_fd, uint16_t port, TcpStoreOptions options, int epoll_fd,
                     int wake_fd)
      : listen_fd_(listen_fd),
        port_(port),
        options_(std::move(options)),
        epoll_fd_(epoll_fd),
        wake_fd_(wake_fd) {
    thread_ = std::thread([this] { loop(); });
  }

  ~TcpStoreServerImpl() override {
    stopping_ = true;
    const uint64_t one = 1;
    while (::write(wake_fd_, &one, sizeof one) < 0 && errno == EINTR) {
    }
    thread_.join();
    close_fd(listen_fd_);
    close_fd(epoll_fd_);
    close_fd(wake_fd_);
  }

  uint16_t port() const override { return port_; }
  size_t connection_count() const override { return open_.load(); }
  size_t live_connection_count(uint64_t own_store) const override {
    const std::string here = host::identity();  // read once, not per connection
    const auto self = static_cast<int32_t>(::getpid());
    // The entries and the count are copied together, under the lock that close() holds to
    // drop an entry and the count together; the processes are checked after, without it
    // (a /proc read per client must not hold up the server thread's closes). A connection
    // that closes meanwhile still counts: the linger asks again.
    std::vector<Client> clients;
    size_t open = 0;
    {
      std::lock_guard lock(processes_mutex_);
      clients.reserve(processes_.size());
      for (const auto& [id, client] : processes_) clients.push_back(client);
      open = open_.load();
    }
    size_t gone = 0;
    for (const Client& client : clients) {
      const host::Process& p = client.process;
      if (p.host != here) continue;  // another host's process cannot be checked
      const bool own = own_store != 0 && client.store == own_store && p.pid == self;
      gone += own || !host::process_running(p.pid, p.start) ? 1 : 0;
    }
    return open > gone ? open - gone : 0;
  }

 private:
  struct Parked {
    Request request;
    Clock::time_point deadline;
    std::string waiting_for;  // the first missing key, under which it is indexed
    size_t set_before = 0;    // keys before this one are set (keys are never removed)
  };

  struct Connection {
    int fd = -1;
    uint64_t id = 0;
    bool authenticated = false;
    bool closing = false;  // close once the output is sent (a refused handshake)
    Nonce nonce{};
    FrameDecoder decoder{kMaxHandshakeFrame};
    std::string input;  // read, not yet decoded (while a reply is pending or a request parked)
    // Replies not yet sent, in pieces: a GET's value is the stored one, shared, not a copy
    // per connection (clients that do not read cannot make the server hold a value each).
    std::deque<std::shared_ptr<const std::string>> output;
    size_t sent = 0;  // of output.front()
    Clock::time_point send_deadline{};
    Clock::time_point handshake_deadline{};
    Clock::time_point idle_deadline{};
    std::optional<Parked> parked;
    bool peer_closed = false;                // the client shut down its side
    std::optional<Clock::time_point> timer;  // its entry in timers_
    uint32_t events = 0;                     // registered with epoll
    bool registered = false;
  };

  // Which process and client store each authenticated connection's client is, when it
  // said: the linger's count (live_connection_count) reads it from another thread.
  struct Client {
    host::Process process;
    uint64_t store = 0;  // the client store's number in its process (0: not said)
  };
  mutable std::mutex processes_mutex_;
  std::map<uint64_t, Client> processes_;

  // Tokens in epoll's data: the listener and the wake-up descriptor are not connections.
  static constexpr uint64_t kListenerToken = 0;
  static constexpr uint64_t kWakeToken = 1;

  void loop() {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = kWakeToken;
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
    listen_paused_ = false;
    watch_listener(true);
    epoll_event events[64];
    while (!stopping_) {
      const int n = ::epoll_wait(epoll_fd_, events, 64, wait_ms());
      if (n < 0 && errno != EINTR) {
        HPS_LOG(kError) << "tcp store server: epoll_wait failed: " << errno_message(errno);
        break;
      }
      // Nothing may escape into this thread (it would end the process): a failure to
      // allocate for one event costs that event, and the loop goes on.
      try {
        for (int i = 0; i < n && !stopping_; ++i) {
          const uint64_t token = events[i].data.u64;
          if (token == kWakeToken) continue;
          if (token == kListenerToken) {
            accept_all();
            continue;
          }
          auto it = connections_.find(token);
          if (it != connections_.end()) on_event(*it->second, events[i].events);
        }
        expire(Clock::now());
      } catch (const std::exception& e) {
        HPS_LOG(kError) << "tcp store server: " << e.what();
      }
    }
    // Last replies (a rank's final SET must not be reported lost because rank 0 left right
    // after seeing it) go out if the socket takes them now; everything else is closed.
    for (auto& [id, c] : connections_) {
      (void)flush(*c);
      ::shutdown(c->fd, SHUT_RDWR);
      close_fd(c->fd);
    }
    connections_.clear();
    {
      std::lock_guard lock(processes_mutex_);
      processes_.clear();
      open_ = 0;
    }
  }

  int wait_ms() const {
    std::optional<Clock::time_point> next;
    if (!timers_.empty()) next = timers_.begin()->first;
    if (listen_paused_ && (!next || listen_resume_ < *next)) next = listen_resume_;
    if (!next) return -1;
    const auto left = std::chrono::duration_cast<Milliseconds>(*next - Clock::now()).count() + 1;
    return static_cast<int>(std::clamp<int64_t>(left, 0, 60'000));
  }

  void watch_listener(bool on) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = kListenerToken;
    ::epoll_ctl(epoll_fd_, on ? EPOLL_CTL_ADD : EPOLL_CTL_DEL, listen_fd_, on ? &ev : nullptr);
  }

  void accept_all() {
    while (true) {
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE) {
          // Out of descriptors: stop listening for a moment instead of spinning on a
          // listener that stays ready.
          HPS_LOG(kWarn) << "tcp store server: out of file descriptors with " << connections_.size()
                         << " connections open";
          watch_listener(false);
          listen_paused_ = true;
          listen_resume_ = Clock::now() + Milliseconds(100);
        }
        return;  // EAGAIN: none left; otherwise the client gave up already
      }
      set_no_delay(fd);
      if (connections_.size() >= options_.max_connections) {
        Hello full;
        full.status = unavailable("the store serves its limit of " +
                                  std::to_string(options_.max_connections) + " connections");
        const std::string bytes = frame(encode_hello(full));
        (void)::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        close_fd(fd);
        continue;
      }
      auto c = std::make_unique<Connection>();
      c->fd = fd;
      c->id = next_id_++;
      const auto now = Clock::now();
      c->handshake_deadline = now + options_.handshake_timeout;
      Hello hello;
      hello.token_required = !options_.token.empty();
      if (!auth::random_bytes(c->nonce.data(), c->nonce.size()).ok()) {
        close_fd(fd);
        continue;
      }
      hello.nonce = c->nonce;
      Connection& conn = *c;
      connections_.emplace(c->id, std::move(c));
      ++open_;
      reply(conn, encode_hello(hello), now);
      if (!flush(conn)) {
        close(conn);
        continue;
      }
      update(conn);
    }
  }

  void on_event(Connection& c, uint32_t events) {
    try {
      if (events & (EPOLLERR | EPOLLHUP)) return close(c);
      if (events & EPOLLRDHUP) {
        // The client will send nothing more. One that leaves while its request is parked has
        // abandoned it; otherwise what it sent before leaving is still answered.
        if (c.parked) return close(c);
        c.peer_closed = true;
        while (true) {
          const int got = read(c);
          if (got < 0) return close(c);
          if (got == 0) break;
        }
      } else if ((events & EPOLLIN) && read(c) < 0) {
        return close(c);
      }
      if (!advance(c)) return close(c);
      update(c);
    } catch (const std::exception& e) {
      // Out of memory for one client's request: that connection ends, the server goes on.
      HPS_LOG(kWarn) << "tcp store server: dropping a connection: " << e.what();
      close(c);
    }
  }

  // Appends one chunk of what the socket holds to the connection's input: the bytes read,
  // 0 when there are none now, -1 at the end of the stream or on an error.
  int read(Connection& c) {
    char buffer[kReadChunk];
    while (true) {
      const ssize_t n = ::recv(c.fd, buffer, sizeof buffer, 0);
      if (n == 0) return c.peer_closed ? 0 : -1;
      if (n < 0) {
        if (errno == EINTR) continue;
        return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -1;
      }
      c.input.append(buffer, static_cast<size_t>(n));
      if (c.authenticated && !c.parked) c.idle_deadline = Clock::now() + options_.idle_timeout;
      return static_cast<int>(n);
    }
  }

  // Sends what is pending and answers what has arrived until the connection must wait for
  // the socket, for more bytes or for a parked request; false when it must close.
  bool advance(Connection& c) {
    while (true) {
      if (!flush(c)) return false;
      if (!c.output.empty() || c.closing || c.parked) return true;
      const size_t before = c.input.size();
      if (!process(c)) return false;
      if (c.output.empty() && c.input.size() == before) return true;
    }
  }

  // Decodes and answers requests while the connection is free to (no reply pending, nothing
  // parked); false when it must close.
  bool process(Connection& c) {
    while (!c.closing && !c.parked && c.output.empty() && !c.input.empty()) {
      std::string_view in = c.input;
      const auto state = c.decoder.feed(&in);
      c.input.erase(0, c.input.size() - in.size());
      if (state == FrameDecoder::State::kTooLarge) {
        HPS_LOG(kDebug) << "tcp store server: closing a connection that announced a frame of "
                        << c.decoder.announced() << " bytes";
        return false;
      }
      if (state == FrameDecoder::State::kMore) break;
      const std::string payload = c.decoder.take();
      if (!(c.authenticated ? handle(c, payload) : handshake(c, payload))) return false;
    }
    return true;
  }

  bool handshake(Connection& c, std::string_view payload) {
    auto proof = parse_proof(payload);
    if (!proof) return false;
    Welcome welcome;
    if (!options_.token.empty()) {
      auto expected = handshake_mac(options_.token, true, c.nonce, proof->nonce);
      if (!expected.ok() || !proof->mac ||
          !auth::equal_secrets(expected->data(), proof->mac->data(), expected->size())) {
        welcome.status = failed_precondition(
            proof->mac ? "the store refused the token: it is not this job's HPS_STORE_TOKEN"
                       : "this store requires the job's token (HPS_STORE_TOKEN)");
        c.closing = true;
        reply(c, encode_welcome(welcome), Clock::now());
        return true;
      }
      auto mine = handshake_mac(options_.token, false, c.nonce, proof->nonce);
      if (!mine.ok()) return false;
      welcome.mac = *mine;
    }
    c.authenticated = true;
    if (auto process = host::Process::parse(proof->process)) {
      Client client{std::move(*process), client_store_number(proof->process)};
      std::lock_guard lock(processes_mutex_);
      processes_[c.id] = std::move(client);
    }
    c.decoder.set_limit(kMaxFrame);
    const auto now = Clock::now();
    c.idle_deadline = now + options_.idle_timeout;
    reply(c, encode_welcome(welcome), now);
    return true;
  }

  // Applies one request; false when the payload is not a request (the stream is corrupt).
  bool handle(Connection& c, std::string_view payload) {
    auto request = parse_request(payload);
    if (!request) return false;
    const auto now = Clock::now();
    for (const auto& key : request->keys) {
      if (Status s = check_store_key(key); !s.ok()) {
        reply(c, encode_error(s), now);
        return true;
      }
    }
    switch (request->op) {
      case Op::kSet: {
        const std::string& key = request->keys[0];
        if (Status s = check_store_value(key, request->value.size()); !s.ok()) {
          reply(c, encode_error(s), now);
          return true;
        }
        values_[key] = std::make_shared<const std::string>(std::move(request->value));
        reply(c, encode_ok({}), now);
        changed(key);
        return true;
      }
      case Op::kAdd: {
        const std::string& key = request->keys[0];
        auto it = values_.find(key);
        auto result = store_add_result(key, it == values_.end() ? nullptr : it->second.get(),
                                       request->number);
        if (!result.ok()) {
          reply(c, encode_error(result.status()), now);
          return true;
        }
        values_[key] = std::make_shared<const std::string>(std::to_string(*result));
        Writer w;
        w.i64(*result);
        reply(c, encode_ok(w.take()), now);
        changed(key);
        return true;
      }
      case Op::kCheck: {
        const bool set = first_missing(request->keys) == nullptr;
        reply(c, encode_ok(set ? std::string_view("\1", 1) : std::string_view("\0", 1)), now);
        return true;
      }
      case Op::kGet:
      case Op::kWait: {
        const Milliseconds timeout = clamp_store_wait(Milliseconds(request->number));
        request->number = timeout.count();
        size_t set_before = 0;
        const std::string* missing = first_missing(request->keys, &set_before);
        if (missing == nullptr) {
          answer_wait(c, *request, now);
        } else if (timeout.count() == 0) {
          reply(c, encode_error(wait_timeout(*request)), now);
        } else {
          c.parked = Parked{std::move(*request), now + timeout, *missing, set_before};
          waiters_[c.parked->waiting_for].insert(c.id);
        }
        return true;
      }
    }
    return false;
  }

  // The first of `keys` from *from on that is not set (*from moves to it), or null.
  const std::string* first_missing(const std::vector<std::string>& keys, size_t* from) const {
    for (; *from < keys.size(); ++*from) {
      if (values_.find(keys[*from]) == values_.end()) return &keys[*from];
    }
    return nullptr;
  }
  const std::string* first_missing(const std::vector<std::string>& keys) const {
    size_t from = 0;
    return first_missing(keys, &from);
  }

  static Status wait_timeout(const Request& r) {
    return store_timeout(r.op == Op::kGet ? "store get" : "store wait", r.keys,
                         Milliseconds(r.number));
  }

  void answer_wait(Connection& c, const Request& r, Clock::time_point now) {
    if (r.op == Op::kGet) {
      const std::shared_ptr<const std::string>& value = values_.find(r.keys[0])->second;
      Writer w;  // the frame's header, the OK status and the value's length; then the value
      w.u32(static_cast<uint32_t>(1 + 4 + value->size()));
      w.u8(static_cast<uint8_t>(StatusCode::kOk));
      w.u32(static_cast<uint32_t>(value->size()));
      c.output.push_back(std::make_shared<const std::string>(w.take()));
      c.output.push_back(value);
      replied(c, now);
    } else {
      reply(c, encode_ok({}), now);
    }
  }

  // `key` was set: requests parked on it are answered or move on to their next missing key.
  void changed(const std::string& key) {
    auto it = waiters_.find(key);
    if (it == waiters_.end()) return;
    const std::unordered_set<uint64_t> ids = std::move(it->second);
    waiters_.erase(it);
    const auto now = Clock::now();
    for (uint64_t id : ids) {
      auto c = connections_.find(id);
      if (c == connections_.end() || !c->second->parked) continue;
      Connection& conn = *c->second;
      const std::string* missing =
          first_missing(conn.parked->request.keys, &conn.parked->set_before);
      if (missing != nullptr) {
        conn.parked->waiting_for = *missing;
        waiters_[*missing].insert(id);
        continue;
      }
      Request r = std::move(conn.parked->request);
      conn.parked.reset();
      answer_wait(conn, r, now);
      // Then requests the client sent behind this one (a client does not, but any may).
      if (!advance(conn)) {
        close(conn);
        continue;
      }
      update(conn);
    }
  }

  void unpark(Connection& c) {
    if (!c.parked) return;
    auto it = waiters_.find(c.parked->waiting_for);
    if (it != waiters_.end()) {
      it->second.erase(c.id);
      if (it->second.empty()) waiters_.erase(it);
    }
    c.parked.reset();
  }

  void reply(Connection& c, std::string_view payload, Clock::time_point now) {
    c.output.push_back(std::make_shared<const std::string>(frame(payload)));
    replied(c, now);
  }

  void replied(Connection& c, Clock::time_point now) {
    c.send_deadline = now + kServerSendTimeout;
    if (c.authenticated) c.idle_deadline = now + options_.idle_timeout;
  }

  // Sends what the socket takes now; false when the connection broke.
  bool flush(Connection& c) {
    while (!c.output.empty()) {
      const std::string& piece = *c.output.front();
      if (c.sent < piece.size()) {
        const ssize_t n =
            ::send(c.fd, piece.data() + c.sent, piece.size() - c.sent, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0) {
          if (errno == EINTR) continue;
          return errno == EAGAIN || errno == EWOULDBLOCK;
        }
        c.sent += static_cast<size_t>(n);
        if (c.sent < piece.size()) continue;
      }
      c.output.pop_front();
      c.sent = 0;
    }
    return true;
  }

  // Re-registers the connection's interest and deadline after a change of its state.
  void update(Connection& c) {
    if (c.closing && c.output.empty()) return close(c);
    uint32_t events = c.peer_closed ? 0u : static_cast<uint32_t>(EPOLLRDHUP);
    std::optional<Clock::time_point> deadline;
    if (!c.output.empty()) {
      events |= EPOLLOUT;
      deadline = c.send_deadline;
    } else if (c.parked) {
      if (c.peer_closed) return close(c);  // a wait nobody will read
      deadline = c.parked->deadline;       // only a hang-up is of interest meanwhile
    } else if (c.peer_closed) {
      return close(c);  // answered all it sent; nothing more can come
    } else {
      events |= EPOLLIN;
      deadline = c.authenticated ? c.idle_deadline : c.handshake_deadline;
    }
    if (events != c.events) {
      epoll_event ev{};
      ev.events = events;
      ev.data.u64 = c.id;
      ::epoll_ctl(epoll_fd_, c.registered ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, c.fd, &ev);
      c.registered = true;
      c.events = events;
    }
    if (c.timer != deadline) {
      if (c.timer) timers_.erase({*c.timer, c.id});
      c.timer = deadline;
      if (deadline) timers_.insert({*deadline, c.id});
    }
  }

  void close(Connection& c) {
    unpark(c);
    if (c.timer) timers_.erase({*c.timer, c.id});
    if (c.registered) ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, c.fd, nullptr);
    close_fd(c.fd);
    {
      // With the count: live_connection_count reads both in one step (an entry gone
      // before the count fell would make a live client's connection look like an ended
      // one's).
      std::lock_guard lock(processes_mutex_);
      processes_.erase(c.id);
      --open_;
    }
    connections_.erase(c.id);  // destroys c
  }

  // Deadlines that have passed: parked requests time out, stalled connections close.
  void expire(Clock::time_point now) {
    if (listen_paused_ && now >= listen_resume_) {
      listen_paused_ = false;
      watch_listener(true);
    }
    while (!timers_.empty() && timers_.begin()->first <= now) {
      const uint64_t id = timers_.begin()->second;
      timers_.erase(timers_.begin());
      auto it = connections_.find(id);
      if (it == connections_.end()) continue;
      Connection& c = *it->second;
      c.timer.reset();
      if (c.parked && c.output.empty()) {
        const Request r = std::move(c.parked->request);
        unpark(c);
        try {
          reply(c, encode_error(wait_timeout(r)), now);
          if (!advance(c)) {
            close(c);
            continue;
          }
        } catch (const std::exception&) {
          close(c);
          continue;
        }
        update(c);
      } else {
        close(c);  // no handshake, idle, or a reply nobody reads
      }
    }
  }

  const int listen_fd_;
  const uint16_t port_;
  const TcpStoreOptions options_;
  const int epoll_fd_;
  const int wake_fd_;
  std::atomic<bool> stopping_{false};
  std::atomic<size_t> open_{0};
  std::thread thread_;

  // The loop thread's alone.
  uint64_t next_id_ = 2;  // after the listener's and the wake-up's tokens
  std::map<uint64_t, std::unique_ptr<Connection>> connections_;
  std::set<std::pair<Clock::time_point, uint64_t>> timers_;
  std::unordered_map<std::string, std::unordered_set<uint64_t>> waiters_;
  std::map<std::string, std::shared_ptr<const std::string>> values_;
  bool listen_paused_ = false;
  Clock::time_point listen_resume_{};
};

// ---- client ------------------------------------------------------------------------

Status send_frame(int fd, std::string_view payload, Clock::time_point deadline) {
  return send_all(fd, frame(payload), deadline);
}

Status recv_frame(int fd, std::string* payload, uint32_t limit, Clock::time_point deadline) {
  char header[4];
  HPS_RETURN_IF_ERROR(recv_all(fd, header, sizeof header, deadline));
  uint32_t size = 0;
  Reader(std::string_view(header, sizeof header)).u32(&size);
  if (size > limit) {
    return aborted("a frame of " + std::to_string(size) + " bytes exceeds the limit of " +
                   std::to_string(limit));
  }
  payload->resize(size);
  return recv_all(fd, payload->data(), size, deadline);
}

class TcpStoreClient final : public Store {
 public:
  TcpStoreClient(std::string host, uint16_t port, std::string token,
                 std::unique_ptr<TcpStoreServer> server)
      : host_(std::move(host)), port_(port), token_(std::move(token)), server_(std::move(server)) {}

  ~TcpStoreClient() override {
    drop_idle_connections();
    if (server_) linger();
  }

  // The first connection, retried until `connect_timeout`: the server may start later. A
  // refused token ends the attempts at once.
  Status connect_first(Milliseconds connect_timeout) {
    call_timeout_ = std::clamp(connect_timeout, kMinCallTimeout, kMaxCallTimeout);
    const auto deadline = Clock::now() + clamp_store_wait(connect_timeout);
    Milliseconds backoff{10};
    Status last = Status::Ok();
    bool told = false;  // `last` is the server's refusal
    while (true) {
      const auto attempt_deadline = std::min(deadline, Clock::now() + Milliseconds(1000));
      bool by_server = false;
      auto fd = open_connection(attempt_deadline, deadline, &by_server);
      if (fd.ok()) {
        idle_.push_back({*fd, Clock::now()});
        return Status::Ok();
      }
      if (fd.status().code() == StatusCode::kFailedPrecondition) return fd.status();
      // What the server said (a full store) says more than a later attempt cut short by
      // the deadline.
      if (by_server || !told) last = fd.status();
      told = told || by_server;
      const auto now = Clock::now();
      if (now >= deadline) break;
      std::this_thread::sleep_until(std::min(deadline, now + backoff));
      backoff = std::min(backoff * 2, Milliseconds(250));
    }
    return timeout_error("tcp store: could not connect to " + endpoint(host_, port_) + " within " +
                         std::to_string(connect_timeout.count()) + " ms: " + last.message());
  }

  Status set(std::string_view key, std::string_view value) override {
    HPS_RETURN_IF_ERROR(check_store_value(key, value.size()));
    Request q{Op::kSet, {std::string(key)}, std::string(value), 0};
    return call(q, Clock::now() + call_timeout_, key).status();
  }

  StatusOr<std::string> get(std::string_view key, Milliseconds timeout) override {
    HPS_RETURN_IF_ERROR(check_store_key(key));
    timeout = clamp_store_wait(timeout);
    Request q{Op::kGet, {std::string(key)}, {}, timeout.count()};
    HPS_ASSIGN_OR_RETURN(std::string response,
                         call(q, Clock::now() + timeout + reply_slack(timeout), key));
    Reader r(response);
    std::string value;
    if (!r.str(&value) || !r.done()) return malformed("get");
    return value;
  }

  StatusOr<int64_t> add(std::string_view key, int64_t delta) override {
    HPS_RETURN_IF_ERROR(check_store_key(key));
    Request q{Op::kAdd, {std::string(key)}, {}, delta};
    HPS_ASSIGN_OR_RETURN(std::string response, call(q, Clock::now() + call_timeout_, key));
    Reader r(response);
    int64_t value = 0;
    if (!r.i64(&value) || !r.done()) return malformed("add");
    return value;
  }

  Status wait(const std::vector<std::string>& keys, Milliseconds timeout) override {
    for (const auto& k : keys) HPS_RETURN_IF_ERROR(check_store_key(k));
    timeout = clamp_store_wait(timeout);
    const auto deadline = Clock::now() + timeout;
    // At most kMaxRequestKeys per request, one after the other, within the one timeout.
    for (size_t first = 0; first < keys.size() || first == 0; first += kMaxRequestKeys) {
      const auto left = std::max(Milliseconds(0),
                                 std::chrono::duration_cast<Milliseconds>(deadline - Clock::now()));
      Request q{Op::kWait, slice(keys, first), {}, left.count()};
      HPS_RETURN_IF_ERROR(
          call(q, Clock::now() + left + reply_slack(left), first_key(q.keys)).status());
    }
    return Status::Ok();
  }

  StatusOr<bool> check(const std::vector<std::string>& keys) override {
    for (const auto& k : keys) HPS_RETURN_IF_ERROR(check_store_key(k));
    for (size_t first = 0; first < keys.size() || first == 0; first += kMaxRequestKeys) {
      Request q{Op::kCheck, slice(keys, first), {}, 0};
      HPS_ASSIGN_OR_RETURN(std::string response,
                           call(q, Clock::now() + call_timeout_, first_key(q.keys)));
      Reader r(response);
      uint8_t set = 0;
      if (!r.u8(&set) || !r.done() || set > 1) return malformed("check");
      if (set == 0) return false;
    }
    return true;
  }

 private:
  struct Pooled {
    int fd;
    Clock::time_point used;
  };

  // keys[first, first + kMaxRequestKeys), what one request names.
  static std::vector<std::string> slice(const std::vector<std::string>& keys, size_t first) {
    const size_t end = std::min(keys.size(), first + size_t{kMaxRequestKeys});
    return std::vector<std::string>(keys.begin() + static_cast<std::ptrdiff_t>(first),
                                    keys.begin() + static_cast<std::ptrdiff_t>(end));
  }

  static std::string_view first_key(const std::vector<std::string>& keys) {
    return keys.empty() ? std::string_view() : std::string_view(keys[0]);
  }
  static std::string op_name(Op op) {
    switch (op) {
      case Op::kSet: return "set";
      case Op::kGet: return "get";
      case Op::kAdd: return "add";
      case Op::kCheck: return "check";
      case Op::kWait: return "wait";
    }
    return "call";
  }

  Status malformed(std::string_view op) const {
    return backend_error("tcp store " + std::string(op) + ": malformed response from " +
                         endpoint(host_, port_));
  }

  // The extra time a GET/WAIT gives the server beyond its own timeout to answer.
  Milliseconds reply_slack(Milliseconds wait) const {
    return std::min({call_timeout_, kMaxReplySlack, std::max(kMinReplySlack, wait / 4)});
  }

  // TIMEOUT: the server holds the connection but does not answer (stopped, or overloaded).
  // `since`: when the call began.
  Status not_answering(const std::string& what, const Status& io, Clock::time_point since) const {
    const auto waited = std::chrono::duration_cast<Milliseconds>(Clock::now() - since);
    return timeout_error(what + ": the server at " + endpoint(host_, port_) +
                         " did not answer in time (no answer in " + std::to_string(waited.count()) +
                         " ms; is the serving rank stopped or overloaded?): " + io.message());
  }

  Status refused(const std::string& why) const {
    return failed_precondition("tcp store at " + endpoint(host_, port_) + ": " + why);
  }

  // A connection that has completed the handshake: the server knows the token this client
  // has, and proved it knows it too. FAILED_PRECONDITION when the token is refused (either
  // way); other failures are worth retrying.
  // The handshake may take until `handshake_deadline`: a busy server greets late, but greets.
  // *refused_by_server (when given) tells whether the server itself refused the connection.
  StatusOr<int> open_connection(Clock::time_point connect_deadline,
                                Clock::time_point handshake_deadline,
                                bool* refused_by_server = nullptr) {
    HPS_ASSIGN_OR_RETURN(int fd, connect_once(host_, port_, connect_deadline));
    auto done = handshake(fd, std::max(connect_deadline, handshake_deadline), refused_by_server);
    if (!done.ok()) {
      close_fd(fd);
      return done;
    }
    return fd;
  }

  Status handshake(int fd, Clock::time_point deadline, bool* refused_by_server) {
    std::string payload;
    Status io = recv_frame(fd, &payload, kMaxHandshakeFrame, deadline);
    if (!io.ok()) return unavailable("handshake: " + io.message());
    auto hello = parse_hello(payload);
    if (!hello) {
      return refused("the server's greeting is not an hpshard store's of this version (" +
                     std::to_string(kProtocolVersion) + ")");
    }
    if (!hello->status.ok()) {
      if (refused_by_server != nullptr) *refused_by_server = true;
      return Status(hello->status.code(),
                    "tcp store at " + endpoint(host_, port_) +
                        " refused the connection: " + hello->status.message());
    }
    if (hello->token_required && token_.empty()) {
      return refused(
          "the store requires the job's token: set HPS_STORE_TOKEN (hpshard-run sets it for "
          "its ranks)");
    }
    if (!hello->token_required && !token_.empty()) {
      return refused(
          "the server does not ask for a token, so it is not the store of this job "
          "(HPS_STORE_TOKEN is set)");
    }
    Proof proof;
    // Who this is, for the serving store's linger: this process, and which of its stores
    // (the serving store's own connections, inherited by a process it forked, are not
    // waited for).
    proof.process = host::Process::self().encode() + "store " + std::to_string(number_) + "\n";
    HPS_RETURN_IF_ERROR(auth::random_bytes(proof.nonce.data(), proof.nonce.size()));
    if (!token_.empty()) {
      HPS_ASSIGN_OR_RETURN(proof.mac, handshake_mac(token_, true, hello->nonce, proof.nonce));
    }
    io = send_frame(fd, encode_proof(proof), deadline);
    if (io.ok()) io = recv_frame(fd, &payload, kMaxHandshakeFrame, deadline);
    if (!io.ok()) return unavailable("handshake: " + io.message());
    auto welcome = parse_welcome(payload);
    if (!welcome) return refused("malformed handshake reply");
    if (!welcome->status.ok()) return refused(welcome->status.message());
    if (!token_.empty()) {
      HPS_ASSIGN_OR_RETURN(auth::Mac expected,
                           handshake_mac(token_, false, hello->nonce, proof.nonce));
      if (!welcome->mac ||
          !auth::equal_secrets(expected.data(), welcome->mac->data(), expected.size())) {
        return refused("the server could not prove it knows the job's token (HPS_STORE_TOKEN)");
      }
    }
    return Status::Ok();
  }

  // An idle connection still usable, or a new one (one attempt: the server was up).
  StatusOr<int> acquire(Clock::time_point deadline, Clock::time_point since, bool* reused) {
    while (true) {
      Pooled p{-1, {}};
      {
        std::lock_guard lock(pool_mutex_);
        if (idle_.empty()) break;
        p = idle_.back();
        idle_.pop_back();
      }
      // Readable while idle means the server closed it (idle too long, or it left).
      pollfd check{p.fd, POLLIN, 0};
      if (Clock::now() - p.used < kClientReuseLimit && ::poll(&check, 1, 0) == 0) {
        *reused = true;
        return p.fd;
      }
      close_fd(p.fd);
    }
    *reused = false;
    auto fd = open_connection(std::min(deadline, Clock::now() + Milliseconds(5000)), deadline);
    if (!fd.ok()) {
      if (fd.status().code() == StatusCode::kFailedPrecondition) return fd.status();
      if (Clock::now() >= deadline) {  // it took the connection but never greeted
        return not_answering("tcp store", fd.status(), since);
      }
      return aborted("tcp store: cannot reach the server at " + endpoint(host_, port_) +
                     " (has the serving rank exited?): " + fd.status().message());
    }
    return *fd;
  }

  void release(int fd) {
    std::lock_guard lock(pool_mutex_);
    idle_.push_back({fd, Clock::now()});
  }

  // Sends one request and returns the response after its status byte, or the error.
  StatusOr<std::string> call(const Request& request, Clock::time_point deadline,
                             std::string_view key) {
    const std::string op = op_name(request.op);
    const std::string payload = encode_request(request);
    // A pooled connection the server closed a moment ago fails before any reply: such a
    // request is sent again on a new connection, except an add (it might have counted).
    const auto since = Clock::now();
    for (int attempt = 0;; ++attempt) {
      bool reused = false;
      HPS_ASSIGN_OR_RETURN(int fd, acquire(deadline, since, &reused));
      std::string response;
      Status io = send_frame(fd, payload, deadline);
      if (io.ok()) io = recv_frame(fd, &response, kMaxFrame, deadline);
      if (!io.ok()) {
        // The stream is in an unknown state: this connection is done.
        close_fd(fd);
        if (reused && attempt == 0 && request.op != Op::kAdd && Clock::now() < deadline) continue;
        if (io.code() == StatusCode::kTimeout) {
          return not_answering("tcp store " + op + " '" + std::string(key) + "'", io, since);
        }
        return aborted("tcp store " + op + " '" + std::string(key) +
                       "': lost the connection to the server at " + endpoint(host_, port_) +
                       " (has the serving rank exited?): " + io.message());
      }
      release(fd);
      std::string result;
      auto status = parse_response(response, &result);
      if (!status) return malformed(op);
      if (!status->ok()) return *status;
      return result;
    }
  }

  const std::string host_;
  const uint16_t port_;
  // After an abort of the store (hps_store_abort) it waits for no one.
  void abandon_peers() override { abandoned_ = true; }
  void drop_idle_connections() override {
    std::vector<Pooled> idle;
    {
      std::lock_guard lock(pool_mutex_);
      idle.swap(idle_);
    }
    // Shut down, not only closed: a process this one forked (a data-loader worker) holds a
    // copy of each descriptor, and the serving store would see the connection open until it
    // ends. Only by the process that made them: a forked child's copy of this store, when it
    // goes, must not cut its parent's connections.
    const bool ours = ::getpid() == pid_;
    for (auto& c : idle) {
      if (ours) ::shutdown(c.fd, SHUT_RDWR);
      close_fd(c.fd);
    }
  }
  // The serving rank's store goes only once the other ranks have closed their connections
  // (destroyed their stores) or ended (a process one forked may hold its connection open),
  // or after the call timeout: a rank that is done with a
  // communicator's creation or split may leave while its peers still finish theirs over
  // this store (they failed, "cannot reach the server", when the serving rank left first).
  void linger() {
    const auto deadline = Clock::now() + call_timeout_;
    auto pause = Milliseconds(1);
    while (server_->live_connection_count(number_) > 0 && !abandoned_) {
      if (Clock::now() >= deadline) {
        HPS_LOG(kDebug) << "tcp store: stopped serving with " << server_->connection_count()
                        << " connections still open after " << call_timeout_.count() << " ms";
        return;
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, Milliseconds(20));
    }
  }

  const std::string token_;
  std::atomic<bool> abandoned_{false};  // abandon_peers(): linger() waits for no one
  Milliseconds call_timeout_ = kMaxCallTimeout;
  std::mutex pool_mutex_;
  std::vector<Pooled> idle_;
  std::unique_ptr<TcpStoreServer> server_;
  // This client store's number in the process (its handshakes name it).
  const uint64_t number_ = next_client_number();
  const pid_t pid_ = ::getpid();  // the process whose connections these are
};

// The address a client on the serving host uses to reach a server bound to `host`.
std::string local_address_for(const std::string& host) {
  if (host.empty() || host == "0.0.0.0") return "127.0.0.1";
  if (host == "::") return "::1";
  return host;
}

StatusOr<std::unique_ptr<TcpStoreServer>> serve_on(Listener listener,
                                                   const TcpStoreOptions& options) {
  struct Closer {
    int fd;
    ~Closer() { close_fd(fd); }
  } owned{listener.fd};
  if (!options.token.empty()) HPS_RETURN_IF_ERROR(auth::check_token(options.token, "the token"));
  if (options.max_connections == 0) {
    return invalid_argument("tcp store: max_connections must be at least 1");
  }
  // Non-blocking, so one accept too many never blocks the loop.
  const int flags = ::fcntl(listener.fd, F_GETFL);
  if (flags < 0 || ::fcntl(listener.fd, F_SETFL, flags | O_NONBLOCK) != 0) {
    return backend_error("tcp store: fcntl: " + errno_message(errno));
  }
  const int epoll_fd = ::epoll_create1(EPOLL_CLOEXEC);
  if (epoll_fd < 0) return backend_error("tcp store: epoll_create1: " + errno_message(errno));
  const int wake_fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd < 0) {
    const int error = errno;
    close_fd(epoll_fd);
    return backend_error("tcp store: eventfd: " + errno_message(error));
  }
  owned.fd = -1;  // the server owns it now
  return std::unique_ptr<TcpStoreServer>(
      std::make_unique<TcpStoreServerImpl>(listener.fd, listener.port, options, epoll_fd, wake_fd));
}

}  // namespace

StatusOr<std::unique_ptr<TcpStoreServer>> TcpStoreServer::start(const std::string& host,
                                                                uint16_t port,
                                                                const TcpStoreOptions& options) {
  if (options.listen_fd >= 0) {
    auto listener = adopt_listener(options.listen_fd, "the listening socket");
    if (!listener.ok()) {
      close_fd(options.listen_fd);
      return listener.status();
    }
    return serve_on(*listener, options);
  }
  auto listener = listen_on(host, port, 1024);
  if (!listener.ok()) return unavailable("tcp store: " + listener.status().message());
  HPS_LOG(kDebug) << "tcp store: serving on " << endpoint(host, listener->port);
  return serve_on(*listener, options);
}

StatusOr<std::shared_ptr<Store>> make_tcp_store(std::string host, uint16_t port, bool serve,
                                                Milliseconds connect_timeout, uint16_t* bound_port,
                                                const TcpStoreOptions& options) {
  // A socket handed down is this call's to close, whatever happens below.
  struct Closer {
    int fd;
    ~Closer() { close_fd(fd); }
  } handed{serve ? options.listen_fd : -1};
  if (!options.token.empty()) {
    HPS_RETURN_IF_ERROR(auth::check_token(options.token, "tcp store: the token"));
    if (!auth::hmac_available()) {
      return unavailable(
          "tcp store: a token is set (HPS_STORE_TOKEN) but this build of hpshard has no "
          "OpenSSL to check it");
    }
  }
  std::unique_ptr<TcpStoreServer> server;
  std::string connect_host = host;
  if (serve) {
    // A socket handed down on another address than the one rank 0 connects to (the URL's
    // host) would serve where rank 0 itself cannot reach it: it timed out on its own server.
    if (std::string bound, own = local_address_for(host);
        handed.fd >= 0 && !net::listener_serves(handed.fd, own, &bound)) {
      return invalid_argument("tcp store: the listening socket handed down is bound to " + bound +
                              ", where rank 0's own connection (to " + shown_value(own) +
                              ") does not reach");
    }
    TcpStoreOptions server_options = options;
    server_options.listen_fd = handed.fd;
    handed.fd = -1;  // start() takes it over
    HPS_ASSIGN_OR_RETURN(server, TcpStoreServer::start(host, port, server_options));
    if (options.listen_fd >= 0 && port != 0 && server->port() != port) {
      return invalid_argument("tcp store: the listening socket handed down is bound to port " +
                              std::to_string(server->port()) + ", not " + std::to_string(port));
    }
    port = server->port();
    connect_host = local_address_for(host);
  } else if (port == 0) {
    return invalid_argument("tcp store: a client needs the server's port (0 given)");
  }
  auto client = std::make_shared<TcpStoreClient>(std::move(connect_host), port, options.token,
                                                 std::move(server));
  HPS_RETURN_IF_ERROR(client->connect_first(connect_timeout));
  if (bound_port != nullptr) *bound_port = port;
  return std::shared_ptr<Store>(std::move(client));
}

}  // namespace hps
