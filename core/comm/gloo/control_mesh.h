// A full mesh of small TCP connections beside Gloo's, for the messages that gate a
// collective: the argument agreement. Gloo's unbound buffers move a message only after the
// receiver has announced it (a round trip) and through the device's event-loop thread;
// here a message is written straight to the socket and read by the waiting thread itself,
// one wake-up instead of three.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/comm/store.h"
#include "core/common/status.h"

namespace hps::gloo_backend {

class ControlMesh {
 public:
  using Clock = std::chrono::steady_clock;

  // Collective over `store`: every rank listens on `host`, publishes its address, connects
  // to every lower rank and accepts every higher one, by `deadline`.
  static StatusOr<std::unique_ptr<ControlMesh>> create(Store& store, int32_t rank, int32_t size,
                                                       const std::string& host,
                                                       Clock::time_point deadline);
  ~ControlMesh();
  ControlMesh(const ControlMesh&) = delete;
  ControlMesh& operator=(const ControlMesh&) = delete;

  // Sends `bytes` at `mine` to every peer and receives each peer's `bytes` into
  // all + peer * bytes (all + rank * bytes is left alone). TIMEOUT past `deadline` naming
  // the ranks still missing, ABORTED when a peer's connection closed or abort() ran.
  Status exchange(const void* mine, void* all, size_t bytes, Clock::time_point deadline);

  // Any thread: a running exchange returns ABORTED at once, and so do later ones.
  void abort();

 private:
  ControlMesh(int32_t rank, int32_t size);
  int32_t rank_;
  int32_t size_;
  std::vector<int> sockets_;  // by peer rank; -1 for this rank
  int wake_fd_ = -1;          // an eventfd abort() writes to
  std::atomic<bool> aborted_{false};
};

}  // namespace hps::gloo_backend
