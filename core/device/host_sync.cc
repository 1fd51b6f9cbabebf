#include "core/device/host_sync.h"

#include <array>
#include <atomic>

#include "core/common/logging.h"
#include "core/trace/trace.h"

namespace hps {
namespace {

thread_local uint64_t t_thread_count = 0;
std::array<std::atomic<uint64_t>, kHostSyncKindCount> g_totals{};

}  // namespace

std::string_view host_sync_kind_name(HostSyncKind kind) {
  switch (kind) {
    case HostSyncKind::kStreamSynchronize: return "stream synchronize";
    case HostSyncKind::kEventSynchronize: return "event synchronize";
    case HostSyncKind::kDeviceToHostRead: return "device-to-host read";
    case HostSyncKind::kWorkWait: return "work wait";
    case HostSyncKind::kTaskFlowDrain: return "task flow drain";
  }
  return "unknown";
}

void count_host_sync(HostSyncKind kind) {
  ++t_thread_count;
  g_totals[static_cast<size_t>(kind)].fetch_add(1, std::memory_order_relaxed);
  HPS_LOG(kTrace) << "host sync: " << host_sync_kind_name(kind);
  if (trace::enabled()) trace::host_sync(host_sync_kind_name(kind));
}

uint64_t host_sync_count_thread() { return t_thread_count; }

uint64_t host_sync_count_total() {
  uint64_t total = 0;
  for (const auto& c : g_totals) total += c.load(std::memory_order_relaxed);
  return total;
}

uint64_t host_sync_count_total(HostSyncKind kind) {
  return g_totals[static_cast<size_t>(kind)].load(std::memory_order_relaxed);
}

namespace {
std::atomic<uint64_t> g_dependency_waits{0};
std::atomic<uint64_t> g_dependency_nanoseconds{0};
}  // namespace

void count_dependency_wait(uint64_t nanoseconds_blocked) {
  g_dependency_waits.fetch_add(1, std::memory_order_relaxed);
  g_dependency_nanoseconds.fetch_add(nanoseconds_blocked, std::memory_order_relaxed);
  if (trace::enabled()) trace::dependency_wait(nanoseconds_blocked);
}
uint64_t dependency_wait_count() { return g_dependency_waits.load(std::memory_order_relaxed); }
uint64_t dependency_wait_nanoseconds() {
  return g_dependency_nanoseconds.load(std::memory_order_relaxed);
}
void dependency_wait_reset() {
  g_dependency_waits = 0;
  g_dependency_nanoseconds = 0;
}

void host_sync_reset() {
  t_thread_count = 0;
  for (auto& c : g_totals) c.store(0, std::memory_order_relaxed);
}

}  // namespace hps
