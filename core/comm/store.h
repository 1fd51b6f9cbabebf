// Key-value stores through which ranks meet: in-memory (ranks as threads of one
// process), file (a shared filesystem), TCP (one rank serves, the others connect).
// Every blocking call has a timeout and ends with TIMEOUT naming the keys it waited for.
// Every store follows the same rules: keys of at most kMaxStoreKeyBytes, values of at most
// kMaxStoreValueBytes, timeouts clamped to kMaxStoreWait, and one `add` (below).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "core/common/status.h"

namespace hps {

using Milliseconds = std::chrono::milliseconds;

// Limits every store enforces alike (INVALID_ARGUMENT naming the key beyond them). They also
// bound what a TCP store's server reads from one client message. A caller's key (the C
// API's store calls, check_caller_key) holds at most kMaxStoreKeyBytes; what a store holds
// is that key under hpshard's own prefixes (a job's "hpshard/run/<ticket>/", a
// communicator's), at most kMaxStoredKeyBytes.
inline constexpr size_t kMaxStoreKeyBytes = 4096;
inline constexpr size_t kMaxStoredKeyBytes = kMaxStoreKeyBytes + 512;
inline constexpr size_t kMaxStoreValueBytes = size_t{16} << 20;
// A wait longer than this is this long (a year): deadlines never overflow.
inline constexpr Milliseconds kMaxStoreWait{365LL * 24 * 3600 * 1000};

class Store {
 public:
  virtual ~Store() = default;
  // Sets `key` to `value`, replacing an earlier value.
  virtual Status set(std::string_view key, std::string_view value) = 0;
  // The value of `key`, waiting up to `timeout` for it to be set.
  virtual StatusOr<std::string> get(std::string_view key, Milliseconds timeout) = 0;
  // Adds `delta` to the integer at `key` (0 when unset or empty) and returns the new value.
  // A value that is not a plain base-10 integer ("5x", " 5", "+5") is INVALID_ARGUMENT and
  // a sum beyond int64 is OUT_OF_RANGE; the value is then left as it was.
  virtual StatusOr<int64_t> add(std::string_view key, int64_t delta) = 0;
  // Waits up to `timeout` until every key is set.
  virtual Status wait(const std::vector<std::string>& keys, Milliseconds timeout) = 0;
  // Whether every key is set, without waiting.
  virtual StatusOr<bool> check(const std::vector<std::string>& keys) = 0;
  // The caller gave up on the other ranks (a store handle aborted): a serving store no longer
  // waits for them to close their connections when it goes.
  // Thread-safe; idempotent.
  virtual void abandon_peers() {}
  // Closes the connections kept for later calls (a TCP client's pool); the next call opens
  // a new one. A rank waiting for a new server to take the store over calls it between
  // polls, so the old one, which serves until its clients have gone, can go. Thread-safe.
  virtual void drop_idle_connections() {}
};

// A store that passes every call to `inner`: a base for stores that change one of them.
class ForwardingStore : public Store {
 public:
  explicit ForwardingStore(std::shared_ptr<Store> inner) : inner_(std::move(inner)) {}
  Status set(std::string_view key, std::string_view value) override {
    return inner_->set(key, value);
  }
  StatusOr<std::string> get(std::string_view key, Milliseconds timeout) override {
    return inner_->get(key, timeout);
  }
  StatusOr<int64_t> add(std::string_view key, int64_t delta) override {
    return inner_->add(key, delta);
  }
  Status wait(const std::vector<std::string>& keys, Milliseconds timeout) override {
    return inner_->wait(keys, timeout);
  }
  StatusOr<bool> check(const std::vector<std::string>& keys) override {
    return inner_->check(keys);
  }
  void abandon_peers() override { inner_->abandon_peers(); }
  void drop_idle_connections() override { inner_->drop_idle_connections(); }

 private:
  std::shared_ptr<Store> inner_;
};

// A store whose waits (`get`, `wait`) go in slices of at most kSlice and ask `check` before
// the first and between them: an error from it ends the wait with that error, so a wait
// ends early when something else says it cannot succeed (a split's parent group reports a
// member gone; a store handle was aborted). `check` runs on the waiting thread, and is
// nulled by stop_watching (it may capture what goes away after).
class WatchedStore : public ForwardingStore {
 public:
  static constexpr Milliseconds kSlice{200};
  WatchedStore(std::shared_ptr<Store> inner, std::function<Status()> check)
      : ForwardingStore(std::move(inner)), check_(std::move(check)) {}

  // From here on a plain forwarding store.
  void stop_watching();

  StatusOr<std::string> get(std::string_view key, Milliseconds timeout) override;
  Status wait(const std::vector<std::string>& keys, Milliseconds timeout) override;

 private:
  Status watch();
  Status wait_in_slices(std::string_view operation, const std::vector<std::string>& keys,
                        Milliseconds timeout);
  std::mutex mu_;
  std::function<Status()> check_;
};

// A store that abort() ends: from then on every call, and every wait under way (within a
// slice), returns ABORTED. What the C API's store handles are, so that a caller can end a
// rendezvous that waits for ranks that never come (Ctrl-C in Python).
class AbortableStore final : public WatchedStore {
 public:
  explicit AbortableStore(std::shared_ptr<Store> inner);
  // Thread-safe; idempotent. A serving store no longer waits for the other ranks when it
  // goes (abandon_peers).
  void abort() {
    aborted_->store(true);
    abandon_peers();
  }

  Status set(std::string_view key, std::string_view value) override;
  StatusOr<int64_t> add(std::string_view key, int64_t delta) override;
  StatusOr<bool> check(const std::vector<std::string>& keys) override;

 private:
  AbortableStore(std::shared_ptr<Store> inner, std::shared_ptr<std::atomic<bool>> aborted);
  static Status aborted_error();
  Status refuse_if_aborted() const;
  std::shared_ptr<std::atomic<bool>> aborted_;
};

// A store whose keys live in this process; ranks that are threads share one instance.
std::shared_ptr<Store> make_in_memory_store();

// Keys under `prefix + "/"` of `base`: each communicator or group gets its own space.
std::shared_ptr<Store> make_prefix_store(std::shared_ptr<Store> base, std::string prefix);

// Formats the TIMEOUT message of a wait: "store wait timed out after 30000 ms for keys a, b".
Status store_timeout(std::string_view operation, const std::vector<std::string>& keys,
                     Milliseconds timeout);

// The rules every store shares. check_store_key/value: INVALID_ARGUMENT beyond the limits
// of a stored key (kMaxStoredKeyBytes) and value; check_caller_key: beyond a caller's.
Status check_store_key(std::string_view key);
Status check_caller_key(std::string_view key);
Status check_store_value(std::string_view key, size_t value_bytes);
// `timeout` within [0, kMaxStoreWait].
Milliseconds clamp_store_wait(Milliseconds timeout);
// The value `add` stores: `current` (null or empty: 0) plus `delta`, or the error above.
StatusOr<int64_t> store_add_result(std::string_view key, const std::string* current, int64_t delta);

}  // namespace hps

namespace hps {

// A store in `directory` (created when missing) on a filesystem every rank sees: one file
// per key, replaced atomically (temp file + rename); `add` holds an flock on a lock file in
// the directory, so it is atomic across processes, and gives up with TIMEOUT when another
// holds that lock for `timeout` (a stalled process). Reads poll with a short backoff.
StatusOr<std::shared_ptr<Store>> make_file_store(std::string directory,
                                                 Milliseconds timeout = std::chrono::minutes(5));

// How a TCP store serves and is reached.
struct TcpStoreOptions {
  // The job's shared secret (HPS_STORE_TOKEN). A server with a token serves only clients
  // that prove they know it (an HMAC challenge) and closes every other connection; a client
  // with a token talks only to a server that proves the same. Empty: no authentication.
  std::string token;
  // Connections served at once; a connection beyond them is told so and closed.
  size_t max_connections = 4096;
  // A connection that has not completed its handshake within this is closed.
  Milliseconds handshake_timeout{10'000};
  // A connection with nothing to do (no request waiting) for this long is closed; clients
  // reconnect transparently.
  Milliseconds idle_timeout{600'000};
  // Serve on this listening socket (taken over, closed with the server) instead of binding
  // host:port: a launcher binds it once and hands it down, so no other process can take
  // the port in between. -1: bind.
  int listen_fd = -1;
};

// Serves a TCP store on host:port until destroyed, from one thread (an event loop): a
// blocked GET/WAIT holds no thread, and a client that leaves frees its connection at once.
// Port 0 picks a free port (see port()); host "0.0.0.0" (or "::") listens on every
// interface. Frames are limited to a value of kMaxStoreValueBytes plus its key; a larger
// one closes the connection.
class TcpStoreServer {
 public:
  static StatusOr<std::unique_ptr<TcpStoreServer>> start(const std::string& host, uint16_t port,
                                                         const TcpStoreOptions& options = {});
  virtual ~TcpStoreServer() = default;
  // The port the server listens on (the chosen one when 0 was asked for).
  virtual uint16_t port() const = 0;
  // Connections open right now (accepted and not yet closed).
  virtual size_t connection_count() const = 0;
  // Of those, the ones a closing serving store waits for: left out are the connections of
  // clients that named their process in the handshake and have ended (a process one forked
  // holds the socket), and those of this process's client store `own_store` (the serving
  // store's own, which a process this one forked may hold; 0: none).
  virtual size_t live_connection_count(uint64_t own_store) const = 0;
};

// A client of the TCP store at host:port; when `serve`, the returned store also owns the
// server (it listens on host:port, or on options.listen_fd, and stops when the store is
// destroyed, once the other clients have closed their connections or `connect_timeout`, 1 s
// to 1 min, has passed: peers still finishing a creation or split over it are not cut off).
// Connecting retries until `connect_timeout` (the serving rank may start later
// than its clients); a refused token is not retried. When not null, `bound_port` receives
// the port served or connected to (the chosen one when port was 0). A client whose server
// has gone gets ABORTED naming the server, never a hang; one whose server does not answer
// (stopped) gets TIMEOUT after `connect_timeout` (1 s to 1 min; a get or wait after its own
// timeout plus that, at most 10 s more); a handshake that fails the token
// check is FAILED_PRECONDITION.
StatusOr<std::shared_ptr<Store>> make_tcp_store(std::string host, uint16_t port, bool serve,
                                                Milliseconds connect_timeout,
                                                uint16_t* bound_port = nullptr,
                                                const TcpStoreOptions& options = {});

}  // namespace hps
