// Shared-memory segments leave no name in /dev/shm: not when setting up fails, not when a
// process that made one was killed (the next group removes it), not for a slot size that
// does not fit (refused before anything is made).
#include "core/comm/shm/shm_group.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "core/comm/host.h"

namespace hps::shm {
namespace {

// Names in /dev/shm made by this process (their pid field is ours).
std::vector<std::string> own_segments() {
  std::vector<std::string> names;
  const std::string mine =
      "-" + std::to_string(host::pid_namespace()) + "-" + std::to_string(::getpid()) + "-";
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("hpshard-", 0) == 0 && name.find(mine) != std::string::npos) {
      names.push_back(name);
    }
  }
  return names;
}

// A segment file as a killed process would leave it.
std::string make_segment(const std::string& job, int32_t pid, int n) {
  const std::string name = "/hpshard-" + segment_job_tag(job) + "-" +
                           std::to_string(host::pid_namespace()) + "-" + std::to_string(pid) + "-" +
                           std::to_string(n) + "-abc";
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  EXPECT_GE(fd, 0) << name;
  if (fd >= 0) ::close(fd);
  return name.substr(1);
}

bool exists(const std::string& name) { return std::filesystem::exists("/dev/shm/" + name); }

// Rank 0 used to return before unlinking when a peer never came: one leaked segment per try.
TEST(ShmGroup, SettingUpThatFailsLeavesNoSegment) {
  ASSERT_TRUE(own_segments().empty());
  auto store = make_in_memory_store();
  auto group =
      ShmGroup::create(*store, 0, 2, true, kDefaultSlotBytes, std::chrono::milliseconds(200));
  ASSERT_FALSE(group.ok());
  EXPECT_EQ(group.status().code(), StatusCode::kTimeout);
  EXPECT_TRUE(own_segments().empty()) << "left: " << own_segments()[0];
}

// `n` (default two) thread ranks over one in-memory store; what each one's create returned.
std::vector<StatusOr<std::unique_ptr<ShmGroup>>> create_pair(bool direct, int32_t n = 2) {
  std::vector<StatusOr<std::unique_ptr<ShmGroup>>> made;
  for (int i = 0; i < n; ++i) made.emplace_back(unavailable("not made"));
  auto store = make_in_memory_store();
  std::vector<std::thread> ranks;
  for (int32_t r = 0; r < n; ++r) {
    ranks.emplace_back([&, r] {
      made[static_cast<size_t>(r)] =
          ShmGroup::create(*store, r, n, true, kDefaultSlotBytes, std::chrono::seconds(10), direct);
    });
  }
  for (auto& t : ranks) t.join();
  return made;
}

TEST(ShmGroup, SegmentsOfProcessesThatEndedAreRemovedByTheNextGroup) {
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) ::_exit(0);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);  // its pid now names no process
  const std::string dead = make_segment("old-job", child, 0);
  const std::string alive = make_segment("old-job", ::getppid(), 0);
  auto groups = create_pair(false);
  for (auto& g : groups) {
    ASSERT_TRUE(g.ok()) << g.status().to_string();
    EXPECT_NE(g->get(), nullptr);
  }
  EXPECT_FALSE(exists(dead)) << "the segment of an ended process stayed";
  EXPECT_TRUE(exists(alive)) << "a running process's segment was removed";
  EXPECT_TRUE(own_segments().empty()) << "the group's own name stayed after set-up";
  ::shm_unlink(("/" + alive).c_str());
}

TEST(ShmGroup, TheLauncherRemovesItsJobsSegmentsByName) {
  const std::string a = make_segment("hpshard-run-0123abcd", ::getppid(), 1);
  const std::string b = make_segment("hpshard-run-0123abcd", ::getppid(), 2);
  const std::string other = make_segment("another-job", ::getppid(), 3);
  EXPECT_EQ(segment_job_tag("hpshard-run-0123abcd"), "hpshard_run_0123abcd");
  EXPECT_EQ(remove_job_segments("hpshard-run-0123abcd"), 2);
  EXPECT_FALSE(exists(a));
  EXPECT_FALSE(exists(b));
  EXPECT_TRUE(exists(other));
  ::shm_unlink(("/" + other).c_str());
}

TEST(ShmGroup, SlotsThatOverflowTheSegmentAreRefusedBeforeAnythingIsMade) {
  auto store = make_in_memory_store();
  for (size_t slot : {size_t{1} << 62, size_t{1} << 61, ~size_t{0}}) {
    auto group = ShmGroup::create(*store, 0, 4, true, slot, std::chrono::milliseconds(100));
    ASSERT_FALSE(group.ok());
    EXPECT_EQ(group.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(group.status().message().find("HPS_COMM_SHM_SLOT_BYTES"), std::string::npos)
        << group.status().message();
  }
  EXPECT_TRUE(own_segments().empty());
}

// Two thread ranks with direct reads. Returns both groups.
std::vector<std::unique_ptr<ShmGroup>> direct_pair() {
  auto made = create_pair(true);
  std::vector<std::unique_ptr<ShmGroup>> groups;
  for (auto& g : made) {
    EXPECT_TRUE(g.ok()) << g.status().to_string();
    if (!g.ok() || !*g) return {};
    groups.push_back(std::move(*g));
  }
  EXPECT_TRUE(groups[0]->direct() && groups[1]->direct());
  return groups;
}

// A rank whose direct all-gather or broadcast ends early (here its deadline; in the field an
// abort or a failed peer, then its caller frees the buffer) used to leave its buffer's
// address published: a peer arriving later read freed memory (a segfault with threads as
// ranks). The round is given up and the buffer withdrawn: the late peer gets an error and
// reads nothing.
TEST(ShmGroup, ALateReaderNeverReadsABufferItsRankGaveUpOn) {
  const long page = ::sysconf(_SC_PAGESIZE);
  for (int broadcast = 0; broadcast < 2; ++broadcast) {
    auto groups = direct_pair();
    ASSERT_EQ(groups.size(), 2u);
    const size_t bytes = static_cast<size_t>(page) * 4;
    CollectiveDescriptor d;
    d.kind = broadcast ? kBroadcastKind : kAllGatherKind;
    d.count = bytes;
    // Rank 0's buffer is its own mapping, unmapped once its collective returns: reading it
    // afterwards faults.
    void* mine = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(mine, MAP_FAILED);
    std::memset(mine, 1, bytes);
    std::vector<uint8_t> gathered(bytes * 2);
    const auto soon = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
    Status s0 = broadcast ? groups[0]->broadcast(d, soon, mine, bytes, 0)
                          : groups[0]->all_gather(d, soon, mine, gathered.data(), bytes);
    ASSERT_EQ(s0.code(), StatusCode::kTimeout) << s0.to_string();
    ASSERT_EQ(::munmap(mine, bytes), 0);

    std::vector<uint8_t> theirs(bytes, 2), received(bytes * 2, 7);
    const auto later = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    Status s1 = broadcast ? groups[1]->broadcast(d, later, received.data(), bytes, 0)
                          : groups[1]->all_gather(d, later, theirs.data(), received.data(), bytes);
    EXPECT_EQ(s1.code(), StatusCode::kAborted) << s1.to_string();
    EXPECT_NE(s1.message().find("rank 0 gave up on this operation"), std::string::npos)
        << s1.to_string();
    EXPECT_EQ(received[0], 7) << "rank 0's part was written";
  }
}

// Three ranks, the third never joins (stopped): the rank that waits longer is told which
// rank gave up and which had not joined (it named only the survivor that gave up).
TEST(ShmGroup, ARankThatGaveUpIsNamedWithTheRanksThatHadNotJoined) {
  auto made = create_pair(false, 3);
  for (auto& g : made) ASSERT_TRUE(g.ok() && *g) << g.status().to_string();
  CollectiveDescriptor d;
  d.kind = kBarrierKind;
  Status s1;
  std::thread later([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    s1 = (*made[1])->barrier(d, std::chrono::steady_clock::now() + std::chrono::seconds(5));
  });
  const Status s0 =
      (*made[0])->barrier(d, std::chrono::steady_clock::now() + std::chrono::milliseconds(200));
  later.join();
  EXPECT_EQ(s0.code(), StatusCode::kTimeout) << s0.to_string();
  EXPECT_EQ(s1.code(), StatusCode::kAborted) << s1.to_string();
  EXPECT_NE(s1.message().find("rank 0 gave up on this operation"), std::string::npos)
      << s1.to_string();
  EXPECT_NE(s1.message().find("; rank 2 had not joined it"), std::string::npos) << s1.to_string();
}

// A rank whose communicator failed tells its peers why: a rank waiting for it quotes the
// message, bounded (383 bytes: a longer one is cut at a character's start and ends in
// "..."), with control bytes replaced, and bytes past ASCII only where the whole is UTF-8;
// only the first message counts.
TEST(ShmGroup, APeerThatFailedIsQuotedInTheErrorItCauses) {
  CollectiveDescriptor d;
  d.kind = kBarrierKind;
  // What rank 0's barrier says rank 1 failed with, after rank 1 failed with `why`.
  auto quoted = [&](const std::string& why) {
    auto made = create_pair(false);
    for (auto& g : made) EXPECT_TRUE(g.ok() && *g) << g.status().to_string();
    if (!made[0].ok() || !made[1].ok()) return std::string();
    (*made[1])->mark_failed(why);
    (*made[1])->mark_failed("a later failure");
    const Status s =
        (*made[0])->barrier(d, std::chrono::steady_clock::now() + std::chrono::seconds(5));
    EXPECT_EQ(s.code(), StatusCode::kAborted) << s.to_string();
    const std::string prefix = "rank 1 failed an earlier operation (its error: ";
    const size_t at = s.message().find(prefix);
    EXPECT_NE(at, std::string::npos) << s.to_string();
    EXPECT_EQ(s.message().back(), ')') << s.to_string();
    if (at == std::string::npos || s.message().back() != ')') return std::string();
    const size_t from = at + prefix.size();
    return s.message().substr(from, s.message().size() - 1 - from);
  };
  const std::string said = "all_reduce #3 on group 'dp' (rank 0 of 2): rank 1 left";
  EXPECT_EQ(quoted(said + "\n"), said + "?");
  std::string long_ascii = quoted(said + std::string(1000, 'x'));
  EXPECT_EQ(long_ascii, said + std::string(380 - said.size(), 'x') + "...");
  // 3-byte characters: 127 of them fill 381 bytes, so the cut keeps 126 (378 bytes).
  std::string wide;
  for (int i = 0; i < 200; ++i) wide += "\u65e5";
  EXPECT_EQ(quoted(wide), wide.substr(0, 378) + "...");
  EXPECT_EQ(quoted("group 'g\xff\xfe' failed"),
            "group 'g?"
            "?' failed");
  EXPECT_EQ(quoted("group '\u65e5' failed"), "group '\u65e5' failed");
}

// The same protocol with the buffer still there: a reader that comes in time reads it.
TEST(ShmGroup, DirectAllGatherAndBroadcastDeliverTheData) {
  auto groups = direct_pair();
  ASSERT_EQ(groups.size(), 2u);
  const size_t bytes = 1000;
  CollectiveDescriptor g;
  g.kind = kAllGatherKind;
  g.count = bytes;
  CollectiveDescriptor b = g;
  b.kind = kBroadcastKind;
  b.root = 1;
  std::vector<std::vector<uint8_t>> send(2), recv(2), bcast(2);
  std::vector<Status> status(4, Status::Ok());
  std::vector<std::thread> ranks;
  for (int32_t r = 0; r < 2; ++r) {
    send[r].assign(bytes, static_cast<uint8_t>(10 + r));
    recv[r].assign(2 * bytes, 0);
    bcast[r].assign(bytes, static_cast<uint8_t>(20 + r));
    ranks.emplace_back([&, r] {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      status[r] = groups[r]->all_gather(g, deadline, send[r].data(), recv[r].data(), bytes);
      status[2 + r] = groups[r]->broadcast(b, deadline, bcast[r].data(), bytes, 1);
    });
  }
  for (auto& t : ranks) t.join();
  for (const Status& s : status) EXPECT_TRUE(s.ok()) << s.to_string();
  for (int32_t r = 0; r < 2; ++r) {
    EXPECT_EQ(recv[r][0], 10);
    EXPECT_EQ(recv[r][2 * bytes - 1], 11);
    EXPECT_EQ(bcast[r][bytes / 2], 21);
  }
}

// A rank that finishes a collective and destroys its communicator at once may do both while
// its peer, still waiting in the same collective, is between reading whether it is gone and
// reading its progress. The peer used to read the progress first and then see the rank gone:
// it failed with "destroyed its communicator before joining" a collective the rank had
// joined (seen under ThreadSanitizer in an engine test). Here rank 0 runs its whole barrier
// and leaves inside rank 1's window, over both transports' protocols.
TEST(ShmGroup, APeerThatFinishesAndLeavesDuringAWaitHasJoined) {
  for (bool direct : {false, true}) {
    auto made = create_pair(direct);
    std::vector<std::unique_ptr<ShmGroup>> groups;
    for (auto& g : made) {
      ASSERT_TRUE(g.ok() && *g) << g.status().to_string();
      groups.push_back(std::move(*g));
    }
    CollectiveDescriptor d;
    d.kind = kBarrierKind;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    Status s0 = unavailable("not run");
    int windows = 0;
    groups[1]->set_between_reads_for_testing([&] {
      if (windows++ > 0) return;
      std::thread rank0([&] {
        s0 = groups[0]->barrier(d, deadline);
        groups[0].reset();
      });
      rank0.join();
    });
    Status s1 = groups[1]->barrier(d, deadline);
    EXPECT_TRUE(s0.ok()) << s0.to_string();
    EXPECT_TRUE(s1.ok()) << "direct " << direct << ": " << s1.to_string();
    EXPECT_GE(windows, 1);
    EXPECT_EQ(groups[0], nullptr);
  }
}

}  // namespace
}  // namespace hps::shm
