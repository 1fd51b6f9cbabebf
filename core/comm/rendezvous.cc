#include "core/comm/rendezvous.h"

#include <arpa/inet.h>

#include <charconv>
#include <limits>
#include <map>
#include <mutex>
#include <optional>

#include "core/common/env.h"

namespace hps {
namespace {

// The variables one launcher sets.
struct VariableFamily {
  const char* name;
  const char* rank;
  const char* world_size;
  const char* local_rank;
};

constexpr VariableFamily kFamilies[] = {
    {"hpshard", "HPS_RANK", "HPS_WORLD_SIZE", "HPS_LOCAL_RANK"},
    {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"},
    {"Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"},
    {"Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"},
};

struct StoreUrl {
  std::string scheme;  // "file", "tcp" or "memory"
  std::string path;    // file: the directory; memory: the name; tcp: the host
  uint16_t port = 0;   // tcp only
};

StatusOr<uint16_t> parse_port(std::string_view text) {
  uint32_t value = 0;
  const char* first = text.data();
  const char* last = first + text.size();
  auto [end, error] = std::from_chars(first, last, value);
  if (text.empty() || error != std::errc() || end != last || value < 1 || value > 65535) {
    // Appended, not "'" + ...: gcc 12 at -O3 warns falsely (-Wrestrict) on that operator+.
    std::string message = "'";
    message.append(text);
    message += "' is not a port number (1-65535)";
    return invalid_argument(std::move(message));
  }
  return static_cast<uint16_t>(value);
}

StatusOr<StoreUrl> parse_store_url(const std::string& url) {
  const auto separator = url.find("://");
  if (separator == std::string::npos) {
    return invalid_argument("store URL '" + url +
                            "' has no scheme: use file:///path, tcp://host:port or memory://name");
  }
  StoreUrl parsed;
  parsed.scheme = url.substr(0, separator);
  const std::string rest = url.substr(separator + 3);
  if (parsed.scheme == "file") {
    if (rest.empty() || rest[0] != '/') {
      return invalid_argument("store URL '" + url + "': a file store needs an absolute path, " +
                              "file:///path");
    }
    parsed.path = rest;
  } else if (parsed.scheme == "memory") {
    if (rest.empty()) return invalid_argument("store URL '" + url + "' names no memory store");
    parsed.path = rest;
  } else if (parsed.scheme == "tcp") {
    // host:port, or [ipv6]:port
    std::string host;
    std::string port;
    if (!rest.empty() && rest[0] == '[') {
      const auto close = rest.find("]:");
      if (close == std::string::npos) {
        return invalid_argument("store URL '" + url + "': expected tcp://[address]:port");
      }
      host = rest.substr(1, close - 1);
      port = rest.substr(close + 2);
    } else {
      const auto colon = rest.rfind(':');
      if (colon == std::string::npos) {
        return invalid_argument("store URL '" + url + "': expected tcp://host:port");
      }
      host = rest.substr(0, colon);
      port = rest.substr(colon + 1);
    }
    if (host.empty()) return invalid_argument("store URL '" + url + "' names no host");
    auto parsed_port = parse_port(port);
    if (!parsed_port.ok()) {
      return parsed_port.status().with_context("store URL '" + url + "'");
    }
    parsed.path = host;
    parsed.port = *parsed_port;
  } else {
    return invalid_argument("store URL '" + url + "' has the unknown scheme '" + parsed.scheme +
                            "': use file://, tcp:// or memory://");
  }
  return parsed;
}

// An int32 variable that must be set.
StatusOr<int32_t> required_int(const char* name, std::string_view family) {
  if (!env_string(name)) {
    return invalid_argument(std::string("environment variable ") + name + " is not set (the " +
                            std::string(family) + " variables are incomplete)");
  }
  HPS_ASSIGN_OR_RETURN(int64_t value, env_int(name, 0));
  if (value < std::numeric_limits<int32_t>::min() || value > std::numeric_limits<int32_t>::max()) {
    return invalid_argument(std::string("environment variable ") + name + "=" +
                            std::to_string(value) + " is out of range");
  }
  return static_cast<int32_t>(value);
}

// HPS_STORE when set (checked), else tcp://MASTER_ADDR:MASTER_PORT; appends what it used.
StatusOr<std::string> store_from_env(bool hps_store_required, std::string* used) {
  if (auto url = env_string("HPS_STORE")) {
    auto parsed = parse_store_url(*url);
    if (!parsed.ok()) return parsed.status().with_context("environment variable HPS_STORE");
    *used += ", HPS_STORE";
    return *url;
  }
  if (hps_store_required) {
    return invalid_argument(
        "environment variable HPS_STORE is not set (HPS_RANK is; hpshard-run sets both)");
  }
  const auto addr = env_string("MASTER_ADDR");
  const auto port = env_string("MASTER_PORT");
  if (!addr || !port) {
    return invalid_argument(std::string("environment variable ") +
                            (!addr ? "MASTER_ADDR" : "MASTER_PORT") +
                            " is not set: the store comes from HPS_STORE or "
                            "MASTER_ADDR and MASTER_PORT");
  }
  if (addr->empty()) return invalid_argument("environment variable MASTER_ADDR is empty");
  auto parsed_port = parse_port(*port);
  if (!parsed_port.ok()) {
    return parsed_port.status().with_context("environment variable MASTER_PORT");
  }
  *used += ", MASTER_ADDR, MASTER_PORT";
  const bool ipv6 = addr->find(':') != std::string::npos;
  return "tcp://" + (ipv6 ? "[" + *addr + "]" : *addr) + ":" + std::to_string(*parsed_port);
}

StatusOr<RendezvousInfo> from_family(const VariableFamily& family) {
  RendezvousInfo info;
  std::string used = std::string(family.rank) + ", " + family.world_size;
  HPS_ASSIGN_OR_RETURN(info.rank, required_int(family.rank, family.name));
  HPS_ASSIGN_OR_RETURN(info.world_size, required_int(family.world_size, family.name));
  if (info.world_size < 1) {
    return invalid_argument(std::string("environment variable ") + family.world_size + "=" +
                            std::to_string(info.world_size) +
                            ": the world size must be at least 1");
  }
  if (info.rank < 0 || info.rank >= info.world_size) {
    return invalid_argument(std::string("environment variable ") + family.rank + "=" +
                            std::to_string(info.rank) + " is outside [0, " +
                            std::to_string(info.world_size) + ") (" + family.world_size + "=" +
                            std::to_string(info.world_size) + ")");
  }
  info.local_rank = info.rank;
  if (env_string(family.local_rank)) {
    HPS_ASSIGN_OR_RETURN(info.local_rank, required_int(family.local_rank, family.name));
    if (info.local_rank < 0 || info.local_rank >= info.world_size) {
      return invalid_argument(std::string("environment variable ") + family.local_rank + "=" +
                              std::to_string(info.local_rank) + " is outside [0, " +
                              std::to_string(info.world_size) + ")");
    }
    used += std::string(", ") + family.local_rank;
  }
  const bool is_hpshard = std::string_view(family.rank) == "HPS_RANK";
  HPS_ASSIGN_OR_RETURN(info.store_url, store_from_env(is_hpshard, &used));
  info.source = std::string(family.name) + " (" + used + ")";
  return info;
}

// Stores opened as memory://name; they live as long as the process.
std::mutex& memory_stores_mutex() {
  static std::mutex mutex;
  return mutex;
}
std::map<std::string, std::shared_ptr<Store>>& memory_stores() {
  static auto* stores = new std::map<std::string, std::shared_ptr<Store>>();
  return *stores;
}

bool is_numeric_address(const std::string& host) {
  unsigned char buffer[sizeof(in6_addr)];
  return ::inet_pton(AF_INET, host.c_str(), buffer) == 1 ||
         ::inet_pton(AF_INET6, host.c_str(), buffer) == 1;
}

}  // namespace

StatusOr<RendezvousInfo> rendezvous_from_env() {
  for (const auto& family : kFamilies) {
    if (env_string(family.rank) || env_string(family.world_size)) return from_family(family);
  }
  return not_found(
      "no rendezvous variables: set HPS_RANK, HPS_WORLD_SIZE and HPS_STORE (hpshard-run does), "
      "or run under torchrun, Open MPI or Slurm");
}

StatusOr<std::shared_ptr<Store>> open_store(const std::string& url, int32_t rank,
                                            Milliseconds timeout) {
  HPS_ASSIGN_OR_RETURN(StoreUrl parsed, parse_store_url(url));
  if (rank < 0) return invalid_argument("open_store: rank " + std::to_string(rank) + " < 0");
  if (parsed.scheme == "file") return make_file_store(parsed.path);
  if (parsed.scheme == "memory") {
    std::lock_guard lock(memory_stores_mutex());
    auto& store = memory_stores()[parsed.path];
    if (!store) store = make_in_memory_store();
    return store;
  }
  // tcp: a hostname may resolve to an address this host does not listen on in the way the
  // others reach it (Debian maps its own name to 127.0.1.1), so only a literal address is
  // bound as given; otherwise rank 0 listens on every interface, as torchrun's store does.
  if (rank == 0) {
    const std::string bind_host = is_numeric_address(parsed.path) ? parsed.path : "0.0.0.0";
    return make_tcp_store(bind_host, parsed.port, true, timeout);
  }
  return make_tcp_store(parsed.path, parsed.port, false, timeout);
}

}  // namespace hps
