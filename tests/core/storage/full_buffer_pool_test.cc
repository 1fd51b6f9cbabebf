// FullBufferPool: stream-ordered reuse, the budget, and the checked mode that makes a
// stale view of a given-back buffer fault.
#include "core/storage/full_buffer_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstring>
#include <thread>

#include "core/device/cpu/allocator.h"
#include "core/device/cpu/stream.h"
#include "tests/core/comm/comm_test_util.h"

namespace hps {
namespace {

TEST(FullBufferPool, ReusesAGivenBackBufferOnceItsLastUserIsDone) {
  FullBufferPool pool(Device::cpu(), false);
  cpu::CpuStream user;
  auto a = pool.take(4096, user);
  ASSERT_TRUE(a.ok());
  void* first = (*a)->data().get();
  ASSERT_TRUE(pool.give_back(std::move(*a), user).ok());
  ASSERT_TRUE(user.synchronize().ok());
  auto b = pool.take(4096, user);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ((*b)->data().get(), first) << "the same size comes back from the pool";
  EXPECT_EQ(pool.fresh_allocations(), 1u);
  EXPECT_EQ(pool.takes(), 2u);
  auto c = pool.take(8192, user);  // another size: fresh
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(pool.fresh_allocations(), 2u);
  EXPECT_EQ(pool.lent_bytes(), 4096u + 8192u);
  ASSERT_TRUE(pool.give_back(std::move(*b), user).ok());
  ASSERT_TRUE(pool.give_back(std::move(*c), user).ok());
  EXPECT_EQ(pool.lent_bytes(), 0u);
  EXPECT_EQ(pool.pooled_bytes(), 4096u + 8192u);
}

// A buffer whose last user is still running is not handed out while the budget allows a
// fresh one; at the budget it is, and the taker's stream waits for the last user first.
TEST(FullBufferPool, ABusyBufferIsReusedOnlyAfterItsLastUserInTheTakersOrder) {
  FullBufferPool pool(Device::cpu(), false);
  cpu::CpuStream last_user, taker;
  std::atomic<bool> release{false};
  std::atomic<bool> last_user_done{false};
  auto a = pool.take(1024, last_user);
  ASSERT_TRUE(a.ok());
  void* memory = (*a)->data().get();
  last_user.enqueue([&] {
    while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::memset(memory, 1, 1024);
    last_user_done = true;
  });
  ASSERT_TRUE(pool.give_back(std::move(*a), last_user).ok());
  // Under the budget: a fresh buffer, the busy one stays pooled.
  auto fresh = pool.take(1024, taker);
  ASSERT_TRUE(fresh.ok());
  EXPECT_NE((*fresh)->data().get(), memory);
  ASSERT_TRUE(pool.give_back(std::move(*fresh), taker).ok());
  ASSERT_TRUE(taker.synchronize().ok());
  // At the budget: the completed one (the fresh) comes back first.
  pool.set_budget(2048);
  auto again = pool.take(1024, taker);
  ASSERT_TRUE(again.ok());
  EXPECT_NE((*again)->data().get(), memory);
  // Lent 1024 + pooled 1024 (busy) + 1024 asked > 2048: the busy one, after its user.
  auto busy = pool.take(1024, taker);
  ASSERT_TRUE(busy.ok());
  EXPECT_EQ((*busy)->data().get(), memory);
  std::atomic<bool> saw_done{false};
  taker.enqueue([&] { saw_done = last_user_done.load(); });
  release = true;
  ASSERT_TRUE(taker.synchronize().ok());
  EXPECT_TRUE(saw_done) << "the taker's work ran before the last user finished";
  ASSERT_TRUE(last_user.synchronize().ok());
  ASSERT_TRUE(pool.give_back(std::move(*again), taker).ok());
  ASSERT_TRUE(pool.give_back(std::move(*busy), taker).ok());
}

// Over the budget with only a busy buffer of another size pooled: that buffer is freed to
// make room, in the taker's stream order after its last user (no host wait), and its
// memory returns to the allocator only once that user is done.
TEST(FullBufferPool, ABusyBufferOfAnotherSizeIsFreedAfterItsLastUserInTheTakersOrder) {
  auto* allocator = dynamic_cast<cpu::CpuAllocator*>(*allocator_for(Device::cpu()));
  ASSERT_NE(allocator, nullptr);
  FullBufferPool pool(Device::cpu(), false);
  cpu::CpuStream last_user, taker;
  std::atomic<bool> release{false};
  std::atomic<bool> last_user_done{false};
  constexpr size_t kBusy = 64 << 10, kAsked = 32 << 10;
  auto a = pool.take(kBusy, last_user);
  ASSERT_TRUE(a.ok());
  void* memory = (*a)->data().get();
  last_user.enqueue([&] {
    while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::memset(memory, 1, kBusy);
    last_user_done = true;
  });
  ASSERT_TRUE(pool.give_back(std::move(*a), last_user).ok());
  const size_t cached = allocator->cached_bytes();
  pool.set_budget(kBusy + kAsked - 1);  // pooled + asked is over it
  auto b = pool.take(kAsked, taker);
  ASSERT_TRUE(b.ok());
  EXPECT_NE((*b)->data().get(), memory);
  EXPECT_EQ(pool.pooled_bytes(), 0u) << "the busy buffer was not trimmed";
  EXPECT_EQ(pool.lent_bytes(), kAsked);
  EXPECT_EQ(allocator->cached_bytes(), cached) << "freed before its last user finished";
  std::atomic<bool> saw_done{false};
  taker.enqueue([&] { saw_done = last_user_done.load(); });
  release = true;
  ASSERT_TRUE(taker.synchronize().ok());
  EXPECT_TRUE(saw_done) << "the taker's work ran before the freed buffer's last user finished";
  EXPECT_EQ(allocator->cached_bytes(), cached + kBusy) << "the freed buffer is back, cached";
  ASSERT_TRUE(pool.give_back(std::move(*b), taker).ok());
  ASSERT_TRUE(last_user.synchronize().ok());
}

// Over the budget with a completed buffer of another size pooled: it is freed in the
// taker's stream order too, never at once (on CUDA an immediate free is cudaFree, which
// waits for the whole device: a host sync in every stage 3 step whose units differ in size).
TEST(FullBufferPool, ACompletedBufferOfAnotherSizeIsFreedInTheTakersOrder) {
  auto* allocator = dynamic_cast<cpu::CpuAllocator*>(*allocator_for(Device::cpu()));
  ASSERT_NE(allocator, nullptr);
  FullBufferPool pool(Device::cpu(), false);
  cpu::CpuStream last_user, taker;
  constexpr size_t kDone = 96 << 10, kAsked = 16 << 10;
  auto a = pool.take(kDone, last_user);
  ASSERT_TRUE(a.ok());
  void* memory = (*a)->data().get();
  ASSERT_TRUE(pool.give_back(std::move(*a), last_user).ok());
  ASSERT_TRUE(last_user.synchronize().ok());  // completed
  const size_t cached = allocator->cached_bytes();
  pool.set_budget(kDone + kAsked - 1);
  std::atomic<bool> hold{true};
  taker.enqueue([&] {
    while (hold) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  auto b = pool.take(kAsked, taker);
  ASSERT_TRUE(b.ok());
  EXPECT_NE((*b)->data().get(), memory);
  EXPECT_EQ(pool.pooled_bytes(), 0u) << "the completed buffer was not trimmed";
  EXPECT_EQ(allocator->cached_bytes(), cached) << "freed ahead of the taker's order";
  hold = false;
  ASSERT_TRUE(taker.synchronize().ok());
  EXPECT_EQ(allocator->cached_bytes(), cached + kDone)
      << "not freed through the taker's stream (an immediate free)";
  ASSERT_TRUE(pool.give_back(std::move(*b), taker).ok());
  ASSERT_TRUE(taker.synchronize().ok());
}

TEST(FullBufferPoolDeathTest, CheckedModeFaultsAWriteThroughAStaleView) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto stale_write = [] {
    FullBufferPool pool(Device::cpu(), true);
    cpu::CallerStream caller;
    auto a = pool.take(1 << 16, caller);
    if (!a.ok()) std::abort();
    auto* view = static_cast<volatile float*>((*a)->data().get());
    view[0] = 1.0f;  // fine while lent
    if (!pool.give_back(std::move(*a), caller).ok()) std::abort();
    auto b = pool.take(1 << 16, caller);  // the next unit's buffer: never the same memory
    if (!b.ok() || (*b)->data().get() == view) std::abort();
    view[100] = 2.0f;  // through the stale view: must fault
    std::exit(0);
  };
  // A segmentation fault (AddressSanitizer builds report it and exit 1); not an abort.
  EXPECT_EXIT(stale_write(), testing_util::faulted_on_access, "");
}

TEST(FullBufferPool, CheckedModeNeverHandsOutAGivenBackAddress) {
  FullBufferPool pool(Device::cpu(), true);
  ASSERT_TRUE(pool.checked());
  cpu::CallerStream caller;
  std::vector<void*> seen;
  for (int i = 0; i < 20; ++i) {
    auto a = pool.take(4096, caller);
    ASSERT_TRUE(a.ok());
    void* p = (*a)->data().get();
    EXPECT_EQ(std::find(seen.begin(), seen.end(), p), seen.end()) << "address reused";
    seen.push_back(p);
    ASSERT_TRUE(pool.give_back(std::move(*a), caller).ok());
  }
}

TEST(FullBufferPool, DebugViewsVariableIsChecked) {
  ::setenv("HPS_DEBUG_VIEWS", "yes", 1);
  auto bad = debug_views_from_env();
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("HPS_DEBUG_VIEWS"), std::string::npos);
  // A switch as every other: exactly 0 or 1 ("01" was taken for 1, "00" for 0).
  for (const char* value : {"2", "01", "00", " 1"}) {
    ::setenv("HPS_DEBUG_VIEWS", value, 1);
    bad = debug_views_from_env();
    EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument) << value;
    EXPECT_NE(bad.status().message().find("is not 0 or 1"), std::string::npos) << value;
  }
  ::setenv("HPS_DEBUG_VIEWS", "1", 1);
  EXPECT_TRUE(*debug_views_from_env());
  ::unsetenv("HPS_DEBUG_VIEWS");
  EXPECT_FALSE(*debug_views_from_env());
}

}  // namespace
}  // namespace hps
