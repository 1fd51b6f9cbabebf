// TcpStore: one rank serves the key-value map, every rank (the serving one too) is a client.
//
// Wire format: every message is a frame, a big-endian u32 length then that many bytes.
//   request:  u8 op, then per op   SET key value | GET key timeout_ms | ADD key delta
//                                  CHECK n key... | WAIT n key... timeout_ms
//   response: u8 status code; on OK the op's result (GET value, ADD i64, CHECK u8),
//             otherwise a message.
// Strings are a u32 length then bytes (any bytes, '\0' included); integers are big-endian.
// The server runs one thread per connection, so a blocked GET/WAIT holds only its own
// connection; the client keeps a pool of connections, one per concurrent call.
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>

#include "core/comm/socket.h"
#include "core/comm/store.h"
#include "core/common/logging.h"

namespace hps {
namespace {

using namespace net;  // NOLINT: the socket helpers

enum class Op : uint8_t { kSet = 1, kGet = 2, kAdd = 3, kCheck = 4, kWait = 5 };

// A frame larger than this is a corrupt stream or a peer that is not a store.
constexpr uint32_t kMaxFrame = 1u << 30;
// How long a call that does not wait may take before the server is deemed hung, and the
// extra time a GET/WAIT gives the server beyond its own timeout to answer.
constexpr Milliseconds kCallTimeout{60'000};
constexpr Milliseconds kReplySlack{10'000};
// How long the server tries to hand an answer to a client that does not read it.
constexpr Milliseconds kServerSendTimeout{5'000};
// Waits longer than this are treated as this long (keeps deadlines from overflowing).
constexpr Milliseconds kMaxWait{24LL * 3600 * 1000 * 365};

Milliseconds clamp_wait(Milliseconds t) { return std::clamp(t, Milliseconds(0), kMaxWait); }

// ---- encoding ----------------------------------------------------------------------

class Writer {
 public:
  void u8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void u32(uint32_t v) {
    for (int shift = 24; shift >= 0; shift -= 8) u8(static_cast<uint8_t>(v >> shift));
  }
  void i64(int64_t v) {
    const auto u = static_cast<uint64_t>(v);
    for (int shift = 56; shift >= 0; shift -= 8) u8(static_cast<uint8_t>(u >> shift));
  }
  void str(std::string_view s) {
    u32(static_cast<uint32_t>(s.size()));
    out_.append(s);
  }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

// gcc 12 at -O3 takes a response's bytes for uninitialized where Reader reads them (they
// are filled by net::recv_all, in another translation unit): a false positive.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
class Reader {
 public:
  explicit Reader(std::string_view in) : in_(in) {}
  bool u8(uint8_t* v) {
    if (pos_ + 1 > in_.size()) return false;
    *v = static_cast<uint8_t>(in_[pos_++]);
    return true;
  }
  bool u32(uint32_t* v) {
    uint32_t r = 0;
    for (int i = 0; i < 4; ++i) {
      uint8_t b = 0;
      if (!u8(&b)) return false;
      r = (r << 8) | b;
    }
    *v = r;
    return true;
  }
  bool i64(int64_t* v) {
    uint64_t r = 0;
    for (int i = 0; i < 8; ++i) {
      uint8_t b = 0;
      if (!u8(&b)) return false;
      r = (r << 8) | b;
    }
    *v = static_cast<int64_t>(r);
    return true;
  }
  bool str(std::string* s) {
    uint32_t n = 0;
    if (!u32(&n) || n > in_.size() - pos_) return false;
    s->assign(in_.substr(pos_, n));
    pos_ += n;
    return true;
  }
  bool keys(std::vector<std::string>* keys) {
    uint32_t n = 0;
    // Each key takes at least its 4-byte length: bounds n before reserving.
    if (!u32(&n) || n > (in_.size() - pos_) / 4) return false;
    keys->resize(n);
    for (auto& k : *keys) {
      if (!str(&k)) return false;
    }
    return true;
  }
  bool done() const { return pos_ == in_.size(); }

 private:
  std::string_view in_;
  size_t pos_ = 0;
};
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

Status send_frame(int fd, std::string_view payload, Clock::time_point deadline) {
  Writer header;
  header.u32(static_cast<uint32_t>(payload.size()));
  const std::string h = header.take();
  HPS_RETURN_IF_ERROR(send_all(fd, h, deadline));
  return send_all(fd, payload, deadline);
}

Status recv_frame(int fd, std::string* payload, Clock::time_point deadline) {
  char header[4];
  HPS_RETURN_IF_ERROR(recv_all(fd, header, sizeof header, deadline));
  uint32_t size = 0;
  Reader(std::string_view(header, sizeof header)).u32(&size);
  if (size > kMaxFrame) {
    return aborted("frame of " + std::to_string(size) + " bytes exceeds the limit");
  }
  payload->resize(size);
  return recv_all(fd, payload->data(), size, deadline);
}

// ---- server ------------------------------------------------------------------------

class TcpStoreServerImpl final : public TcpStoreServer {
 public:
  TcpStoreServerImpl(int listen_fd, int wake_read, int wake_write, uint16_t port)
      : listen_fd_(listen_fd), wake_read_(wake_read), wake_write_(wake_write), port_(port) {
    accept_thread_ = std::thread([this] { accept_loop(); });
  }

  ~TcpStoreServerImpl() override {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    changed_.notify_all();
    const char byte = 0;
    while (::write(wake_write_, &byte, 1) < 0 && errno == EINTR) {
    }
    accept_thread_.join();
    // The accept thread is gone: this thread alone owns the connection list now.
    // Shutting down the read side wakes handlers blocked in recv, while a handler that has
    // just applied a request still sends its answer (a rank's last SET must not be reported
    // lost because rank 0 left right after seeing it); `stopping_` wakes those in GET/WAIT.
    for (auto& c : connections_) ::shutdown(c->fd, SHUT_RD);
    for (auto& c : connections_) {
      c->thread.join();
      close_fd(c->fd);
    }
    close_fd(listen_fd_);
    close_fd(wake_read_);
    close_fd(wake_write_);
  }

  uint16_t port() const override { return port_; }

 private:
  struct Connection {
    int fd = -1;
    std::thread thread;
    std::atomic<bool> done{false};
  };

  void accept_loop() {
    while (true) {
      pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_read_, POLLIN, 0}};
      const int n = ::poll(fds, 2, 1000);
      if (n < 0 && errno != EINTR) {
        HPS_LOG(kError) << "tcp store server: poll failed: " << errno_message(errno);
        return;
      }
      if (fds[1].revents != 0) return;
      reap_finished();
      if (n <= 0 || fds[0].revents == 0) continue;
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) {
        // Out of descriptors: back off instead of spinning on a listener that stays ready.
        if (errno == EMFILE || errno == ENFILE) std::this_thread::sleep_for(Milliseconds(50));
        continue;  // otherwise the client gave up already, or a transient error
      }
      set_no_delay(fd);
      auto c = std::make_unique<Connection>();
      c->fd = fd;
      Connection* raw = c.get();
      c->thread = std::thread([this, raw] {
        serve(raw->fd);
        raw->done = true;
      });
      connections_.push_back(std::move(c));
    }
  }

  void reap_finished() {
    for (auto it = connections_.begin(); it != connections_.end();) {
      if ((*it)->done) {
        (*it)->thread.join();
        close_fd((*it)->fd);
        it = connections_.erase(it);
      } else {
        ++it;
      }
    }
  }

  void serve(int fd) {
    std::string request;
    while (recv_frame(fd, &request, Clock::time_point::max()).ok()) {
      std::optional<std::string> response = handle(request);
      if (!response) break;  // stopping, or a request that makes no sense
      // Bounded, so a client that stops reading cannot hold up the server's shutdown.
      if (!send_frame(fd, *response, Clock::now() + kServerSendTimeout).ok()) break;
    }
    // The peer sees the end now; the descriptor itself is closed when the thread is reaped.
    ::shutdown(fd, SHUT_RDWR);
  }

  static std::string error_response(const Status& status) {
    Writer w;
    w.u8(static_cast<uint8_t>(status.code()));
    w.str(status.message());
    return w.take();
  }

  bool all_set(const std::vector<std::string>& keys) const {
    return std::all_of(keys.begin(), keys.end(),
                       [&](const std::string& k) { return values_.count(k) != 0; });
  }

  // Waits (mutex held by `lock`) until the keys are set, the deadline passes or the server
  // stops; true when the keys are set (then the answer goes out even while stopping).
  bool wait_for_keys(std::unique_lock<std::mutex>& lock, const std::vector<std::string>& keys,
                     Milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    changed_.wait_until(lock, deadline, [&] { return stopping_ || all_set(keys); });
    return all_set(keys);
  }

  // The response to one request; nothing when the connection should close.
  std::optional<std::string> handle(std::string_view request) {
    Reader r(request);
    uint8_t op = 0;
    Writer w;
    w.u8(static_cast<uint8_t>(StatusCode::kOk));
    if (!r.u8(&op)) return std::nullopt;
    switch (static_cast<Op>(op)) {
      case Op::kSet: {
        std::string key, value;
        if (!r.str(&key) || !r.str(&value) || !r.done()) return std::nullopt;
        {
          std::lock_guard lock(mutex_);
          values_[std::move(key)] = std::move(value);
        }
        changed_.notify_all();
        return w.take();
      }
      case Op::kGet: {
        std::vector<std::string> keys(1);
        int64_t timeout_ms = 0;
        if (!r.str(&keys[0]) || !r.i64(&timeout_ms) || !r.done()) return std::nullopt;
        const Milliseconds timeout = clamp_wait(Milliseconds(timeout_ms));
        std::unique_lock lock(mutex_);
        if (!wait_for_keys(lock, keys, timeout)) {
          if (stopping_) return std::nullopt;
          return error_response(store_timeout("store get", keys, timeout));
        }
        w.str(values_.find(keys[0])->second);
        return w.take();
      }
      case Op::kAdd: {
        std::string key;
        int64_t delta = 0;
        if (!r.str(&key) || !r.i64(&delta) || !r.done()) return std::nullopt;
        int64_t result = 0;
        {
          std::lock_guard lock(mutex_);
          std::string& slot = values_[key];
          int64_t current = 0;
          if (!slot.empty()) {
            try {
              size_t used = 0;
              current = std::stoll(slot, &used);
              if (used != slot.size()) throw std::invalid_argument("trailing characters");
            } catch (const std::exception&) {
              return error_response(invalid_argument("store add: key '" + key +
                                                     "' holds a value that is not an integer"));
            }
          }
          if (__builtin_add_overflow(current, delta, &result)) {
            return error_response(out_of_range("store add: key '" + key + "' would overflow"));
          }
          slot = std::to_string(result);
        }
        changed_.notify_all();
        w.i64(result);
        return w.take();
      }
      case Op::kCheck: {
        std::vector<std::string> keys;
        if (!r.keys(&keys) || !r.done()) return std::nullopt;
        std::lock_guard lock(mutex_);
        w.u8(all_set(keys) ? 1 : 0);
        return w.take();
      }
      case Op::kWait: {
        std::vector<std::string> keys;
        int64_t timeout_ms = 0;
        if (!r.keys(&keys) || !r.i64(&timeout_ms) || !r.done()) return std::nullopt;
        const Milliseconds timeout = clamp_wait(Milliseconds(timeout_ms));
        std::unique_lock lock(mutex_);
        if (!wait_for_keys(lock, keys, timeout)) {
          if (stopping_) return std::nullopt;
          return error_response(store_timeout("store wait", keys, timeout));
        }
        return w.take();
      }
    }
    return std::nullopt;
  }

  const int listen_fd_;
  const int wake_read_;
  const int wake_write_;
  const uint16_t port_;
  std::thread accept_thread_;
  // Touched by the accept thread only, then (after it is joined) by the destructor.
  std::list<std::unique_ptr<Connection>> connections_;

  std::mutex mutex_;
  std::condition_variable changed_;
  bool stopping_ = false;
  std::map<std::string, std::string> values_;
};

// ---- client ------------------------------------------------------------------------

class TcpStoreClient final : public Store {
 public:
  TcpStoreClient(std::string host, uint16_t port, std::unique_ptr<TcpStoreServer> server)
      : host_(std::move(host)), port_(port), server_(std::move(server)) {}

  ~TcpStoreClient() override {
    for (int fd : idle_) close_fd(fd);
    // server_ (when this rank serves) stops after its own connections are closed.
  }

  // The first connection, retried until `connect_timeout`: the server may start later.
  Status connect_first(Milliseconds connect_timeout) {
    const auto deadline = Clock::now() + clamp_wait(connect_timeout);
    Milliseconds backoff{10};
    Status last = Status::Ok();
    while (true) {
      const auto attempt_deadline = std::min(deadline, Clock::now() + Milliseconds(1000));
      auto fd = connect_once(host_, port_, attempt_deadline);
      if (fd.ok()) {
        idle_.push_back(*fd);
        return Status::Ok();
      }
      last = fd.status();
      const auto now = Clock::now();
      if (now >= deadline) break;
      std::this_thread::sleep_until(std::min(deadline, now + backoff));
      backoff = std::min(backoff * 2, Milliseconds(250));
    }
    return timeout_error("tcp store: could not connect to " + endpoint(host_, port_) + " within " +
                         std::to_string(connect_timeout.count()) + " ms: " + last.message());
  }

  Status set(std::string_view key, std::string_view value) override {
    Writer w;
    w.u8(static_cast<uint8_t>(Op::kSet));
    w.str(key);
    w.str(value);
    return call(w.take(), Clock::now() + kCallTimeout, "set", key).status();
  }

  StatusOr<std::string> get(std::string_view key, Milliseconds timeout) override {
    timeout = clamp_wait(timeout);
    Writer w;
    w.u8(static_cast<uint8_t>(Op::kGet));
    w.str(key);
    w.i64(timeout.count());
    HPS_ASSIGN_OR_RETURN(std::string response,
                         call(w.take(), Clock::now() + timeout + kReplySlack, "get", key));
    Reader r(response);
    std::string value;
    if (!r.str(&value) || !r.done()) return malformed("get");
    return value;
  }

  StatusOr<int64_t> add(std::string_view key, int64_t delta) override {
    Writer w;
    w.u8(static_cast<uint8_t>(Op::kAdd));
    w.str(key);
    w.i64(delta);
    HPS_ASSIGN_OR_RETURN(std::string response,
                         call(w.take(), Clock::now() + kCallTimeout, "add", key));
    Reader r(response);
    int64_t value = 0;
    if (!r.i64(&value) || !r.done()) return malformed("add");
    return value;
  }

  Status wait(const std::vector<std::string>& keys, Milliseconds timeout) override {
    timeout = clamp_wait(timeout);
    Writer w;
    w.u8(static_cast<uint8_t>(Op::kWait));
    put_keys(w, keys);
    w.i64(timeout.count());
    return call(w.take(), Clock::now() + timeout + kReplySlack, "wait", first_key(keys)).status();
  }

  StatusOr<bool> check(const std::vector<std::string>& keys) override {
    Writer w;
    w.u8(static_cast<uint8_t>(Op::kCheck));
    put_keys(w, keys);
    HPS_ASSIGN_OR_RETURN(std::string response,
                         call(w.take(), Clock::now() + kCallTimeout, "check", first_key(keys)));
    Reader r(response);
    uint8_t set = 0;
    if (!r.u8(&set) || !r.done()) return malformed("check");
    return set != 0;
  }

 private:
  static void put_keys(Writer& w, const std::vector<std::string>& keys) {
    w.u32(static_cast<uint32_t>(keys.size()));
    for (const auto& k : keys) w.str(k);
  }
  static std::string_view first_key(const std::vector<std::string>& keys) {
    return keys.empty() ? std::string_view() : std::string_view(keys[0]);
  }

  Status malformed(std::string_view op) const {
    return backend_error("tcp store " + std::string(op) + ": malformed response from " +
                         endpoint(host_, port_));
  }

  // An idle connection, or a new one (one attempt: the server is known to have been up).
  StatusOr<int> acquire(Clock::time_point deadline) {
    {
      std::lock_guard lock(pool_mutex_);
      if (!idle_.empty()) {
        const int fd = idle_.back();
        idle_.pop_back();
        return fd;
      }
    }
    auto fd = connect_once(host_, port_, std::min(deadline, Clock::now() + Milliseconds(5000)));
    if (!fd.ok()) {
      return aborted("tcp store: cannot reach the server at " + endpoint(host_, port_) +
                     " (has the serving rank exited?): " + fd.status().message());
    }
    return *fd;
  }

  void release(int fd) {
    std::lock_guard lock(pool_mutex_);
    idle_.push_back(fd);
  }

  // Sends one request and returns the response after its status byte, or the error.
  StatusOr<std::string> call(std::string request, Clock::time_point deadline, std::string_view op,
                             std::string_view key) {
    HPS_ASSIGN_OR_RETURN(int fd, acquire(deadline));
    std::string response;
    Status io = send_frame(fd, request, deadline);
    if (io.ok()) io = recv_frame(fd, &response, deadline);
    if (!io.ok()) {
      // The stream is in an unknown state: this connection is done.
      close_fd(fd);
      return aborted("tcp store " + std::string(op) + " '" + std::string(key) +
                     "': lost the connection to the server at " + endpoint(host_, port_) +
                     " (has the serving rank exited?): " + io.message());
    }
    release(fd);
    Reader r(response);
    uint8_t code = 0;
    if (!r.u8(&code)) return malformed(op);
    if (static_cast<StatusCode>(code) != StatusCode::kOk) {
      std::string message;
      if (!r.str(&message)) return malformed(op);
      return Status(static_cast<StatusCode>(code), std::move(message));
    }
    return response.substr(1);
  }

  const std::string host_;
  const uint16_t port_;
  std::mutex pool_mutex_;
  std::vector<int> idle_;
  std::unique_ptr<TcpStoreServer> server_;
};

// The address a client on the serving host uses to reach a server bound to `host`.
std::string local_address_for(const std::string& host) {
  if (host.empty() || host == "0.0.0.0") return "127.0.0.1";
  if (host == "::") return "::1";
  return host;
}

}  // namespace

StatusOr<std::unique_ptr<TcpStoreServer>> TcpStoreServer::start(const std::string& host,
                                                                uint16_t port) {
  auto listener = listen_on(host, port, 1024);
  if (!listener.ok()) return unavailable("tcp store: " + listener.status().message());
  const int listen_fd = listener->fd;
  const uint16_t bound_port = listener->port;
  int wake[2];
  if (::pipe2(wake, O_CLOEXEC) != 0) {
    const int error = errno;
    close_fd(listen_fd);
    return backend_error("tcp store: pipe failed: " + errno_message(error));
  }
  HPS_LOG(kDebug) << "tcp store: serving on " << endpoint(host, bound_port);
  return std::unique_ptr<TcpStoreServer>(
      std::make_unique<TcpStoreServerImpl>(listen_fd, wake[0], wake[1], bound_port));
}

StatusOr<std::shared_ptr<Store>> make_tcp_store(std::string host, uint16_t port, bool serve,
                                                Milliseconds connect_timeout,
                                                uint16_t* bound_port) {
  std::unique_ptr<TcpStoreServer> server;
  std::string connect_host = host;
  if (serve) {
    HPS_ASSIGN_OR_RETURN(server, TcpStoreServer::start(host, port));
    port = server->port();
    connect_host = local_address_for(host);
  } else if (port == 0) {
    return invalid_argument("tcp store: a client needs the server's port (0 given)");
  }
  auto client = std::make_shared<TcpStoreClient>(std::move(connect_host), port, std::move(server));
  HPS_RETURN_IF_ERROR(client->connect_first(connect_timeout));
  if (bound_port != nullptr) *bound_port = port;
  return std::shared_ptr<Store>(std::move(client));
}

}  // namespace hps
