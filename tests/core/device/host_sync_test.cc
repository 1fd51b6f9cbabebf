#include "core/device/host_sync.h"

#include <gtest/gtest.h>

#include <thread>

#include "core/device/stream.h"

namespace hps {
namespace {

TEST(HostSync, CountsPerThreadAndInTotal) {
  host_sync_reset();
  count_host_sync(HostSyncKind::kDeviceToHostRead);
  count_host_sync(HostSyncKind::kWorkWait);
  uint64_t other_thread_count = 0;
  std::thread other([&] {
    count_host_sync(HostSyncKind::kWorkWait);
    other_thread_count = host_sync_count_thread();
  });
  other.join();
  EXPECT_EQ(host_sync_count_thread(), 2u);
  EXPECT_EQ(other_thread_count, 1u);
  EXPECT_EQ(host_sync_count_total(), 3u);
  EXPECT_EQ(host_sync_count_total(HostSyncKind::kWorkWait), 2u);
  EXPECT_EQ(host_sync_count_total(HostSyncKind::kTaskFlowDrain), 0u);
  host_sync_reset();
  EXPECT_EQ(host_sync_count_thread(), 0u);
  EXPECT_EQ(host_sync_count_total(), 0u);
}

TEST(HostSync, OnlyBlockingCallsCount) {
  auto stream = std::move(create_stream(Device::cpu())).value();
  auto event = std::move(create_event(Device::cpu())).value();
  host_sync_reset();
  char a[64] = {1}, b[64] = {};
  ASSERT_TRUE(stream->memcpy_async(b, a, sizeof a).ok());
  ASSERT_TRUE(event->record(*stream).ok());
  ASSERT_TRUE(stream->wait(*event).ok());
  ASSERT_TRUE(event->query().ok());
  EXPECT_EQ(host_sync_count_thread(), 0u) << "enqueue, record, wait and query never block";
  ASSERT_TRUE(event->synchronize().ok());
  EXPECT_EQ(host_sync_count_total(HostSyncKind::kEventSynchronize), 1u);
  ASSERT_TRUE(stream->synchronize().ok());
  EXPECT_EQ(host_sync_count_total(HostSyncKind::kStreamSynchronize), 1u);
  EXPECT_EQ(host_sync_count_thread(), 2u);
}

}  // namespace
}  // namespace hps
