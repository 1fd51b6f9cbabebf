#include "core/comm/rendezvous.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <charconv>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <optional>

#include "core/comm/auth.h"
#include "core/comm/socket.h"
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
    message.append(shown_value(text));
    message += "' is not a port number (1-65535)";
    return invalid_argument(std::move(message));
  }
  return static_cast<uint16_t>(value);
}

// `text` with ASCII letters in lower case (host names and flags compare so).
std::string ascii_lower(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return text;
}

// Takes the brackets off `host` ("[::1]" -> "::1"); whether there were any.
bool strip_brackets(std::string& host) {
  if (host.size() <= 2 || host.front() != '[' || host.back() != ']') return false;
  host = host.substr(1, host.size() - 2);
  return true;
}

// Whether `text` is an IPv6 address, with a zone after '%' or not (what goes in brackets).
bool is_ipv6_literal(const std::string& text) {
  const auto zone = text.find('%');
  if (zone != std::string::npos && zone + 1 == text.size()) return false;
  unsigned char buffer[sizeof(in6_addr)];
  return ::inet_pton(AF_INET6, text.substr(0, zone).c_str(), buffer) == 1;
}

// Whether hosts `a` and `b` have an address in common (localhost and 127.0.0.1, two
// spellings of one IPv6 address); false where either does not resolve.
bool same_address(const std::string& a, const std::string& b) {
  auto first = net::resolve(a, 0, false);
  auto second = net::resolve(b, 0, false);
  if (!first.ok() || !second.ok()) return false;
  // The address's bytes (in_addr or in6_addr).
  auto bytes = [](const addrinfo* info) {
    if (info->ai_family == AF_INET) {
      const auto& v4 = reinterpret_cast<const sockaddr_in*>(info->ai_addr)->sin_addr;
      return std::string_view(reinterpret_cast<const char*>(&v4), sizeof v4);
    }
    const auto& v6 = reinterpret_cast<const sockaddr_in6*>(info->ai_addr)->sin6_addr;
    return std::string_view(reinterpret_cast<const char*>(&v6), sizeof v6);
  };
  for (addrinfo* x = first->get(); x != nullptr; x = x->ai_next) {
    for (addrinfo* y = second->get(); y != nullptr; y = y->ai_next) {
      const bool ip = x->ai_family == AF_INET || x->ai_family == AF_INET6;
      if (ip && x->ai_family == y->ai_family && bytes(x) == bytes(y)) return true;
    }
  }
  return false;
}

// Whether torchrun's agent serves torch's own store on MASTER_PORT
// (TORCHELASTIC_USE_AGENT_STORE is true); `*value` is what the variable holds.
bool agent_store_in_use(std::string* value) {
  auto agent = env_string("TORCHELASTIC_USE_AGENT_STORE");
  if (!agent) return false;
  *value = *agent;
  return ascii_lower(*agent) == "true";
}

// Whether `url` (parsed) is torchrun's agent store, MASTER_ADDR:MASTER_PORT while the agent
// serves one (same port; same host name, or one address in common); `*agent` is then what
// TORCHELASTIC_USE_AGENT_STORE holds.
bool names_agent_store(const StoreUrl& url, std::string* agent) {
  const auto addr = env_string("MASTER_ADDR");
  const auto port = env_string("MASTER_PORT");
  if (url.scheme != "tcp" || !addr || !port || !agent_store_in_use(agent)) return false;
  auto agent_port = parse_port(*port);
  std::string agent_host = *addr;
  strip_brackets(agent_host);
  return agent_port.ok() && *agent_port == url.port &&
         (ascii_lower(agent_host) == ascii_lower(url.path) || same_address(agent_host, url.path));
}

// Every message shows the URL (and its parts) through shown_value: it comes from outside.
StatusOr<StoreUrl> parse_store_url(const std::string& url) {
  const std::string shown = shown_value(url);
  const auto separator = url.find("://");
  if (separator == std::string::npos) {
    return invalid_argument("store URL '" + shown +
                            "' has no scheme: use file:///path, tcp://host:port or memory://name");
  }
  StoreUrl parsed;
  parsed.scheme = url.substr(0, separator);
  const std::string rest = url.substr(separator + 3);
  if (parsed.scheme == "file") {
    if (rest.empty() || rest[0] != '/') {
      return invalid_argument("store URL '" + shown + "': a file store needs an absolute path, " +
                              "file:///path");
    }
    parsed.path = rest;
  } else if (parsed.scheme == "memory") {
    if (rest.empty()) return invalid_argument("store URL '" + shown + "' names no memory store");
    parsed.path = rest;
  } else if (parsed.scheme == "tcp") {
    // host:port, or [ipv6]:port
    std::string host;
    std::string port;
    if (!rest.empty() && rest[0] == '[') {
      const auto close = rest.find("]:");
      if (close == std::string::npos) {
        return invalid_argument("store URL '" + shown + "': expected tcp://[address]:port");
      }
      host = rest.substr(1, close - 1);
      port = rest.substr(close + 2);
    } else {
      const auto colon = rest.rfind(':');
      if (colon == std::string::npos) {
        return invalid_argument("store URL '" + shown + "': expected tcp://host:port");
      }
      host = rest.substr(0, colon);
      port = rest.substr(colon + 1);
    }
    if (host.empty()) return invalid_argument("store URL '" + shown + "' names no host");
    // A host name, an IPv4 address or, in brackets, an IPv6 one (with its zone): nothing a
    // resolver would take for something else (a space, a slash, a bracket, a control
    // character, a second port).
    const bool bracketed = rest[0] == '[';
    const bool host_ok = std::all_of(host.begin(), host.end(), [bracketed](char ch) {
      const auto c = static_cast<unsigned char>(ch);
      return std::isalnum(c) != 0 || c == '.' || c == '-' || c == '_' ||
             (bracketed && (c == ':' || c == '%'));
    });
    if (!host_ok || (bracketed && !is_ipv6_literal(host))) {
      return invalid_argument("store URL '" + shown + "': the host '" +
                              shown_value(bracketed ? "[" + host + "]" : host) +
                              "' is not a host name or an IP address (letters, digits, '.', "
                              "'-', '_'; brackets hold an IPv6 address only)");
    }
    auto parsed_port = parse_port(port);
    if (!parsed_port.ok()) {
      return parsed_port.status().with_context("store URL '" + shown + "'");
    }
    parsed.path = host;
    parsed.port = *parsed_port;
  } else {
    return invalid_argument("store URL '" + shown + "' has the unknown scheme '" +
                            shown_value(parsed.scheme) + "': use file://, tcp:// or memory://");
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
    // The port of torchrun's agent store on its host (MASTER_ADDR:MASTER_PORT) is taken.
    if (std::string agent; names_agent_store(*parsed, &agent)) {
      return invalid_argument(
          "environment variable HPS_STORE='" + shown_value(*url) +
          "' names MASTER_ADDR:MASTER_PORT, torchrun's agent store (environment variable "
          "TORCHELASTIC_USE_AGENT_STORE=" +
          shown_value(agent) +
          "), which hpshard's store cannot share: give HPS_STORE a port of its own");
    }
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
  // torchrun's agent serves torch's own store on MASTER_PORT: hpshard's cannot share it
  // (refused after the variables are checked: hpshard.torch relies on their checks here).
  if (std::string agent; agent_store_in_use(&agent)) {
    return invalid_argument(
        "MASTER_ADDR:MASTER_PORT is torchrun's agent store (environment variable "
        "TORCHELASTIC_USE_AGENT_STORE=" +
        shown_value(agent) +
        "), which hpshard's store cannot share: set HPS_STORE (tcp://HOST:PORT, another "
        "port, the same on every rank), or from Python use hpshard.torch.world_from_env, "
        "which finds a port through torch's store");
  }
  *used += ", MASTER_ADDR, MASTER_PORT";
  // An IPv6 literal goes in brackets, whether MASTER_ADDR has them already or not; other
  // text with a colon (host:port) is no address.
  std::string bare = *addr;
  const bool bracketed = strip_brackets(bare);
  if ((bracketed || bare.find(':') != std::string::npos) && !is_ipv6_literal(bare)) {
    return invalid_argument("environment variable MASTER_ADDR='" + shown_value(*addr) +
                            "' is not a host name or an IP address (an IPv6 address with a "
                            "non-empty zone if any; brackets hold an IPv6 address only; a port "
                            "goes in MASTER_PORT)");
  }
  const bool ipv6 = !bracketed && bare.find(':') != std::string::npos;
  std::string url =
      "tcp://" + (ipv6 ? "[" + *addr + "]" : *addr) + ":" + std::to_string(*parsed_port);
  auto parsed = parse_store_url(url);
  if (!parsed.ok()) {
    return parsed.status().with_context("environment variable MASTER_ADDR");
  }
  return url;
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

StatusOr<StoreOptions> store_options_from_env(const std::string& url, int32_t rank) {
  StoreOptions options;
  if (auto token = env_string("HPS_STORE_TOKEN")) {
    HPS_RETURN_IF_ERROR(auth::check_token(*token, "environment variable HPS_STORE_TOKEN"));
    options.token = *token;
  }
  HPS_ASSIGN_OR_RETURN(options.job, job_identity_from_env());
  auto info = rendezvous_from_env();
  if (!info.ok() || info->store_url != url) return options;
  options.world_size = info->world_size;
  // A listening socket handed down serves a TCP store only.
  if (rank != 0 || info->rank != 0 || url.rfind("tcp://", 0) != 0) return options;
  if (auto fd_text = env_string("HPS_STORE_FD")) {
    // Taken once: a second open in this process must not serve on a socket already handed
    // to a server (and closed with it).
    static std::mutex mutex;
    static bool taken = false;
    std::lock_guard lock(mutex);
    if (taken) return options;
    HPS_ASSIGN_OR_RETURN(int64_t fd, env_int("HPS_STORE_FD", -1));
    if (fd < 0 || fd > std::numeric_limits<int>::max()) {
      return invalid_argument("environment variable HPS_STORE_FD=" + shown_value(*fd_text) +
                              " is not a file descriptor");
    }
    HPS_ASSIGN_OR_RETURN(auto listener, net::adopt_listener(static_cast<int>(fd),
                                                            "environment variable HPS_STORE_FD"));
    options.listen_fd = listener.fd;
    taken = true;
  }
  return options;
}

StatusOr<std::string> store_bind_address(const std::string& host) {
  if (is_numeric_address(host)) return host;
  const std::string lower = ascii_lower(host);
  auto ends_with = [&](std::string_view suffix) {
    return lower.size() >= suffix.size() &&
           lower.compare(lower.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  if (lower == "localhost" || ends_with(".localhost")) return std::string("127.0.0.1");
  char own[256] = {};
  ::gethostname(own, sizeof own - 1);
  const std::string own_lower = ascii_lower(own);
  const std::string short_name = own_lower.substr(0, own_lower.find('.'));
  if (!own_lower.empty() &&
      (lower == own_lower || lower == short_name || lower.rfind(short_name + ".", 0) == 0)) {
    return std::string("0.0.0.0");
  }
  HPS_ASSIGN_OR_RETURN(auto list, net::resolve(host, 0, false));
  for (addrinfo* a = list.get(); a != nullptr; a = a->ai_next) {
    char text[INET6_ADDRSTRLEN] = {};
    const void* address = nullptr;
    if (a->ai_family == AF_INET) {
      address = &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr;
    } else if (a->ai_family == AF_INET6) {
      address = &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr;
    }
    if (address && ::inet_ntop(a->ai_family, address, text, sizeof text)) return std::string(text);
  }
  return unavailable("cannot resolve '" + shown_value(host) + "' to an address to listen on");
}

StatusOr<std::shared_ptr<Store>> open_store(const std::string& url, int32_t rank,
                                            Milliseconds timeout) {
  HPS_ASSIGN_OR_RETURN(StoreOptions options, store_options_from_env(url, rank));
  return open_store(url, rank, timeout, options);
}

StatusOr<std::shared_ptr<Store>> open_store(const std::string& url, int32_t rank,
                                            Milliseconds timeout, const StoreOptions& options) {
  // A socket handed down is this call's to close, whatever happens below.
  struct Closer {
    int fd;
    ~Closer() { net::close_fd(fd); }
  } handed{options.listen_fd};
  HPS_ASSIGN_OR_RETURN(StoreUrl parsed, parse_store_url(url));
  if (rank < 0) return invalid_argument("open_store: rank " + std::to_string(rank) + " < 0");
  if (options.world_size < 0 || (options.world_size > 0 && rank >= options.world_size)) {
    return invalid_argument("open_store: rank " + std::to_string(rank) + " is outside a world of " +
                            std::to_string(options.world_size));
  }
  if (parsed.scheme == "memory") {
    std::lock_guard lock(memory_stores_mutex());
    auto& store = memory_stores()[parsed.path];
    if (!store) store = make_in_memory_store();
    return store;
  }
  std::shared_ptr<Store> store;
  if (parsed.scheme == "file") {
    HPS_ASSIGN_OR_RETURN(store, make_file_store(parsed.path, timeout));
  } else {
    TcpStoreOptions tcp;
    tcp.token = options.token;
    if (rank == 0) {
      HPS_ASSIGN_OR_RETURN(std::string bind_host, store_bind_address(parsed.path));
      tcp.listen_fd = handed.fd;
      handed.fd = -1;  // the server takes it over
      auto served = make_tcp_store(bind_host, parsed.port, true, timeout, nullptr, tcp);
      if (!served.ok() && served.status().code() == StatusCode::kUnavailable &&
          job_store_open_here(url, 0)) {
        return failed_precondition(
            "the store " + shown_value(url) +
            " is open in this process already, as rank 0 (its server holds the port): open "
            "the job's store once per process and share it (or close it, and the "
            "communicators created over it, before opening it again)");
      }
      if (!served.ok() && served.status().code() == StatusCode::kUnavailable &&
          served.status().message().find("Address already in use") != std::string::npos) {
        // Rank 0 serves the job's store: another process holds the port.
        return unavailable(served.status().message() +
                           " (as rank 0 this process serves the store " + shown_value(url) +
                           ": another process holds its port, a second rank 0 of this job "
                           "(rank set to 0 twice, e.g. HPS_RANK) or another program)");
      }
      HPS_ASSIGN_OR_RETURN(store, std::move(served));
    } else {
      HPS_ASSIGN_OR_RETURN(store,
                           make_tcp_store(parsed.path, parsed.port, false, timeout, nullptr, tcp));
    }
  }
  JobOptions job;
  job.identity = options.job;
  job.world_size = options.world_size;
  job.where = shown_value(url);  // for messages: the URL comes from outside
  job.store = url;
  return join_job(std::move(store), rank, job, timeout);
}

}  // namespace hps
