// Task flows over CPU streams: callbacks only after completion and in order, buffers kept
// alive until then, stream-side waits, and the counted drain.
#include "core/flow/task_flow.h"

#include <gtest/gtest.h>

#include <future>
#include <vector>

#include "core/device/cpu/stream.h"
#include "core/device/host_sync.h"

namespace hps {
namespace {

// A Work that completes when `release` is set, on its own stream.
std::shared_ptr<Work> gated_work(cpu::CpuStream& stream, std::shared_future<void> release,
                                 Status outcome = Status::Ok()) {
  auto work = std::make_shared<Work>("gated", std::make_unique<cpu::CpuEvent>());
  stream.enqueue([work, release, outcome] {
    release.wait();
    work->set_status(outcome);
  });
  EXPECT_TRUE(work->done_event().record(stream).ok());
  return work;
}

TEST(TaskFlow, CallbacksRunOnlyAfterCompletionAndInOrder) {
  cpu::CpuStream a, b;
  std::promise<void> first_gate, second_gate;
  auto first_released = first_gate.get_future().share();
  auto second_released = second_gate.get_future().share();
  TaskFlow flow;
  std::vector<int> order;
  auto buffer = std::make_shared<std::vector<float>>(1000, 1.0f);
  std::weak_ptr<std::vector<float>> watch = buffer;
  ASSERT_TRUE(flow.add({gated_work(a, first_released),
                        {buffer},
                        [&](const Status& s) {
                          EXPECT_TRUE(s.ok());
                          order.push_back(1);
                        }})
                  .ok());
  buffer.reset();
  ASSERT_TRUE(
      flow.add({gated_work(b, second_released), {}, [&](const Status&) { order.push_back(2); }})
          .ok());
  EXPECT_EQ(*flow.poll(), 0u);
  EXPECT_TRUE(order.empty());
  EXPECT_FALSE(watch.expired()) << "the task keeps its buffer alive";
  // The second finishes first: its callback must still wait for the first's.
  second_gate.set_value();
  ASSERT_TRUE(b.synchronize().ok());
  EXPECT_EQ(*flow.poll(), 0u);
  EXPECT_TRUE(order.empty());
  first_gate.set_value();
  ASSERT_TRUE(a.synchronize().ok());
  EXPECT_EQ(*flow.poll(), 2u);
  EXPECT_EQ(order, (std::vector<int>{1, 2}));
  EXPECT_TRUE(watch.expired()) << "released once the task completed";
  EXPECT_EQ(flow.pending(), 0u);
}

TEST(TaskFlow, StreamWaitsDoNotBlockTheHostAndDrainIsCounted) {
  cpu::CpuStream producer, consumer;
  std::promise<void> gate;
  auto released = gate.get_future().share();
  TaskFlow flow;
  Status seen;
  ASSERT_TRUE(flow.add({gated_work(producer, released, aborted("peer left")),
                        {},
                        [&](const Status& s) { seen = s; }})
                  .ok());
  host_sync_reset();
  ASSERT_TRUE(flow.wait(consumer).ok());
  int ran = 0;
  consumer.enqueue([&] { ran = 1; });
  EXPECT_EQ(host_sync_count_thread(), 0u);
  gate.set_value();
  Status s = flow.drain();
  EXPECT_EQ(s.code(), StatusCode::kAborted) << "drain reports the failure";
  EXPECT_EQ(seen.code(), StatusCode::kAborted) << "and so does the callback";
  EXPECT_EQ(host_sync_count_total(HostSyncKind::kTaskFlowDrain), 1u);
  EXPECT_EQ(consumer.synchronize().code(), StatusCode::kAborted)
      << "the stream that waited for the failed task reports it too";
  EXPECT_EQ(ran, 1);
  EXPECT_TRUE(flow.drain().ok()) << "an empty drain";
  EXPECT_EQ(flow.add({nullptr, {}, {}}).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hps
