// The communicator of a CPU group of one rank (core/comm/self): every collective is the
// identity on every dtype, in place and out of place, in stream order after the ready
// stream; point-to-point and bad arguments are refused as on any group; abort() ends the
// queued operations and refuses later ones; split() makes another group of one.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <thread>
#include <vector>

#include "core/comm/self/communicator.h"
#include "core/common/config.h"
#include "core/device/cpu/stream.h"
#include "tests/core/comm/comm_test_util.h"

namespace hps {
namespace {

using self_backend::SelfCommunicator;

std::unique_ptr<Communicator> make(std::string name = "solo") {
  CommOptions o;
  o.name = std::move(name);
  auto c = SelfCommunicator::create(o);
  EXPECT_TRUE(c.ok()) << c.status().to_string();
  return std::move(*c);
}

constexpr DType kAllDTypes[] = {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16,
                                DType::kInt32,   DType::kInt64,   DType::kUInt8};

// Distinct bytes for every element (NaN payloads and negative zeros included for floats:
// the identity keeps them bit for bit).
std::vector<uint8_t> pattern(size_t bytes, uint8_t seed) {
  std::vector<uint8_t> v(bytes);
  for (size_t i = 0; i < bytes; ++i) v[i] = static_cast<uint8_t>(i * 131 + seed * 7 + (i >> 8));
  return v;
}

TEST(SelfCommunicator, DescribesAGroupOfOne) {
  auto c = make("world");
  EXPECT_EQ(c->rank(), 0);
  EXPECT_EQ(c->size(), 1);
  EXPECT_EQ(c->transport(), "self");
  EXPECT_EQ(c->name(), "world");
  EXPECT_TRUE(c->device() == Device::cpu());
  c->set_timeout(Milliseconds(1234));
  EXPECT_EQ(c->timeout(), Milliseconds(1234));
  c->set_timeout(Milliseconds(0));
  EXPECT_EQ(c->timeout(), Milliseconds(1));
  CommOptions bad;
  bad.timeout = Milliseconds(0);
  EXPECT_EQ(SelfCommunicator::create(bad).status().code(), StatusCode::kInvalidArgument);
}

TEST(SelfCommunicator, EveryCollectiveIsTheIdentityOnEveryDtype) {
  auto c = make();
  for (DType dtype : kAllDTypes) {
    for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{1003}}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " count " + std::to_string(count));
      const size_t bytes = count * dtype_size(dtype);
      const std::vector<uint8_t> in = pattern(bytes, static_cast<uint8_t>(count));
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
        std::vector<uint8_t> out(bytes, 0xEE), same = in;
        ASSERT_TRUE((*c->all_reduce(in.data(), out.data(), count, dtype, op))->wait().ok());
        EXPECT_EQ(out, in);
        ASSERT_TRUE((*c->all_reduce(same.data(), same.data(), count, dtype, op))->wait().ok());
        EXPECT_EQ(same, in);
        std::fill(out.begin(), out.end(), 0xEE);
        ASSERT_TRUE((*c->reduce(in.data(), out.data(), count, dtype, op, 0))->wait().ok());
        EXPECT_EQ(out, in);
        std::fill(out.begin(), out.end(), 0xEE);
        ASSERT_TRUE((*c->reduce_scatter(in.data(), out.data(), count, dtype, op))->wait().ok());
        EXPECT_EQ(out, in);
      }
      std::vector<uint8_t> out(bytes, 0xEE), same = in;
      ASSERT_TRUE((*c->all_gather(in.data(), out.data(), count, dtype))->wait().ok());
      EXPECT_EQ(out, in);
      ASSERT_TRUE((*c->all_gather(same.data(), same.data(), count, dtype))->wait().ok());
      EXPECT_EQ(same, in);
      ASSERT_TRUE((*c->broadcast(same.data(), count, dtype, 0))->wait().ok());
      EXPECT_EQ(same, in);
    }
  }
  ASSERT_TRUE((*c->barrier(nullptr))->wait().ok());
}

TEST(SelfCommunicator, RunsAfterTheReadyStreamsWorkAndInCallOrder) {
  auto c = make();
  cpu::CpuStream compute;
  std::atomic<bool> release{false};
  std::vector<float> x(1000, 0.0f), y(1000, -1.0f);
  // The compute stream writes x only after `release`; the all-reduce must read what it wrote.
  compute.enqueue([&] {
    while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::fill(x.begin(), x.end(), 3.5f);
  });
  auto first =
      c->all_reduce(x.data(), y.data(), x.size(), DType::kFloat32, ReduceOp::kSum, &compute);
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  std::vector<float> z(1000, -1.0f);
  auto second = c->all_gather(y.data(), z.data(), y.size(), DType::kFloat32);
  ASSERT_TRUE(second.ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  auto done = (*first)->test();
  ASSERT_TRUE(done.ok());
  EXPECT_FALSE(*done) << "the all-reduce ran before the ready stream's work";
  release = true;
  ASSERT_TRUE((*second)->wait().ok());
  EXPECT_EQ(y, std::vector<float>(1000, 3.5f));
  EXPECT_EQ(z, std::vector<float>(1000, 3.5f));
}

TEST(SelfCommunicator, RefusesPeersRootsAndBuffersAsAnyGroupDoes) {
  auto c = make("solo");
  float v = 1.0f;
  EXPECT_EQ(c->send(&v, 1, DType::kFloat32, 0, nullptr).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(c->recv(&v, 1, DType::kFloat32, 0, nullptr).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_NE(c->send(&v, 1, DType::kFloat32, 1, nullptr).status().code(), StatusCode::kOk);
  EXPECT_NE(c->recv(&v, 1, DType::kFloat32, -1, nullptr).status().code(), StatusCode::kOk);
  EXPECT_NE(c->reduce(&v, &v, 1, DType::kFloat32, ReduceOp::kSum, 1, nullptr).status().code(),
            StatusCode::kOk);
  EXPECT_NE(c->broadcast(&v, 1, DType::kFloat32, 2, nullptr).status().code(), StatusCode::kOk);
  auto null = c->all_reduce(nullptr, &v, 1, DType::kFloat32, ReduceOp::kSum, nullptr);
  EXPECT_EQ(null.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(null.status().message().find("solo"), std::string::npos) << null.status().to_string();
  EXPECT_EQ(c->all_gather(&v, &v, size_t{1} << 62, DType::kFloat32, nullptr).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(
      c->all_reduce(&v, &v, 1, DType::kFloat32, static_cast<ReduceOp>(9), nullptr).status().code(),
      StatusCode::kInvalidArgument);
  // Nothing was queued by the refused calls: the stream is idle and the group still works.
  ASSERT_TRUE((*c->barrier(nullptr))->wait().ok());
}

TEST(SelfCommunicator, AbortEndsQueuedOperationsAndRefusesLaterOnes) {
  auto c = make();
  cpu::CpuStream compute;
  std::atomic<bool> release{false};
  compute.enqueue([&] {
    while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  float x = 2.0f, y = 0.0f;
  auto queued = c->all_reduce(&x, &y, 1, DType::kFloat32, ReduceOp::kSum, &compute);
  ASSERT_TRUE(queued.ok());
  c->abort();
  release = true;
  const Status s = (*queued)->wait();
  EXPECT_EQ(s.code(), StatusCode::kAborted) << s.to_string();
  EXPECT_EQ(y, 0.0f) << "an aborted operation ran";
  EXPECT_EQ(c->barrier(nullptr).status().code(), StatusCode::kAborted);
}

// An operation queued behind a ready stream that does not get there ends ABORTED at the
// abort, while that stream is still blocked (the communicator's stream stops waiting).
TEST(SelfCommunicator, AbortEndsAnOperationWaitingForABlockedReadyStream) {
  auto c = make();
  cpu::CpuStream compute;
  std::promise<void> release;
  auto released = release.get_future().share();
  compute.enqueue([released] { released.wait(); });
  float x = 2.0f, y = 0.0f;
  auto queued = c->all_reduce(&x, &y, 1, DType::kFloat32, ReduceOp::kSum, &compute);
  ASSERT_TRUE(queued.ok());
  EXPECT_FALSE(*(*queued)->test());
  c->abort();
  auto ended = (*queued)->wait_for(std::chrono::seconds(1));
  release.set_value();
  EXPECT_EQ(ended.status().code(), StatusCode::kAborted)
      << (ended.ok() ? "still pending 1 s after the abort: it waited for the ready stream"
                     : ended.status().to_string());
  EXPECT_EQ((*queued)->wait().code(), StatusCode::kAborted);
  EXPECT_EQ(y, 0.0f) << "an aborted operation ran";
  EXPECT_TRUE(compute.synchronize().ok());
}

TEST(SelfCommunicator, SplitMakesAnotherGroupOfOne) {
  auto c = make("world");
  c->set_timeout(Milliseconds(4321));
  auto child = c->split({0}, "sharding");
  ASSERT_TRUE(child.ok()) << child.status().to_string();
  ASSERT_NE(*child, nullptr);
  EXPECT_EQ((*child)->name(), "sharding");
  EXPECT_EQ((*child)->size(), 1);
  EXPECT_EQ((*child)->timeout(), Milliseconds(4321));
  int64_t v = 5, w = 0;
  ASSERT_TRUE((*(*child)->all_reduce(&v, &w, 1, DType::kInt64, ReduceOp::kSum))->wait().ok());
  EXPECT_EQ(w, 5);
  EXPECT_EQ(c->split({}, "none").status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(c->split({1}, "other").status().code(), StatusCode::kOk);
  EXPECT_EQ(c->split({0, 0}, "twice").status().code(), StatusCode::kInvalidArgument);
}

TEST(SelfCommunicator, IsWhatAGroupOfOneGetsWithoutGloo) {
  auto comm = create_communicator(make_in_memory_store(), 0, 1, Device::cpu());
  ASSERT_TRUE(comm.ok()) << comm.status().to_string();
  EXPECT_EQ((*comm)->transport(), HPS_HAVE_GLOO ? "tcp" : "self");
  if (!HPS_HAVE_GLOO) {
    EXPECT_EQ(create_communicator(make_in_memory_store(), 0, 2, Device::cpu()).status().code(),
              StatusCode::kUnavailable);
  }
}

}  // namespace
}  // namespace hps
