// A full disk (run by disk_full_test.sh, which mounts a small tmpfs in a user namespace and
// names it in HPS_CKPT_TEST_SMALL_FS): a save that does not fit fails with a clear error on
// every rank, the previous checkpoint stays intact and loadable, and nothing half-written
// is published; a disk out of inodes at any point of a save publishes all of it or none.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

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

// The filesystem's inodes all taken, then freed one at a time, with a save tried after each:
// every save that fails (its temporary directory, a data file, the manifest, the new
// `latest` pointer or the lock finding no inode) publishes nothing and leaves `latest` and
// the previous checkpoint as they were; the first that fits publishes a whole checkpoint.
// A save whose pointer alone found no inode used to publish its checkpoint and fail.
TEST(Checkpoint, ASaveOutOfInodesAnywherePublishesAllOrNothing) {
  if (!HPS_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  const char* small = std::getenv("HPS_CKPT_TEST_SMALL_FS");
  ASSERT_NE(small, nullptr) << "run by disk_full_test.sh, on a small tmpfs";
  const std::string root = std::string(small) + "/inodes";
  const std::string fillers = std::string(small) + "/fillers";
  fs::create_directories(fillers);
  int taken = 0;
  testing_util::run_ranks(2, [&](int32_t rank, Communicator& comm) {
    Rank r;
    make_rank(r, rank, comm, {2, 2, 1}, adamw_options(), root);
    if (::testing::Test::HasFatalFailure()) return;
    r.train_step(0);
    ASSERT_TRUE((*r.checkpointer->save("base"))->wait().ok());
    if (r.rank == 0) {
      for (;; ++taken) {
        const std::string name = fillers + "/" + std::to_string(taken);
        const int fd = ::open(name.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0600);
        if (fd < 0) {
          ASSERT_EQ(errno, ENOSPC) << name;
          break;
        }
        ::close(fd);
      }
    }
    bool published = false;
    for (int freed = 0; freed < 16 && !published; ++freed) {
      ASSERT_TRUE(r.world->barrier().value()->wait().ok());
      if (r.rank == 0 && freed > 0) fs::remove(fillers + "/" + std::to_string(freed - 1));
      ASSERT_TRUE(r.world->barrier().value()->wait().ok());
      const std::string name = "try-" + std::to_string(freed);
      const Status s = (*r.checkpointer->save(name))->wait();
      if (s.ok()) {
        published = true;
        EXPECT_EQ(*latest_checkpoint(root), name);
        if (r.rank == 0) {
          EXPECT_TRUE(verify_checkpoint(root + "/" + name).ok());
        }
        continue;
      }
      EXPECT_NE(s.message().find("No space left on device"), std::string::npos) << s.to_string();
      EXPECT_FALSE(ckpt::path_exists(root + "/" + name)) << "a failed save published " << name;
      EXPECT_EQ(*latest_checkpoint(root), "base") << "after " << name;
      if (r.rank == 0) {
        for (const auto& e : fs::directory_iterator(root)) {
          const std::string n = e.path().filename().string();
          EXPECT_NE(n.rfind(".tmp-", 0), 0u) << "left " << e.path() << " after " << name;
          EXPECT_NE(n.rfind("latest.tmp", 0), 0u) << "left " << e.path() << " after " << name;
        }
      }
    }
    EXPECT_TRUE(published) << "no save fitted in 16 freed inodes";
    if (r.rank == 0) {
      EXPECT_TRUE(verify_checkpoint(root + "/base").ok());
    }
  });
  EXPECT_GT(taken, 0);
  fs::remove_all(fillers);
}

}  // namespace
}  // namespace hps::ckpt_test
