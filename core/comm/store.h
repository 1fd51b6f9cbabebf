// Key-value stores through which ranks meet: in-memory (ranks as threads of one
// process), file (a shared filesystem), TCP (one rank serves, the others connect).
// Every blocking call has a timeout and ends with TIMEOUT naming the keys it waited for.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/common/status.h"

namespace hps {

using Milliseconds = std::chrono::milliseconds;

class Store {
 public:
  virtual ~Store() = default;
  // Sets `key` to `value`, replacing an earlier value.
  virtual Status set(std::string_view key, std::string_view value) = 0;
  // The value of `key`, waiting up to `timeout` for it to be set.
  virtual StatusOr<std::string> get(std::string_view key, Milliseconds timeout) = 0;
  // Adds `delta` to the integer at `key` (0 when unset) and returns the new value.
  virtual StatusOr<int64_t> add(std::string_view key, int64_t delta) = 0;
  // Waits up to `timeout` until every key is set.
  virtual Status wait(const std::vector<std::string>& keys, Milliseconds timeout) = 0;
  // Whether every key is set, without waiting.
  virtual StatusOr<bool> check(const std::vector<std::string>& keys) = 0;
};

// A store whose keys live in this process; ranks that are threads share one instance.
std::shared_ptr<Store> make_in_memory_store();

// Keys under `prefix + "/"` of `base`: each communicator or group gets its own space.
std::shared_ptr<Store> make_prefix_store(std::shared_ptr<Store> base, std::string prefix);

// Formats the TIMEOUT message of a wait: "store wait timed out after 30000 ms for keys a, b".
Status store_timeout(std::string_view operation, const std::vector<std::string>& keys,
                     Milliseconds timeout);

}  // namespace hps

namespace hps {

// A store in `directory` (created when missing) on a filesystem every rank sees: one file
// per key, replaced atomically (temp file + rename); `add` holds an flock on a lock file in
// the directory, so it is atomic across processes. Reads poll with a short backoff.
StatusOr<std::shared_ptr<Store>> make_file_store(std::string directory);

// Serves a TCP store on host:port until destroyed. Port 0 picks a free port (see port());
// host "0.0.0.0" (or "::") listens on every interface.
class TcpStoreServer {
 public:
  static StatusOr<std::unique_ptr<TcpStoreServer>> start(const std::string& host, uint16_t port);
  virtual ~TcpStoreServer() = default;
  // The port the server listens on (the chosen one when 0 was asked for).
  virtual uint16_t port() const = 0;
};

// A client of the TCP store at host:port; when `serve`, the returned store also owns the
// server (it listens on host:port and stops when the store is destroyed). Connecting retries
// until `connect_timeout` (the serving rank may start later than its clients). When not null,
// `bound_port` receives the port served or connected to (the chosen one when port was 0).
// A client whose server has gone gets ABORTED naming the server, never a hang.
StatusOr<std::shared_ptr<Store>> make_tcp_store(std::string host, uint16_t port, bool serve,
                                                Milliseconds connect_timeout,
                                                uint16_t* bound_port = nullptr);

}  // namespace hps
