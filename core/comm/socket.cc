#include "core/comm/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <system_error>

namespace hps::net {

std::string errno_message(int error) {
  return std::error_code(error, std::generic_category()).message();
}

void close_fd(int fd) {
  if (fd >= 0) ::close(fd);
}

bool poll_until(int fd, short events, Clock::time_point deadline) {
  while (true) {
    int timeout_ms = -1;
    if (deadline != Clock::time_point::max()) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count() +
          1;
      if (left <= 0) {
        errno = ETIMEDOUT;
        return false;
      }
      timeout_ms = static_cast<int>(std::min<int64_t>(left, 1'000'000));
    }
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, timeout_ms);
    if (n > 0) return true;  // readiness or error: the following send/recv tells which
    if (n < 0 && errno != EINTR) return false;
  }
}

namespace {
// What a failed poll_until means: TIMEOUT when the deadline passed.
Status poll_failure() {
  if (errno == ETIMEDOUT) return timeout_error("timed out");
  return aborted(errno_message(errno));
}
}  // namespace

Status send_all(int fd, std::string_view data, Clock::time_point deadline) {
  size_t done = 0;
  while (done < data.size()) {
    if (!poll_until(fd, POLLOUT, deadline)) return poll_failure();
    const ssize_t n = ::send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return aborted(errno_message(errno));
    }
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status recv_all(int fd, char* data, size_t size, Clock::time_point deadline) {
  size_t done = 0;
  while (done < size) {
    if (!poll_until(fd, POLLIN, deadline)) return poll_failure();
    const ssize_t n = ::recv(fd, data + done, size - done, 0);
    if (n == 0) return aborted("connection closed by peer");
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return aborted(errno_message(errno));
    }
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

void set_no_delay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

std::string endpoint(const std::string& host, uint16_t port) {
  const bool ipv6 = host.find(':') != std::string::npos;
  return (ipv6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

StatusOr<AddrInfoList> resolve(const std::string& host, uint16_t port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* list = nullptr;
  const std::string service = std::to_string(port);
  const int rc =
      ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &list);
  if (rc != 0) {
    return unavailable("cannot resolve '" + host + "': " + ::gai_strerror(rc));
  }
  return AddrInfoList(list);
}

StatusOr<int> connect_once(const std::string& host, uint16_t port, Clock::time_point deadline) {
  HPS_ASSIGN_OR_RETURN(auto list, resolve(host, port, false));
  std::string last_error = "no address";
  for (addrinfo* a = list.get(); a != nullptr; a = a->ai_next) {
    const int fd =
        ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) {
      last_error = errno_message(errno);
      continue;
    }
    int rc = ::connect(fd, a->ai_addr, a->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      if (poll_until(fd, POLLOUT, deadline)) {
        int error = 0;
        socklen_t len = sizeof error;
        ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len);
        rc = error == 0 ? 0 : -1;
        errno = error;
      }
    }
    if (rc == 0 && is_self_connection(fd)) {
      last_error = "connected to itself (nothing listens on the port yet)";
      close_fd(fd);
      continue;
    }
    if (rc == 0) {
      set_no_delay(fd);
      return fd;
    }
    last_error = errno_message(errno);
    close_fd(fd);
  }
  return unavailable(last_error);
}

bool is_self_connection(int fd) {
  sockaddr_storage mine{}, peer{};
  socklen_t mine_len = sizeof mine, peer_len = sizeof peer;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&mine), &mine_len) != 0 ||
      ::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_len) != 0) {
    return false;
  }
  return mine_len == peer_len && std::memcmp(&mine, &peer, mine_len) == 0;
}

StatusOr<Listener> listen_on(const std::string& host, uint16_t port, int backlog) {
  HPS_ASSIGN_OR_RETURN(auto list, resolve(host, port, true));
  std::string last_error = "no address";
  int listen_fd = -1;
  for (addrinfo* a = list.get(); a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      last_error = errno_message(errno);
      continue;
    }
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, backlog) == 0) {
      listen_fd = fd;
      break;
    }
    last_error = errno_message(errno);
    close_fd(fd);
  }
  if (listen_fd < 0) {
    return unavailable("cannot listen on " + endpoint(host, port) + ": " + last_error);
  }
  const uint16_t bound = local_port(listen_fd);
  return Listener{listen_fd, bound ? bound : port};
}

uint16_t local_port(int fd) {
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) != 0) return 0;
  if (bound.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  if (bound.ss_family == AF_INET6) {
    return ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port);
  }
  return 0;
}

bool listener_serves(int fd, const std::string& host, std::string* bound_text) {
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) != 0) return true;
  if (bound.ss_family != AF_INET && bound.ss_family != AF_INET6) return true;
  const auto* v4 = reinterpret_cast<const sockaddr_in*>(&bound);
  const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&bound);
  char text[INET6_ADDRSTRLEN] = {};
  const void* shown = bound.ss_family == AF_INET ? static_cast<const void*>(&v4->sin_addr)
                                                 : static_cast<const void*>(&v6->sin6_addr);
  if (::inet_ntop(bound.ss_family, shown, text, sizeof text) != nullptr) *bound_text = text;
  // An IPv6 socket takes IPv4 connections too unless it is IPv6-only (as a v4-mapped
  // address: to any when bound to ::, to one when bound to ::ffff:a.b.c.d).
  int v6_only = 1;
  socklen_t opt_len = sizeof v6_only;
  if (bound.ss_family == AF_INET6 &&
      ::getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6_only, &opt_len) != 0) {
    v6_only = 1;
  }
  auto list = resolve(host, 0, false);
  if (!list.ok()) return true;
  for (addrinfo* a = list->get(); a != nullptr; a = a->ai_next) {
    if (a->ai_family == AF_INET) {
      const in_addr& want = reinterpret_cast<const sockaddr_in*>(a->ai_addr)->sin_addr;
      if (bound.ss_family == AF_INET) {
        if (v4->sin_addr.s_addr == htonl(INADDR_ANY) || v4->sin_addr.s_addr == want.s_addr) {
          return true;
        }
      } else if (!v6_only) {
        if (IN6_IS_ADDR_UNSPECIFIED(&v6->sin6_addr)) return true;
        if (IN6_IS_ADDR_V4MAPPED(&v6->sin6_addr) &&
            std::memcmp(&v6->sin6_addr.s6_addr[12], &want, sizeof want) == 0) {
          return true;
        }
      }
    } else if (a->ai_family == AF_INET6 && bound.ss_family == AF_INET6) {
      const in6_addr& want = reinterpret_cast<const sockaddr_in6*>(a->ai_addr)->sin6_addr;
      if (IN6_IS_ADDR_UNSPECIFIED(&v6->sin6_addr) ||
          std::memcmp(&v6->sin6_addr, &want, sizeof want) == 0) {
        return true;
      }
    }
  }
  return false;
}

StatusOr<Listener> adopt_listener(int fd, std::string_view what) {
  auto refuse = [&](const std::string& why) {
    return invalid_argument(std::string(what) + "=" + std::to_string(fd) + ": " + why);
  };
  if (fd < 0) return refuse("not a file descriptor");
  int type = 0, listening = 0;
  socklen_t len = sizeof type;
  if (::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0) {
    return refuse("not an open socket (" + errno_message(errno) + ")");
  }
  len = sizeof listening;
  if (type != SOCK_STREAM || ::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 ||
      listening == 0) {
    return refuse("not a listening TCP socket");
  }
  const uint16_t port = local_port(fd);
  if (port == 0) return refuse("not bound to an IP port");
  ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  return Listener{fd, port};
}

}  // namespace hps::net
