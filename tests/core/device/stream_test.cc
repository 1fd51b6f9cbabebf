// CPU streams and events: ordering, cross-stream waits that do not block the host,
// and the host-sync counter. CUDA streams are covered by cuda_stream_test (label gpu).
#include "core/device/stream.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <future>
#include <limits>
#include <numeric>
#include <stop_token>
#include <thread>
#include <vector>

#include "core/device/cpu/stream.h"
#include "core/device/host_sync.h"

namespace hps {
namespace {

std::unique_ptr<Stream> make_stream() {
  auto s = create_stream(Device::cpu());
  EXPECT_TRUE(s.ok()) << s.status().to_string();
  return std::move(s).value();
}

std::unique_ptr<Event> make_event() {
  auto e = create_event(Device::cpu());
  EXPECT_TRUE(e.ok()) << e.status().to_string();
  return std::move(e).value();
}

TEST(CpuStream, RunsTasksInOrderOffTheCallingThread) {
  auto stream = make_stream();
  auto& cpu = static_cast<cpu::CpuStream&>(*stream);
  std::vector<int> order;
  std::thread::id worker_id;
  for (int i = 0; i < 100; ++i) {
    cpu.enqueue([&order, &worker_id, i] {
      order.push_back(i);
      worker_id = std::this_thread::get_id();
    });
  }
  ASSERT_TRUE(stream->synchronize().ok());
  std::vector<int> expected(100);
  std::iota(expected.begin(), expected.end(), 0);
  EXPECT_EQ(order, expected);
  EXPECT_NE(worker_id, std::this_thread::get_id());
}

TEST(CpuStream, EnqueueDoesNotBlockTheHost) {
  auto stream = make_stream();
  auto& cpu = static_cast<cpu::CpuStream&>(*stream);
  std::promise<void> release;
  auto released = release.get_future().share();
  cpu.enqueue([released] { released.wait(); });  // the worker is now busy
  auto event = make_event();
  std::vector<char> src(1 << 20, 'x'), dst(1 << 20, 0);
  // Nothing here may block while the worker is stuck.
  ASSERT_TRUE(stream->memcpy_async(dst.data(), src.data(), src.size()).ok());
  ASSERT_TRUE(event->record(*stream).ok());
  auto done = event->query();
  ASSERT_TRUE(done.ok());
  EXPECT_FALSE(*done);
  release.set_value();
  ASSERT_TRUE(event->synchronize().ok());
  EXPECT_TRUE(*event->query());
  EXPECT_EQ(dst, src);
}

TEST(CpuStream, AWaitingThreadRunsTheQueueUpToItsMarkInOrderAndNoFurther) {
  // Tasks enqueued while the worker is idle may run on the thread that waits for them,
  // in order, one at a time, and never past the awaited mark.
  auto stream = make_stream();
  auto& cpu = static_cast<cpu::CpuStream&>(*stream);
  for (int round = 0; round < 200; ++round) {
    std::vector<int> order;
    std::atomic<int> running{0};
    std::atomic<bool> overlapped{false};
    auto task = [&](int i) {
      return [&, i] {
        if (running.fetch_add(1) != 0) overlapped = true;
        order.push_back(i);
        running.fetch_sub(1);
      };
    };
    for (int i = 0; i < 5; ++i) cpu.enqueue(task(i));
    auto event = make_event();
    ASSERT_TRUE(event->record(*stream).ok());
    std::promise<void> release;
    auto released = release.get_future().share();
    std::atomic<bool> after_ran{false};
    cpu.enqueue([released, &after_ran] {
      released.wait();
      after_ran = true;
    });
    // Returns although the task after the mark blocks until released: the waiting
    // thread did not take that one (nor wait for it).
    ASSERT_TRUE(event->synchronize().ok());
    EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4}));
    EXPECT_FALSE(overlapped) << "two tasks of one stream ran at once";
    EXPECT_FALSE(after_ran);
    release.set_value();
    ASSERT_TRUE(stream->synchronize().ok());
    EXPECT_TRUE(after_ran);
  }
}

TEST(CpuStream, EnqueueThenWaitMostlyRunsOnTheWaitingThread) {
  // The point of helping: an enqueue followed at once by a wait needs no hand-off to the
  // worker and back. The worker is woken too and may win the race now and then.
  auto stream = make_stream();
  auto& cpu = static_cast<cpu::CpuStream&>(*stream);
  const auto me = std::this_thread::get_id();
  int on_waiter = 0;
  constexpr int kRounds = 1000;
  for (int i = 0; i < kRounds; ++i) {
    std::thread::id ran_on;
    cpu.enqueue([&ran_on] { ran_on = std::this_thread::get_id(); });
    auto event = make_event();
    ASSERT_TRUE(event->record(*stream).ok());
    ASSERT_TRUE(event->synchronize().ok());
    if (ran_on == me) ++on_waiter;
  }
  EXPECT_GT(on_waiter, 0) << "no task ever ran on the waiting thread";
  std::printf("%d of %d tasks ran on the waiting thread\n", on_waiter, kRounds);
}

TEST(CpuStream, DestroyingAStreamWhileAWaiterRunsItsTaskDoesNotHang) {
  // The destructor waits for the worker, and the worker for the task a helping waiter
  // runs: the waiter must wake the worker when it is done.
  for (int round = 0; round < 50; ++round) {
    auto stream = make_stream();
    auto& cpu = static_cast<cpu::CpuStream&>(*stream);
    std::promise<void> release;
    auto released = release.get_future().share();
    cpu.enqueue([released] { released.wait(); });
    auto event = make_event();
    ASSERT_TRUE(event->record(*stream).ok());
    std::thread waiter([&] { ASSERT_TRUE(event->synchronize().ok()); });
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    auto destroyed = std::async(std::launch::async, [&] { stream.reset(); });
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    release.set_value();
    ASSERT_EQ(destroyed.wait_for(std::chrono::seconds(10)), std::future_status::ready)
        << "the stream's destructor hung (round " << round << ")";
    waiter.join();
  }
}

TEST(CpuStream, WaitersAndTheWorkerNeverRunTwoTasksAtOnce) {
  auto stream = make_stream();
  auto& cpu = static_cast<cpu::CpuStream&>(*stream);
  std::atomic<int> running{0};
  std::atomic<bool> overlapped{false};
  std::vector<int> order;
  constexpr int kTasks = 3000;
  std::vector<std::unique_ptr<Event>> events;
  for (int i = 0; i < kTasks; ++i) {
    cpu.enqueue([&, i] {
      if (running.fetch_add(1) != 0) overlapped = true;
      order.push_back(i);
      running.fetch_sub(1);
    });
    if (i % 10 == 9) {
      events.push_back(make_event());
      ASSERT_TRUE(events.back()->record(*stream).ok());
    }
  }
  // Two waiting threads and the worker all compete for the queue.
  std::thread other([&] {
    for (size_t e = events.size(); e-- > 0;) ASSERT_TRUE(events[e]->synchronize().ok());
  });
  for (auto& e : events) ASSERT_TRUE(e->synchronize().ok());
  other.join();
  ASSERT_TRUE(stream->synchronize().ok());
  EXPECT_FALSE(overlapped);
  std::vector<int> expected(kTasks);
  std::iota(expected.begin(), expected.end(), 0);
  EXPECT_EQ(order, expected);
}

TEST(CpuStream, WaitOrdersWorkAcrossStreams) {
  auto producer = make_stream();
  auto consumer = make_stream();
  auto ready = make_event();
  std::promise<void> release;
  auto released = release.get_future().share();
  std::atomic<int> value{0};
  static_cast<cpu::CpuStream&>(*producer).enqueue([released, &value] {
    released.wait();
    value = 42;
  });
  ASSERT_TRUE(ready->record(*producer).ok());
  ASSERT_TRUE(consumer->wait(*ready).ok());  // returns at once: the host does not block
  int seen = -1;
  static_cast<cpu::CpuStream&>(*consumer).enqueue([&] { seen = value.load(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(seen, -1) << "the consumer ran before the producer's event";
  release.set_value();
  ASSERT_TRUE(consumer->synchronize().ok());
  EXPECT_EQ(seen, 42);
}

// An operation that failed, waited for with its outcome: a CPU stream reports the failure
// from synchronize() (and keeps it), the calling thread's stream returns it from the wait;
// an operation that succeeded changes nothing.
TEST(CpuStream, AWaitedOutcomeThatFailedIsTheStreamsError) {
  auto producer = make_stream();
  auto done = make_event();
  ASSERT_TRUE(done->record(*producer).ok());
  auto ok = [] { return Status::Ok(); };
  auto failed = [] { return timeout_error("all_reduce #3 on group 'g': timed out"); };

  auto consumer = make_stream();
  ASSERT_TRUE(consumer->wait_for_outcome(*done, ok).ok());
  EXPECT_TRUE(consumer->synchronize().ok());
  ASSERT_TRUE(consumer->wait_for_outcome(*done, failed).ok()) << "the host does not wait";
  std::atomic<bool> ran{false};
  static_cast<cpu::CpuStream&>(*consumer).enqueue([&] { ran = true; });
  Status s = consumer->synchronize();
  EXPECT_EQ(s.code(), StatusCode::kTimeout) << s.to_string();
  EXPECT_NE(s.message().find("all_reduce #3"), std::string::npos);
  EXPECT_TRUE(ran) << "later work still runs; the error tells what it ran on";
  EXPECT_TRUE(consumer->synchronize().ok()) << "reported once: the stream starts afresh";

  cpu::CallerStream caller;
  EXPECT_TRUE(caller.wait_for_outcome(*done, ok).ok());
  EXPECT_EQ(caller.wait_for_outcome(*done, failed).code(), StatusCode::kTimeout);
  EXPECT_TRUE(caller.synchronize().ok());
}

// A wait given a stop token ends when the stop is requested, with the event still
// pending: work enqueued after it runs then, not when the event's stream gets there. An
// event already complete adds no wait.
TEST(CpuStream, AWaitEndsWhenItsStopIsRequested) {
  using namespace std::chrono_literals;
  auto producer = make_stream();
  auto consumer = std::make_unique<cpu::CpuStream>();
  std::promise<void> release;
  auto released = release.get_future().share();
  static_cast<cpu::CpuStream&>(*producer).enqueue([released] { released.wait(); });
  auto ready = make_event();
  ASSERT_TRUE(ready->record(*producer).ok());
  std::stop_source stop;
  ASSERT_TRUE(consumer->wait(*ready, stop.get_token()).ok());
  auto after = make_event();
  ASSERT_TRUE(after->record(*consumer).ok());
  EXPECT_FALSE(*after->wait_for(30ms)) << "the consumer ran before the producer's event";
  stop.request_stop();
  EXPECT_TRUE(*after->wait_for(5s)) << "the stop did not end the wait";
  EXPECT_FALSE(*ready->query());
  // A stop requested before the wait starts ends it at once too.
  auto again = make_event();
  ASSERT_TRUE(consumer->wait(*ready, stop.get_token()).ok());
  ASSERT_TRUE(again->record(*consumer).ok());
  EXPECT_TRUE(*again->wait_for(5s));
  release.set_value();
  ASSERT_TRUE(ready->synchronize().ok());
  // Without a stop, the wait lasts until the event completes.
  static_cast<cpu::CpuStream&>(*producer).enqueue([] { std::this_thread::sleep_for(30ms); });
  ASSERT_TRUE(ready->record(*producer).ok());
  ASSERT_TRUE(consumer->wait(*ready, std::stop_token()).ok());
  ASSERT_TRUE(after->record(*consumer).ok());
  ASSERT_TRUE(after->synchronize().ok());
  EXPECT_TRUE(*ready->query());
}

TEST(CpuEvent, ReRecordingMovesTheMark) {
  auto stream = make_stream();
  auto event = make_event();
  EXPECT_FALSE(event->recorded());
  ASSERT_TRUE(event->record(*stream).ok());
  ASSERT_TRUE(event->synchronize().ok());
  std::promise<void> release;
  auto released = release.get_future().share();
  static_cast<cpu::CpuStream&>(*stream).enqueue([released] { released.wait(); });
  ASSERT_TRUE(event->record(*stream).ok());
  EXPECT_FALSE(*event->query()) << "the query refers to the newest record";
  release.set_value();
  ASSERT_TRUE(event->synchronize().ok());
  EXPECT_TRUE(*event->query());
}

// A timed wait on a CPU event returns false after its timeout while the mark is pending,
// without running the stream's task itself (one may block for long), and true once the
// worker completes it; uncounted (Work::wait_for counts).
TEST(CpuEvent, WaitForEndsAtItsTimeoutOrWhenTheMarkCompletes) {
  using namespace std::chrono_literals;
  auto stream = make_stream();
  auto event = make_event();
  EXPECT_EQ(event->wait_for(1ms).status().code(), StatusCode::kFailedPrecondition);
  std::promise<void> release;
  auto released = release.get_future().share();
  std::atomic<bool> ran_here{false};
  const auto me = std::this_thread::get_id();
  static_cast<cpu::CpuStream&>(*stream).enqueue([released, &ran_here, me] {
    if (std::this_thread::get_id() == me) ran_here = true;
    released.wait();
  });
  ASSERT_TRUE(event->record(*stream).ok());
  host_sync_reset();
  const auto start = std::chrono::steady_clock::now();
  auto pending = event->wait_for(30ms);
  ASSERT_TRUE(pending.ok());
  EXPECT_FALSE(*pending);
  EXPECT_GE(std::chrono::steady_clock::now() - start, 25ms);
  EXPECT_FALSE(ran_here.load());
  std::thread releaser([&] {
    std::this_thread::sleep_for(20ms);
    release.set_value();
  });
  auto done = event->wait_for(60s);
  releaser.join();
  ASSERT_TRUE(done.ok());
  EXPECT_TRUE(*done);
  EXPECT_EQ(host_sync_count_thread(), 0u);
}

// Events without a wait of their own (CUDA's) poll query() until the timeout.
TEST(Event, TheDefaultWaitForPollsTheQuery) {
  using namespace std::chrono_literals;
  class Polled final : public Event {
   public:
    int queries = 0;
    int complete_at = 0;  // 0: never
    Device device() const override { return Device::cpu(); }
    Status record(Stream&) override { return Status::Ok(); }
    StatusOr<bool> query() override {
      ++queries;
      return complete_at != 0 && queries >= complete_at;
    }
    Status synchronize() override { return Status::Ok(); }
    Status synchronize_uncounted() override { return Status::Ok(); }
    bool recorded() const override { return true; }
  };
  Polled never;
  const auto start = std::chrono::steady_clock::now();
  auto pending = never.wait_for(20ms);
  ASSERT_TRUE(pending.ok());
  EXPECT_FALSE(*pending);
  EXPECT_GE(std::chrono::steady_clock::now() - start, 20ms);
  EXPECT_GT(never.queries, 1);
  EXPECT_LT(never.queries, 1000) << "the polls back off";
  Polled soon;
  soon.complete_at = 5;
  auto done = soon.wait_for(60s);
  ASSERT_TRUE(done.ok());
  EXPECT_TRUE(*done);
  EXPECT_EQ(soon.queries, 5);
}

TEST(CpuEvent, NeverRecordedIsAPreconditionError) {
  auto stream = make_stream();
  auto event = make_event();
  host_sync_reset();
  EXPECT_EQ(stream->wait(*event).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(event->synchronize().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(event->query().status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(host_sync_count_thread(), 0u) << "a refused call must not count a sync";
}

TEST(CpuStream, MemcpyRejectsNullWithBytes) {
  auto stream = make_stream();
  char buffer[4] = {};
  EXPECT_EQ(stream->memcpy_async(nullptr, buffer, 4).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(stream->memcpy_async(buffer, nullptr, 4).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(stream->memcpy_async(nullptr, nullptr, 0).ok());
}

// Regions that overlap, or run past the end of the address space, are refused with nothing
// enqueued (they reached std::memcpy on the stream's thread: ASan's memcpy-param-overlap).
TEST(CpuStream, MemcpyRejectsOverlappingAndWrappingRegions) {
  auto stream = make_stream();
  char buffer[16] = {1, 2, 3, 4, 5, 6, 7, 8};
  const Status overlap = stream->memcpy_async(buffer + 2, buffer, 8);
  EXPECT_EQ(overlap.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(overlap.message().find("overlap"), std::string::npos) << overlap.message();
  EXPECT_EQ(stream->memcpy_async(buffer, buffer, 4).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(stream->memcpy_async(buffer, buffer + 2, 4).code(), StatusCode::kInvalidArgument);
  auto* top = reinterpret_cast<char*>(std::numeric_limits<uintptr_t>::max() - 3);
  const Status wraps = stream->memcpy_async(buffer, top, 8);
  EXPECT_EQ(wraps.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(wraps.message().find("past the end of the address space"), std::string::npos)
      << wraps.message();
  // Adjacent regions are apart.
  ASSERT_TRUE(stream->memcpy_async(buffer + 8, buffer, 8).ok());
  ASSERT_TRUE(stream->synchronize().ok());
  EXPECT_EQ(buffer[8], 1);
  EXPECT_EQ(buffer[15], 8);
}

TEST(CpuStream, DestructorFinishesQueuedWork) {
  std::atomic<int> ran{0};
  {
    auto stream = make_stream();
    for (int i = 0; i < 10; ++i) {
      static_cast<cpu::CpuStream&>(*stream).enqueue([&ran] {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        ++ran;
      });
    }
  }
  EXPECT_EQ(ran.load(), 10);
}

TEST(Device, InvalidDevicesAreRefused) {
  EXPECT_EQ(create_stream({DeviceType::kCpu, 1}).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(create_event({DeviceType::kCpu, -1}).status().code(), StatusCode::kOutOfRange);
  const int32_t cuda_count = device_count(DeviceType::kCuda);
  auto s = create_stream(Device::cuda(cuda_count));
  EXPECT_EQ(s.status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(s.status().message().find("cuda:" + std::to_string(cuda_count)), std::string::npos);
}

TEST(Device, ParseAndProperties) {
  EXPECT_EQ(*parse_device("cpu"), Device::cpu());
  EXPECT_EQ(*parse_device("cuda:3"), Device::cuda(3));
  EXPECT_EQ(parse_device("cuda:x").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(parse_device("tpu:0").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(parse_device("cpu:1").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(device_type_from_int(5).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(device_count(DeviceType::kCpu), 1);
  auto p = device_properties(Device::cpu());
  ASSERT_TRUE(p.ok());
  EXPECT_GT(p->total_memory_bytes, 0u);
  EXPECT_GT(p->multiprocessor_count, 0);
  EXPECT_EQ(p->name.rfind("cpu", 0), 0u);
}

}  // namespace
}  // namespace hps
