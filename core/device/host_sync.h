// The host-sync counter. Every place the runtime can block the calling host thread on
// device or communication progress calls count_host_sync() first, so tests can assert
// that a steady-state training step counts zero.
#pragma once

#include <cstdint>
#include <string_view>

namespace hps {

enum class HostSyncKind : int {
  kStreamSynchronize = 0,
  kEventSynchronize = 1,
  kDeviceToHostRead = 2,
  kWorkWait = 3,
  kTaskFlowDrain = 4,
};
inline constexpr int kHostSyncKindCount = 5;

std::string_view host_sync_kind_name(HostSyncKind kind);

// The one function every host-blocking wait goes through.
void count_host_sync(HostSyncKind kind);

uint64_t host_sync_count_thread();
uint64_t host_sync_count_total();
uint64_t host_sync_count_total(HostSyncKind kind);
// Resets the totals and the calling thread's counter.
void host_sync_reset();

// Dependency waits (CPU): a framework thread computing on the host must wait for an
// all-gather before it uses the gathered parameters. That is not a host sync (the host
// is the compute device there) but communication that was not overlapped: counted apart,
// with the time blocked. Prefetch exists to drive it to zero.
void count_dependency_wait(uint64_t nanoseconds_blocked);
uint64_t dependency_wait_count();
uint64_t dependency_wait_nanoseconds();
void dependency_wait_reset();

}  // namespace hps
