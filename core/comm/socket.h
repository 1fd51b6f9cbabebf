// TCP helpers with deadlines, shared by the TCP store and the Gloo backend's control mesh.
#pragma once

#include <netdb.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "core/common/status.h"

namespace hps::net {

using Clock = std::chrono::steady_clock;

std::string errno_message(int error);
void close_fd(int fd);  // -1 is a no-op

// Waits until `fd` is ready for `events`; false with errno set (ETIMEDOUT at the deadline).
bool poll_until(int fd, short events, Clock::time_point deadline);

// OK, or ABORTED with the errno text; EPIPE/ECONNRESET/EOF all mean the peer is gone.
Status send_all(int fd, std::string_view data, Clock::time_point deadline);
Status recv_all(int fd, char* data, size_t size, Clock::time_point deadline);

void set_no_delay(int fd);
std::string endpoint(const std::string& host, uint16_t port);  // host:port, [v6]:port

struct AddrInfoDeleter {
  void operator()(addrinfo* a) const { ::freeaddrinfo(a); }
};
using AddrInfoList = std::unique_ptr<addrinfo, AddrInfoDeleter>;
StatusOr<AddrInfoList> resolve(const std::string& host, uint16_t port, bool passive);

// One non-blocking connect attempt to each address of host:port, bounded by `deadline`;
// the socket it returns is non-blocking, with TCP_NODELAY. A connection to itself is closed
// and counts as refused (see is_self_connection).
StatusOr<int> connect_once(const std::string& host, uint16_t port, Clock::time_point deadline);

// Whether connected socket `fd` is connected to itself: a connect to a port of this host on
// which nothing listens yet can pick that very port as its own (it lies in the ephemeral
// range) and complete as a TCP simultaneous open, with no server at the other end.
bool is_self_connection(int fd);

struct Listener {
  int fd = -1;
  uint16_t port = 0;  // the bound port (the one asked for, or the kernel's pick for 0)
};
// A listening socket on host:port (port 0: any free port).
StatusOr<Listener> listen_on(const std::string& host, uint16_t port, int backlog);

// Takes over `fd`, a listening TCP socket another process (a launcher) bound and handed
// down: checked to be one (INVALID_ARGUMENT naming `what` otherwise) and made close-on-exec.
StatusOr<Listener> adopt_listener(int fd, std::string_view what);

// The local port `fd` is bound to; 0 when it is not a bound IP socket.
uint16_t local_port(int fd);

// Whether listening socket `fd` takes connections made to `host`: it is bound to the
// wildcard address of a family `host` has an address of, or to an address `host` resolves
// to (an IPv6 socket that is not IPv6-only takes IPv4 connections too). True too where that
// cannot be told (`host` does not resolve: connecting to it says why). `*bound` is its
// address, as text.
bool listener_serves(int fd, const std::string& host, std::string* bound);

}  // namespace hps::net
