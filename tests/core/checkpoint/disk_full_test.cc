// A full disk (run by disk_full_test.sh, which mounts a small tmpfs in a user namespace and
// names it in HPS_CKPT_TEST_SMALL_FS): a save that does not fit fails with a clear error on
// every rank, the previous checkpoint stays intact and loadable, and nothing half-written
// is published.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "core/checkpoint/checkpointer.h"
#include "core/checkpoint/file_io.h"
#include "core/common/config.h"
#include "tests/core/checkpoint/training.h"

namespace hps::ckpt_test {
namespace {

namespace fs = std::filesystem;

TEST(Checkpoint, DiskFullFailsCleanlyAndKeepsThePreviousCheckpoint) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  const char* small = std::getenv("HPS_CKPT_TEST_SMALL_FS");
  ASSERT_NE(small, nullptr) << "run by disk_full_test.sh, on a small tmpfs";
  const std::string root = std::string(small) + "/ckpt";
  testing_util::run_ranks(2, [&](int32_t rank, Communicator& comm) {
    Rank r;
    make_rank(r, rank, comm, {2, 2, 1}, adamw_options(), root);
    if (::testing::Test::HasFatalFailure()) return;
    r.train_step(0);
    ASSERT_TRUE((*r.checkpointer->save("fits"))->wait().ok());
    // Fill the filesystem up to a few hundred bytes.
    if (r.rank == 0) {
      std::ofstream filler(std::string(small) + "/filler", std::ios::binary);
      std::vector<char> block(4096, 'x');
      while (filler.write(block.data(), static_cast<std::streamsize>(block.size())) &&
             filler.flush()) {
      }
    }
    ASSERT_TRUE(r.world->barrier().value()->wait().ok());
    r.train_step(1);
    auto work = r.checkpointer->save("too-big");
    ASSERT_TRUE(work.ok());
    const Status s = (*work)->wait();
    ASSERT_FALSE(s.ok()) << "a save onto a full disk succeeded";
    EXPECT_NE(s.message().find("No space left on device"), std::string::npos) << s.to_string();
    EXPECT_FALSE(ckpt::path_exists(root + "/too-big"));
    EXPECT_EQ(*latest_checkpoint(root), "fits");
    if (r.rank == 0) {
      for (const auto& e : fs::directory_iterator(root)) {
        EXPECT_NE(e.path().filename().string().rfind(".tmp-", 0), 0u) << "left " << e.path();
      }
      EXPECT_TRUE(verify_checkpoint(root + "/fits").ok());
      fs::remove(std::string(small) + "/filler");
    }
    ASSERT_TRUE(r.world->barrier().value()->wait().ok());
    auto loaded = r.checkpointer->load("");
    EXPECT_TRUE(loaded.ok()) << loaded.status().to_string();
  });
}

}  // namespace
}  // namespace hps::ckpt_test
