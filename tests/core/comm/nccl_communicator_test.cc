// The CUDA (NCCL) communicator at world size 1 on a real GPU. Label gpu: skipped with a
// reason where no CUDA device or no loadable NCCL is present.
#include <gtest/gtest.h>

#include <memory>
#include <numeric>
#include <vector>

#include "core/comm/communicator.h"
#include "core/device/allocator.h"
#include "core/device/host_sync.h"

namespace hps {
namespace {

class NcclCommunicatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (device_count(DeviceType::kCuda) == 0) {
      GTEST_SKIP() << "no usable CUDA device (or hpshard built without CUDA)";
    }
    CommOptions options;
    options.timeout = std::chrono::seconds(30);  // below ctest's timeout: a hang fails here
    auto c = create_communicator(make_in_memory_store(), 0, 1, Device::cuda(0), options);
    if (c.status().code() == StatusCode::kUnavailable) {
      GTEST_SKIP() << c.status().message();
    }
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    comm_ = std::move(c).value();
  }
  std::unique_ptr<Communicator> comm_;
};

TEST_F(NcclCommunicatorTest, CollectivesAtWorldSizeOneWithoutHostSyncs) {
  const Device gpu = Device::cuda(0);
  auto allocator = std::move(allocator_for(gpu)).value();
  auto stream = std::move(create_stream(gpu)).value();
  const size_t n = 1 << 20;
  std::vector<float> host(n), back(n, 0.0f);
  std::iota(host.begin(), host.end(), 1.0f);
  void* a = std::move(allocator->allocate(n * sizeof(float))).value();
  void* b = std::move(allocator->allocate(n * sizeof(float))).value();
  ASSERT_TRUE(stream->memcpy_async(a, host.data(), n * sizeof(float)).ok());
  host_sync_reset();
  // Each operation waits for the upload on `stream`, device-side; the host never blocks.
  auto w1 = comm_->all_reduce(a, b, n, DType::kFloat32, ReduceOp::kSum, stream.get());
  ASSERT_TRUE(w1.ok()) << w1.status().to_string();
  auto w2 = comm_->all_gather(b, a, n, DType::kFloat32, stream.get());
  ASSERT_TRUE(w2.ok());
  auto w3 = comm_->reduce_scatter(a, b, n, DType::kFloat32, ReduceOp::kAvg, stream.get());
  ASSERT_TRUE(w3.ok());
  auto w4 = comm_->broadcast(b, n, DType::kFloat32, 0, stream.get());
  ASSERT_TRUE(w4.ok());
  ASSERT_TRUE((*w4)->wait_on(*stream).ok());
  ASSERT_TRUE(stream->memcpy_async(back.data(), b, n * sizeof(float)).ok());
  EXPECT_EQ(host_sync_count_thread(), 0u) << "enqueueing collectives must not block the host";
  ASSERT_TRUE(stream->synchronize().ok());
  EXPECT_EQ(back, host);
  ASSERT_TRUE((*w4)->wait().ok());
  auto barrier = comm_->barrier(stream.get());
  ASSERT_TRUE(barrier.ok());
  ASSERT_TRUE((*barrier)->wait().ok());
  allocator->deallocate(a);
  allocator->deallocate(b);
}

TEST_F(NcclCommunicatorTest, BadInputIsRefused) {
  float* none = nullptr;
  EXPECT_EQ(comm_->broadcast(none, 0, DType::kFloat32, 1).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(comm_->all_reduce(nullptr, nullptr, 4, DType::kFloat32, ReduceOp::kSum).status().code(),
            StatusCode::kInvalidArgument);
}

TEST_F(NcclCommunicatorTest, SplitMakesAWorkingChild) {
  auto child = comm_->split({0}, "child");
  ASSERT_TRUE(child.ok()) << child.status().to_string();
  ASSERT_NE(*child, nullptr);
  EXPECT_EQ((*child)->name(), "child");
  EXPECT_EQ((*child)->size(), 1);
  auto barrier = (*child)->barrier(nullptr);
  ASSERT_TRUE(barrier.ok()) << barrier.status().to_string();
  EXPECT_TRUE((*barrier)->wait().ok());
}

TEST_F(NcclCommunicatorTest, AbortEndsLaterOperations) {
  comm_->abort();
  float* none = nullptr;
  EXPECT_EQ(comm_->all_reduce(none, none, 0, DType::kFloat32, ReduceOp::kSum).status().code(),
            StatusCode::kAborted);
}

// Communicator::link_failures over NCCL groups: a fail() of one ends the linked other (its
// handle aborted, later operations ABORTED naming the first), a group outside the link goes
// on; and a handle aborted underneath (an abort of the group) reaches the link too.
TEST_F(NcclCommunicatorTest, AFailureReachesTheLinkedGroupsOnly) {
  auto split = [&](const char* name) {
    auto part = comm_->split({0}, name);
    EXPECT_TRUE(part.ok() && *part) << part.status().to_string();
    return std::shared_ptr<Communicator>(std::move(*part));
  };
  auto a = split("a"), b = split("b"), outside = split("outside"), c = split("c"), d = split("d");
  float* none = nullptr;
  auto all_reduce = [&](Communicator& g) {
    auto w = g.all_reduce(none, none, 0, DType::kFloat32, ReduceOp::kSum);
    return w.ok() ? (*w)->wait() : w.status();
  };
  auto link = Communicator::link_failures({a.get(), b.get()}, "test");
  a->fail(internal_error("injected"));
  const Status on_b = all_reduce(*b);
  EXPECT_EQ(on_b.code(), StatusCode::kAborted) << on_b.to_string();
  EXPECT_NE(on_b.message().find("fails with group 'a': injected"), std::string::npos)
      << on_b.to_string();
  EXPECT_TRUE(all_reduce(*outside).ok());
  auto other = Communicator::link_failures({c.get(), d.get()}, "test");
  c->abort();
  EXPECT_EQ(all_reduce(*d).code(), StatusCode::kAborted);
}

}  // namespace
}  // namespace hps
