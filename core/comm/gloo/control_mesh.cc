#include "core/comm/gloo/control_mesh.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/comm/socket.h"

namespace hps::gloo_backend {
namespace {

using net::Clock;

std::string address_key(int32_t rank) { return "control/" + std::to_string(rank); }

int poll_timeout_ms(Clock::time_point deadline) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count() + 1;
  return static_cast<int>(std::clamp<int64_t>(left, 0, 1'000'000));
}

// Splits "host:port" (the host may be "[v6]").
bool parse_address(const std::string& text, std::string* host, uint16_t* port) {
  const size_t colon = text.rfind(':');
  if (colon == std::string::npos) return false;
  *host = text.substr(0, colon);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') {
    *host = host->substr(1, host->size() - 2);
  }
  *port = static_cast<uint16_t>(std::stoul(text.substr(colon + 1)));
  return true;
}

}  // namespace

ControlMesh::ControlMesh(int32_t rank, int32_t size)
    : rank_(rank), size_(size), sockets_(static_cast<size_t>(size), -1) {}

ControlMesh::~ControlMesh() {
  for (int fd : sockets_) net::close_fd(fd);
  net::close_fd(wake_fd_);
}

StatusOr<std::unique_ptr<ControlMesh>> ControlMesh::create(Store& store, int32_t rank, int32_t size,
                                                           const std::string& host,
                                                           Clock::time_point deadline) {
  std::unique_ptr<ControlMesh> mesh(new ControlMesh(rank, size));
  mesh->wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (mesh->wake_fd_ < 0) return backend_error("eventfd: " + net::errno_message(errno));
  if (size == 1) return mesh;
  HPS_ASSIGN_OR_RETURN(auto listener, net::listen_on(host, 0, size));
  struct Closer {
    int fd;
    ~Closer() { net::close_fd(fd); }
  } listening{listener.fd};
  HPS_RETURN_IF_ERROR(store.set(address_key(rank), net::endpoint(host, listener.port)));

  // Connect to every lower rank (its listen backlog completes the connection before it
  // accepts), announcing this rank's number; then accept every higher one.
  for (int32_t peer = 0; peer < rank; ++peer) {
    const auto left = std::chrono::duration_cast<Milliseconds>(deadline - Clock::now());
    HPS_ASSIGN_OR_RETURN(std::string address,
                         store.get(address_key(peer), std::max(left, Milliseconds(1))));
    std::string peer_host;
    uint16_t port = 0;
    if (!parse_address(address, &peer_host, &port)) {
      return backend_error("control connection: rank " + std::to_string(peer) +
                           " published a malformed address '" + address + "'");
    }
    auto fd = net::connect_once(peer_host, port, deadline);
    if (!fd.ok()) {
      return Status(fd.status().code(), "control connection to rank " + std::to_string(peer) +
                                            " at " + address + ": " + fd.status().message());
    }
    mesh->sockets_[static_cast<size_t>(peer)] = *fd;
    const int32_t me = rank;
    HPS_RETURN_IF_ERROR(net::send_all(
        *fd, std::string_view(reinterpret_cast<const char*>(&me), sizeof me), deadline));
  }
  for (int32_t accepted = rank + 1; accepted < size; ++accepted) {
    if (!net::poll_until(listener.fd, POLLIN, deadline)) {
      return timeout_error("control connections: rank " + std::to_string(rank) + " accepted " +
                           std::to_string(accepted - rank - 1) + " of the " +
                           std::to_string(size - rank - 1) + " higher ranks before the timeout");
    }
    const int fd = ::accept4(listener.fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == ECONNABORTED) {
        --accepted;
        continue;
      }
      return backend_error("control connections: accept: " + net::errno_message(errno));
    }
    net::set_no_delay(fd);
    int32_t peer = -1;
    Status s = net::recv_all(fd, reinterpret_cast<char*>(&peer), sizeof peer, deadline);
    if (!s.ok() || peer <= rank || peer >= size || mesh->sockets_[static_cast<size_t>(peer)] >= 0) {
      net::close_fd(fd);
      return backend_error(
          "control connections: a connection that is not a higher rank of "
          "this group (" +
          (s.ok() ? "rank " + std::to_string(peer) : s.message()) + ")");
    }
    mesh->sockets_[static_cast<size_t>(peer)] = fd;
  }
  return mesh;
}

Status ControlMesh::post(const void* mine, size_t bytes, Clock::time_point deadline) {
  if (aborted_) return aborted("the communicator was aborted");
  const std::string_view message(static_cast<const char*>(mine), bytes);
  for (int32_t peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    Status s = net::send_all(sockets_[static_cast<size_t>(peer)], message, deadline);
    if (!s.ok()) {
      return aborted("the control connection to rank " + std::to_string(peer) +
                     " failed (did it exit?): " + s.message());
    }
  }
  return Status::Ok();
}

Status ControlMesh::collect(void* all, size_t bytes, Clock::time_point deadline) {
  if (aborted_) return aborted("the communicator was aborted");
  // Read every peer's message as it comes, waking on abort().
  // Per-call state in members reused across collectives (one collect() at a time).
  std::vector<size_t>& got = got_;
  got.assign(static_cast<size_t>(size_), 0);
  got[static_cast<size_t>(rank_)] = bytes;
  int32_t missing = size_ - 1;
  std::vector<pollfd>& fds = poll_fds_;
  std::vector<int32_t>& peers = poll_peers_;
  while (missing > 0) {
    fds.clear();
    peers.clear();
    for (int32_t peer = 0; peer < size_; ++peer) {
      if (got[static_cast<size_t>(peer)] < bytes) {
        fds.push_back({sockets_[static_cast<size_t>(peer)], POLLIN, 0});
        peers.push_back(peer);
      }
    }
    fds.push_back({wake_fd_, POLLIN, 0});
    const int n = ::poll(fds.data(), fds.size(), poll_timeout_ms(deadline));
    if (aborted_) return aborted("the communicator was aborted");
    if (n < 0) {
      if (errno == EINTR) continue;
      return backend_error("control connections: poll: " + net::errno_message(errno));
    }
    if (n == 0 && Clock::now() >= deadline) {
      std::string who;
      for (int32_t peer : peers) who += (who.empty() ? "" : ", ") + std::to_string(peer);
      return timeout_error("no word from rank" + std::string(peers.size() > 1 ? "s " : " ") + who +
                           " (a peer is missing or called a different operation)");
    }
    for (size_t i = 0; i < peers.size(); ++i) {
      if (fds[i].revents == 0) continue;
      const size_t peer = static_cast<size_t>(peers[i]);
      auto* into = static_cast<char*>(all) + peer * bytes;
      const ssize_t r = ::recv(fds[i].fd, into + got[peer], bytes - got[peer], 0);
      if (r == 0 || (r < 0 && errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK)) {
        return aborted("rank " + std::to_string(peer) + " closed its control connection (" +
                       (r == 0 ? std::string("did it exit?") : net::errno_message(errno)) + ")");
      }
      if (r > 0) {
        got[peer] += static_cast<size_t>(r);
        if (got[peer] == bytes) --missing;
      }
    }
  }
  return Status::Ok();
}

void ControlMesh::abort() {
  aborted_ = true;
  const uint64_t one = 1;
  while (::write(wake_fd_, &one, sizeof one) < 0 && errno == EINTR) {
  }
}

}  // namespace hps::gloo_backend
