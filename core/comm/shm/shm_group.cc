#include "core/comm/shm/shm_group.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

#include "core/comm/host.h"
#include "core/comm/peer_failure.h"
#include "core/comm/reduce_ops.h"
#include "core/common/env.h"
#include "core/common/logging.h"

namespace hps::shm {

using Clock = std::chrono::steady_clock;

namespace {

constexpr uint64_t kMagic = 0x6870736861726434ULL;  // "hpshard4"
constexpr size_t kPage = 4096;
// A failed rank's message for its peers' errors, truncated to this many bytes with its NUL.
constexpr size_t kReasonBytes = kPeerReasonBytes + 1;  // and its terminating zero
enum ReasonState : uint32_t { kNoReason = 0, kWritingReason = 1, kReasonWritten = 2 };

enum State : uint32_t { kActive = 0, kLeft = 1, kFailed = 2, kAborted = 3 };

// How a round ended (Header::outcome): (round + 1) << kRoundShift | rank << 2 | how, where
// rank is the rank that decided it. A word naming an earlier round decides nothing yet.
enum How : uint64_t { kComplete = 1, kGaveUp = 2 };
constexpr int kRoundShift = 24;
constexpr uint64_t kRankMask = (uint64_t{1} << (kRoundShift - 2)) - 1;
uint64_t outcome_word(uint64_t round, int32_t rank, How how) {
  return (round + 1) << kRoundShift | (static_cast<uint64_t>(rank) & kRankMask) << 2 | how;
}
bool decides(uint64_t word, uint64_t round) { return word >> kRoundShift == round + 1; }
How how_of(uint64_t word) { return static_cast<How>(word & 3); }
int32_t decider_of(uint64_t word) { return static_cast<int32_t>(word >> 2 & kRankMask); }

static_assert(std::atomic<uint32_t>::is_always_lock_free && sizeof(std::atomic<uint32_t>) == 4,
              "futex words must be plain 32-bit integers");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "round counters must be lock-free");

size_t round_up(size_t v, size_t to) { return (v + to - 1) / to * to; }

constexpr char kNamePrefix[] = "hpshard-";

// The fields of a segment name "hpshard-JOB-PIDNS-PID-N-NONCE" (without the leading '/').
struct SegmentName {
  std::string job;
  uint64_t pid_ns = 0;
  int32_t pid = 0;
};
std::optional<SegmentName> parse_segment_name(const std::string& name) {
  if (name.rfind(kNamePrefix, 0) != 0) return std::nullopt;
  std::vector<std::string> fields;
  std::stringstream in(name.substr(sizeof kNamePrefix - 1));
  std::string field;
  while (std::getline(in, field, '-')) fields.push_back(field);
  if (fields.size() != 5) return std::nullopt;
  SegmentName parsed;
  parsed.job = fields[0];
  char* end = nullptr;
  parsed.pid_ns = std::strtoull(fields[1].c_str(), &end, 10);
  if (fields[1].empty() || *end != '\0') return std::nullopt;
  const long pid = std::strtol(fields[2].c_str(), &end, 10);
  if (fields[2].empty() || *end != '\0' || pid <= 0 || pid > INT32_MAX) return std::nullopt;
  parsed.pid = static_cast<int32_t>(pid);
  return parsed;
}

// Unlinks the segments in /dev/shm that `remove` picks, owned by this user.
template <typename Pick>
int remove_segments(Pick remove) {
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return 0;
  int removed = 0;
  while (dirent* entry = readdir(dir)) {
    const std::string name = entry->d_name;
    auto parsed = parse_segment_name(name);
    if (!parsed || !remove(*parsed)) continue;
    struct stat st {};
    if (fstatat(dirfd(dir), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 ||
        st.st_uid != geteuid() || !S_ISREG(st.st_mode)) {
      continue;
    }
    if (shm_unlink(("/" + name).c_str()) == 0) ++removed;
  }
  closedir(dir);
  return removed;
}

// The name of a new segment of this process.
std::string new_segment_name(uint64_t nonce) {
  static std::atomic<uint64_t> counter{0};
  std::ostringstream n;
  n << '/' << kNamePrefix << segment_job_tag(env_string("HPS_JOB_ID").value_or("")) << '-'
    << host::pid_namespace() << '-' << getpid() << '-' << counter++ << '-' << std::hex << nonce;
  return n.str();
}

// Unlinks a segment's name when it goes out of scope, unless release()d first: every way
// out of setting up a group leaves no name behind.
class NameGuard {
 public:
  NameGuard() = default;
  ~NameGuard() { release(); }
  NameGuard(const NameGuard&) = delete;
  NameGuard& operator=(const NameGuard&) = delete;
  void hold(std::string name) { name_ = std::move(name); }
  void release() {
    if (!name_.empty()) shm_unlink(name_.c_str());
    name_.clear();
  }

 private:
  std::string name_;
};

void futex_wait(std::atomic<uint32_t>* word, uint32_t seen, std::chrono::nanoseconds timeout) {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1'000'000'000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1'000'000'000);
  // Not FUTEX_PRIVATE: the word lives in memory shared between processes.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Element range of part i when `count` is cut into n nearly equal parts.
std::pair<size_t, size_t> part(size_t count, int32_t n, int32_t i) {
  const size_t base = count / static_cast<size_t>(n), extra = count % static_cast<size_t>(n);
  const size_t k = static_cast<size_t>(i);
  const size_t begin = k * base + std::min(k, extra);
  return {begin, begin + base + (k < extra ? 1 : 0)};
}

// One mapping per segment and process: ranks that are threads of one process share it, so
// every rank sees the control blocks (and a thread sanitizer their synchronisation) at the
// same addresses, and the process maps each segment once.
struct Mapping {
  void* base;
  size_t bytes;
  int users;
};
std::mutex& mappings_mutex() {
  static std::mutex m;
  return m;
}
std::map<std::string, Mapping>& mappings() {
  static std::map<std::string, Mapping> m;
  return m;
}
// The process's mapping of segment `name`, mapping it from `fd` (when >= 0) if there is none.
void* map_segment(const std::string& name, int fd, size_t bytes, std::string* why_not) {
  std::lock_guard lock(mappings_mutex());
  auto it = mappings().find(name);
  if (it != mappings().end()) {
    ++it->second.users;
    return it->second.base;
  }
  if (fd < 0) return nullptr;
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    *why_not = std::string("mmap: ") + std::strerror(errno);
    return nullptr;
  }
  mappings()[name] = {base, bytes, 1};
  return base;
}
void unmap_segment(void* base) {
  std::lock_guard lock(mappings_mutex());
  for (auto it = mappings().begin(); it != mappings().end(); ++it) {
    if (it->second.base != base) continue;
    if (--it->second.users == 0) {
      munmap(base, it->second.bytes);
      mappings().erase(it);
    }
    return;
  }
}

// What peers read to learn whether they can read this process's memory directly.
constexpr uint64_t kProbeValue = 0x7072626568617264ULL;
volatile uint64_t probe_word = kProbeValue;

// Below this many bytes per round every rank reduces the whole piece itself: one round
// (one synchronisation) instead of a reduce-scatter round and an all-gather round.
constexpr size_t kSingleRoundAllReduceBytes = 64 * 1024;

}  // namespace

struct ShmGroup::Header {
  uint64_t magic;
  uint64_t nonce;
  int64_t size;
  uint64_t slot_bytes;
  std::atomic<uint32_t> signal;    // futex word: bumped whenever any counter moves
  std::atomic<uint32_t> sleepers;  // ranks asleep on it
  // Round k's outcome word, at k % 2 (see How): set once, by the first rank that either saw
  // every post it waited for (kComplete) or stopped waiting (kGaveUp); every rank abides by
  // it. Round k + 2 starts only after every rank has finished round k.
  std::atomic<uint64_t> outcome[2];
};

struct alignas(128) ShmGroup::Control {
  std::atomic<uint64_t> posted;    // rounds this rank has published
  std::atomic<uint64_t> consumed;  // rounds this rank has finished reading
  std::atomic<uint32_t> state;     // State
  int32_t pid;
  uint64_t pid_ns;
  CollectiveDescriptor descriptor[2];  // of the collective whose first round is k, at k % 2
  // Direct mode: this rank's buffer for round k, at k % 2; 0 once withdrawn (the rank
  // returned without every peer having read it).
  std::atomic<uint64_t> address[2];
  std::atomic<uint64_t> reading;  // direct mode: 1 + the round whose peer buffer it is reading
  uint64_t probe;                 // the address of this process's probe_word
  // Why this rank's communicator failed (mark_failed), written once, before its state.
  std::atomic<uint32_t> reason_state;  // ReasonState
  char reason[kReasonBytes];
};

namespace {
size_t controls_offset() { return round_up(sizeof(ShmGroup::Header), kPage); }
size_t slots_offset(int32_t size) {
  return controls_offset() + round_up(sizeof(ShmGroup::Control) * static_cast<size_t>(size), kPage);
}
// The segment's size, or INVALID_ARGUMENT when the slots are too large for the group.
StatusOr<size_t> segment_bytes(int32_t size, size_t slot_bytes) {
  size_t slots = 0, total = 0;
  if (slot_bytes > kMaxSlotBytes ||
      __builtin_mul_overflow(static_cast<size_t>(size), 2 * slot_bytes, &slots) ||
      __builtin_add_overflow(slots_offset(size), slots, &total) ||
      total > static_cast<size_t>(std::numeric_limits<off_t>::max())) {
    return invalid_argument("shared-memory slots of " + std::to_string(slot_bytes) +
                            " bytes (HPS_COMM_SHM_SLOT_BYTES, CommOptions::"
                            "shared_memory_slot_bytes) are too large for " +
                            std::to_string(size) + " ranks x 2 slots: at most " +
                            std::to_string(kMaxSlotBytes) + " bytes per slot");
  }
  return total;
}
}  // namespace

std::string segment_job_tag(const std::string& job_id) {
  if (job_id.empty()) return "0";
  std::string tag;
  for (char ch : job_id.substr(0, 64)) {
    const bool keep = std::isalnum(static_cast<unsigned char>(ch)) || ch == '_' || ch == '.';
    tag += keep ? ch : '_';
  }
  return tag;
}

int remove_job_segments(const std::string& job_id) {
  const std::string tag = segment_job_tag(job_id);
  return remove_segments([&](const SegmentName& s) { return s.job == tag; });
}

int remove_stale_segments() {
  const uint64_t ns = host::pid_namespace();
  return remove_segments(
      [&](const SegmentName& s) { return s.pid_ns == ns && host::process_ended(s.pid); });
}

ShmGroup::ShmGroup(int32_t rank, int32_t size, size_t slot_bytes, void* base, RankNames names)
    : rank_(rank), names_(std::move(names)), size_(size), slot_bytes_(slot_bytes), base_(base) {}

ShmGroup::~ShmGroup() {
  uint32_t active = kActive;
  control(rank_).state.compare_exchange_strong(active, kLeft);
  notify();
  unmap_segment(base_);
}

ShmGroup::Header& ShmGroup::header() const { return *static_cast<Header*>(base_); }

ShmGroup::Control& ShmGroup::control(int32_t q) const {
  return reinterpret_cast<Control*>(static_cast<uint8_t*>(base_) + controls_offset())[q];
}

uint8_t* ShmGroup::slot(int32_t q, uint64_t round) const {
  return static_cast<uint8_t*>(base_) + slots_offset(size_) +
         (static_cast<size_t>(q) * 2 + round % 2) * slot_bytes_;
}

StatusOr<std::unique_ptr<ShmGroup>> ShmGroup::create(Store& store, int32_t rank, int32_t size,
                                                     bool enabled, size_t slot_bytes,
                                                     Milliseconds timeout, bool direct,
                                                     RankNames names) {
  if (size < 2) return std::unique_ptr<ShmGroup>();
  HPS_RETURN_IF_ERROR(segment_bytes(size, slot_bytes).status());
  slot_bytes = round_up(std::max<size_t>(slot_bytes, kPage), kPage);
  HPS_ASSIGN_OR_RETURN(const size_t bytes, segment_bytes(size, slot_bytes));
  const std::string host = host::identity();
  NameGuard unlink_on_exit;  // rank 0's segment name, until every rank has opened it
  void* base = nullptr;
  std::string name;
  std::string why_not;  // empty when this rank mapped the segment

  auto map = [&](int fd) -> bool {
    base = map_segment(name, fd, bytes, &why_not);
    return base != nullptr;
  };

  if (rank == 0) {
    std::random_device random;
    const uint64_t nonce = (static_cast<uint64_t>(random()) << 32) ^ random();
    if (enabled) {
      // Segments a killed process left behind go first: nobody will ever unlink them.
      if (const int stale = remove_stale_segments(); stale > 0) {
        HPS_LOG(kInfo) << "removed " << stale
                       << " shared-memory segment(s) left by processes that have ended";
      }
      name = new_segment_name(nonce);
      const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd < 0) {
        why_not = std::string("shm_open: ") + std::strerror(errno);
      } else {
        unlink_on_exit.hold(name);
        // Reserve every page now: a full /dev/shm must mean "use TCP", not SIGBUS later.
        int rc = ftruncate(fd, static_cast<off_t>(bytes)) == 0 ? 0 : errno;
        if (rc == 0) rc = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
        if (rc != 0) {
          why_not =
              std::string("reserving ") + std::to_string(bytes) + " bytes: " + std::strerror(rc);
        } else if (map(fd)) {
          auto* h = static_cast<Header*>(base);
          h->magic = kMagic;
          h->nonce = nonce;
          h->size = size;
          h->slot_bytes = slot_bytes;
        }
        close(fd);
        if (!why_not.empty()) unlink_on_exit.release();
      }
    } else {
      why_not = "disabled";
    }
    std::ostringstream published;
    if (why_not.empty()) {
      published << name << ' ' << nonce << ' ' << host;
    } else {
      published << "none";
    }
    if (Status s = store.set("segment", published.str()); !s.ok()) {
      if (base) unmap_segment(base);
      return s;
    }
  } else {
    HPS_ASSIGN_OR_RETURN(std::string published, store.get("segment", timeout));
    std::istringstream in(published);
    uint64_t nonce = 0;
    std::string their_host;
    in >> name >> nonce;
    std::getline(in >> std::ws, their_host);
    if (!enabled) {
      why_not = "disabled";
    } else if (name == "none") {
      why_not = "rank 0 has no segment";
    } else if (their_host != host) {
      why_not = "another host";
    } else if (map(-1)) {
      // Another rank of this process mapped it already: the same addresses.
    } else {
      const int fd = shm_open(name.c_str(), O_RDWR, 0600);
      struct stat st {};
      if (fd < 0) {
        why_not = std::string("shm_open: ") + std::strerror(errno);
      } else if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
        why_not = "the segment has another size";
      } else if (map(fd)) {
        auto* h = static_cast<Header*>(base);
        if (h->magic != kMagic || h->nonce != nonce || h->size != size ||
            h->slot_bytes != slot_bytes) {
          why_not = "the segment is not this group's";
        }
      }
      if (fd >= 0) close(fd);
    }
  }

  if (why_not.empty()) {
    auto& mine = reinterpret_cast<Control*>(static_cast<uint8_t*>(base) + controls_offset())[rank];
    mine.pid = static_cast<int32_t>(getpid());
    mine.pid_ns = host::pid_namespace();
    mine.probe = reinterpret_cast<uint64_t>(&probe_word);
  }
  // Every rank learns whether every rank mapped it; they all decide alike.
  if (Status s = store.set("mapped/" + std::to_string(rank), why_not.empty() ? "1" : "0");
      !s.ok()) {
    if (base) unmap_segment(base);
    return s;
  }
  bool all = true;
  for (int32_t q = 0; q < size; ++q) {
    auto v = store.get("mapped/" + std::to_string(q), timeout);
    if (!v.ok()) {
      if (base) unmap_segment(base);
      return v.status();
    }
    all = all && v->size() == 1 && v->front() == '1';
  }
  // Every rank that will ever open it has: the name can go (the memory stays until unmapped).
  unlink_on_exit.release();
  if (!all) {
    if (base) unmap_segment(base);
    HPS_LOG(kDebug) << "rank " << rank << ": no shared-memory transport"
                    << (why_not.empty() ? std::string(" (a peer could not map it)")
                                        : " (" + why_not + ")");
    return std::unique_ptr<ShmGroup>();
  }
  std::unique_ptr<ShmGroup> group(new ShmGroup(rank, size, slot_bytes, base, std::move(names)));
  // Direct mode when every rank can read every other's memory: its own process, or others
  // through cross-memory attach (process_vm_readv: same user, ptrace allowed). Everyone's
  // control block is complete here (written before its "mapped" key).
  bool readable = direct;
  for (int32_t q = 0; q < size && readable; ++q) {
    if (q == rank) continue;
    uint64_t seen = 0;
    const void* remote = reinterpret_cast<const void*>(group->control(q).probe);
    readable = group->read_peer(q, &seen, remote, sizeof seen).ok() && seen == kProbeValue;
  }
  HPS_RETURN_IF_ERROR(store.set("direct/" + std::to_string(rank), readable ? "1" : "0"));
  bool all_direct = true;
  for (int32_t q = 0; q < size; ++q) {
    auto v = store.get("direct/" + std::to_string(q), timeout);
    if (!v.ok()) return v.status();
    all_direct = all_direct && v->size() == 1 && v->front() == '1';
  }
  group->direct_ = all_direct;
  return group;
}

Status ShmGroup::read_peer(int32_t q, void* local, const void* remote, size_t bytes) const {
  const Control& c = control(q);
  if (c.pid == getpid()) {  // a thread of this process: its memory is ours
    std::memcpy(local, remote, bytes);
    return Status::Ok();
  }
  auto* out = static_cast<uint8_t*>(local);
  auto* in = static_cast<uint8_t*>(const_cast<void*>(remote));
  while (bytes > 0) {
    iovec l{out, bytes}, r{in, bytes};
    const ssize_t n = process_vm_readv(c.pid, &l, 1, &r, 1, 0);
    if (n <= 0) {
      return aborted("reading the buffer of " + names_(q, "process " + std::to_string(c.pid)) +
                     ": " + std::strerror(n < 0 ? errno : EIO));
    }
    out += n;
    in += n;
    bytes -= static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status ShmGroup::wait_peers(bool posted, uint64_t target, Deadline deadline, int32_t only) {
  for (int32_t q = 0; q < size_; ++q) {
    if (q == rank_ || (only >= 0 && q != only)) continue;
    HPS_RETURN_IF_ERROR(wait_for(posted, target, q, deadline, only < 0));
  }
  return Status::Ok();
}

Status ShmGroup::wait_all_consumed(uint64_t round, Deadline deadline) {
  return wait_peers(false, round + 1, deadline);
}

Status ShmGroup::read_posted(int32_t q, uint64_t round, void* local, size_t bytes) {
  // Pairs with wait_read_by_all: either the poster sees this flag after withdrawing its
  // address and waits for it to clear, or this rank sees the address withdrawn.
  std::atomic<uint64_t>& reading = control(rank_).reading;
  reading.store(round + 1, std::memory_order_seq_cst);
  const uint64_t remote = control(q).address[round % 2].load(std::memory_order_seq_cst);
  Status s = remote != 0
                 ? read_peer(q, local, reinterpret_cast<const void*>(remote), bytes)
                 : with_cause(aborted(
                       names_(q) + " withdrew its buffer before this rank read it (it failed, was "
                                   "aborted or timed out)"));
  // A poster in another process waits for this read only until its deadline: if it withdrew
  // meanwhile, it may have returned and its caller reused the buffer under the copy. Its
  // withdrawal precedes any such reuse, so an address still posted after the copy means the
  // copy read the posted data.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (s.ok() && control(q).address[round % 2].load(std::memory_order_seq_cst) != remote) {
    s = with_cause(aborted(names_(q) +
                           " withdrew its buffer while this rank read it (it failed, was aborted "
                           "or timed out); what was read is not its data"));
  }
  reading.store(0, std::memory_order_seq_cst);
  return s;
}

Status ShmGroup::wait_read_by_all(uint64_t round, Deadline deadline) {
  Status s = wait_all_consumed(round, deadline);
  if (!s.ok()) withdraw(round, deadline);
  return s;
}

void ShmGroup::withdraw(uint64_t round, Deadline deadline) {
  control(rank_).address[round % 2].store(0, std::memory_order_seq_cst);
  // The caller's later plain writes into the buffer must not become visible before the
  // withdrawal, which a reader checks after its copy (read_posted).
  std::atomic_thread_fence(std::memory_order_seq_cst);
  for (int32_t q = 0; q < size_; ++q) {
    if (q == rank_) continue;
    const Control& c = control(q);
    // A thread of this process copies with memcpy: it must be done before the buffer goes.
    // Another process reads through process_vm_readv, which cannot fault here: it is waited
    // for while it lives, up to the deadline; a read still going on then finds the buffer
    // withdrawn once it has copied, and fails (read_posted).
    const bool same_process = c.pid == getpid();
    for (int spins = 0; c.reading.load(std::memory_order_seq_cst) == round + 1; ++spins) {
      if (spins < 64) {
        cpu_relax();
        continue;
      }
      if (!same_process && (Clock::now() >= deadline || host::process_ended(c.pid))) break;
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

void ShmGroup::notify() {
  Header& h = header();
  h.signal.fetch_add(1, std::memory_order_seq_cst);
  if (h.sleepers.load(std::memory_order_seq_cst) > 0) futex_wake_all(&h.signal);
}

void ShmGroup::abort() {
  aborted_ = true;
  control(rank_).state.store(kAborted, std::memory_order_seq_cst);
  notify();
}

void ShmGroup::mark_failed(std::string_view why) {
  Control& mine = control(rank_);
  uint32_t none = kNoReason;
  if (mine.reason_state.compare_exchange_strong(none, kWritingReason)) {
    const std::string sent = reason_to_send(why);
    std::memcpy(mine.reason, sent.data(), sent.size());
    mine.reason[sent.size()] = '\0';
    mine.reason_state.store(kReasonWritten, std::memory_order_release);
  }
  uint32_t active = kActive;
  if (mine.state.compare_exchange_strong(active, kFailed)) notify();
}

std::string ShmGroup::reason_of(int32_t peer) const {
  const Control& c = control(peer);
  if (c.reason_state.load(std::memory_order_acquire) != kReasonWritten) return {};
  return reason_received(std::string_view(c.reason, ::strnlen(c.reason, kReasonBytes)));
}

Status ShmGroup::peer_gone(int32_t peer) const {
  if (aborted_) return aborted("the communicator was aborted");
  const Control& c = control(peer);
  switch (c.state.load(std::memory_order_seq_cst)) {
    case kLeft:
      return aborted(names_(peer) +
                     " destroyed its communicator before joining (did a rank exit?)");
    case kFailed: return with_cause(aborted(peer_failed_text(names_(peer), reason_of(peer))));
    case kAborted: return with_cause(aborted(peer_aborted_text(names_(peer))));
    default: break;
  }
  return Status::Ok();
}

Status ShmGroup::with_cause(Status failure) const {
  for (int32_t q = 0; q < size_; ++q) {
    if (q == rank_) continue;
    const Control& c = control(q);
    std::string cause;
    if (c.state.load(std::memory_order_seq_cst) == kLeft) {
      cause = names_(q) + " destroyed its communicator (did it exit?)";
    } else if (c.pid != getpid() && c.pid_ns == control(rank_).pid_ns &&
               host::process_ended(c.pid)) {
      cause = names_(q, "process " + std::to_string(c.pid)) + " has exited";
    }
    if (!cause.empty()) return Status(failure.code(), cause + "; " + failure.message());
  }
  return failure;
}

Status ShmGroup::check_peers_alive(const std::vector<int32_t>& peers) const {
  for (const int32_t q : peers) {
    if (q == rank_ || q < 0 || q >= size_) continue;
    const Control& c = control(q);
    if (c.state.load(std::memory_order_seq_cst) == kLeft) return peer_gone(q);
    if (c.pid != getpid() && c.pid_ns == control(rank_).pid_ns && host::process_ended(c.pid)) {
      return aborted(names_(q, "process " + std::to_string(c.pid)) + " has exited");
    }
  }
  return Status::Ok();
}

Status ShmGroup::others_gone(bool posted, uint64_t target, int32_t peer) const {
  for (int32_t q = 0; q < size_; ++q) {
    if (q == rank_ || q == peer) continue;
    const Control& c = control(q);
    // Gone read before the counter, as in wait_for: one that reached `target` and then left
    // is done, not gone.
    Status gone = peer_gone(q);
    if (gone.ok()) continue;
    if ((posted ? c.posted : c.consumed).load(std::memory_order_seq_cst) < target) return gone;
  }
  return Status::Ok();
}

Status ShmGroup::wait_for(bool posted, uint64_t target, int32_t peer, Deadline deadline,
                          bool watch_others) {
  Control& c = control(peer);
  auto& counter = posted ? c.posted : c.consumed;
  if (counter.load(std::memory_order_acquire) >= target) return Status::Ok();
  Header& h = header();
  const bool check_pid = c.pid != getpid() && c.pid_ns == control(rank_).pid_ns;
  auto next_pid_check = Clock::now() + std::chrono::milliseconds(200);
  for (int spins = 0;; ++spins) {
    const uint32_t seen = h.signal.load(std::memory_order_seq_cst);
    // Whether the peer is gone is read before its counter: a peer writes the counter before
    // it leaves, fails or exits, so one that reached `target` and then left at once is seen
    // as done by the counter read below, not as gone.
    Status gone = peer_gone(peer);
    if (posted && gone.ok()) {
      const uint64_t outcome = h.outcome[(target - 1) % 2].load(std::memory_order_seq_cst);
      if (decides(outcome, target - 1) && how_of(outcome) == kGaveUp) gone = given_up(outcome);
    }
    if (gone.ok() && check_pid && spins >= 80 && Clock::now() >= next_pid_check) {
      if (host::process_ended(c.pid)) {
        gone = aborted(names_(peer, "process " + std::to_string(c.pid)) + " has exited");
      }
      next_pid_check = Clock::now() + std::chrono::milliseconds(200);
    }
    if (between_reads_for_testing_) between_reads_for_testing_();
    if (counter.load(std::memory_order_seq_cst) >= target) return Status::Ok();
    HPS_RETURN_IF_ERROR(gone);
    if (spins < 64) {
      cpu_relax();
      continue;
    }
    if (spins < 80) {
      sched_yield();
      continue;
    }
    const auto now = Clock::now();
    if (now >= deadline) {
      return timeout_error("timed out waiting for " + names_(peer) +
                           " (a peer is missing or called a different operation)");
    }
    // Before sleeping: a later rank that ended the group ends this wait too (the round
    // cannot complete without it), not only once `peer` has come.
    if (watch_others) HPS_RETURN_IF_ERROR(others_gone(posted, target, peer));
    h.sleepers.fetch_add(1, std::memory_order_seq_cst);
    futex_wait(&h.signal, seen,
               std::min<std::chrono::nanoseconds>(deadline - now, std::chrono::milliseconds(100)));
    h.sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
}

Status ShmGroup::acquire(uint64_t round, Deadline deadline) {
  if (aborted_) return aborted("the communicator was aborted");
  if (round < 2) return Status::Ok();
  // Slot round % 2 last held round - 2: every rank must have finished reading it.
  return wait_peers(false, round - 1, deadline);
}

void ShmGroup::post(uint64_t round, const CollectiveDescriptor* d) {
  Control& me = control(rank_);
  if (d) me.descriptor[round % 2] = *d;
  me.posted.store(round + 1, std::memory_order_seq_cst);
  notify();
}

Status ShmGroup::wait_posted(uint64_t round, Deadline deadline, int32_t only) {
  return settle(round, wait_peers(true, round + 1, deadline, only));
}

Status ShmGroup::settle(uint64_t round, Status waited) {
  std::atomic<uint64_t>& word = header().outcome[round % 2];
  const uint64_t mine = outcome_word(round, rank_, waited.ok() ? kComplete : kGaveUp);
  uint64_t seen = word.load(std::memory_order_seq_cst);
  while (!decides(seen, round)) {
    if (word.compare_exchange_weak(seen, mine, std::memory_order_seq_cst)) {
      if (!waited.ok()) notify();  // the peers still waiting for this round stop now
      return waited;
    }
  }
  if (how_of(seen) == kComplete) {
    // Whoever decided saw every post this rank waits for: a wait that timed out as the last
    // one arrived completes, as the peers' do.
    return waited.code() == StatusCode::kTimeout ? Status::Ok() : waited;
  }
  return waited.ok() ? given_up(seen) : waited;
}

Status ShmGroup::given_up(uint64_t word) const {
  // The ranks that had not joined the round (a stopped or lost one), named beside the rank
  // that gave up on them.
  const uint64_t round = (word >> kRoundShift) - 1;
  std::vector<int32_t> missing;
  for (int32_t q = 0; q < size_; ++q) {
    if (control(q).posted.load(std::memory_order_seq_cst) >= round + 1) continue;
    missing.push_back(q);
  }
  std::string m = names_(decider_of(word)) +
                  " gave up on this operation before every rank had joined it (it timed out, "
                  "failed or was aborted)";
  if (!missing.empty()) m += "; " + names_.list(missing) + " had not joined it";
  return with_cause(aborted(m));
}

Status ShmGroup::check(uint64_t round, const CollectiveDescriptor& mine) {
  std::vector<CollectiveDescriptor> all(static_cast<size_t>(size_));
  for (int32_t q = 0; q < size_; ++q)
    all[static_cast<size_t>(q)] = control(q).descriptor[round % 2];
  return check_agreement("", mine, all.data(), size_, names_);
}

void ShmGroup::finish(uint64_t round) {
  control(rank_).consumed.store(round + 1, std::memory_order_seq_cst);
  notify();
}

// ---- collectives ----

Status ShmGroup::barrier(const CollectiveDescriptor& d, Deadline deadline) {
  const uint64_t k = next_round_++;
  HPS_RETURN_IF_ERROR(acquire(k, deadline));
  post(k, &d);
  HPS_RETURN_IF_ERROR(wait_posted(k, deadline));
  HPS_RETURN_IF_ERROR(check(k, d));
  finish(k);
  return Status::Ok();
}

Status ShmGroup::all_gather(const CollectiveDescriptor& d, Deadline deadline, const void* send,
                            void* recv, size_t bytes_per_rank) {
  const auto* in = static_cast<const uint8_t*>(send);
  auto* out = static_cast<uint8_t*>(recv);
  if (direct_) {
    // One round, one copy: every rank reads the others' send buffers into its own recv,
    // and returns once every rank has read its send buffer.
    const uint64_t k = next_round_++;
    HPS_RETURN_IF_ERROR(acquire(k, deadline));
    control(rank_).address[k % 2] = reinterpret_cast<uint64_t>(send);
    post(k, &d);
    Status s = [&] {
      HPS_RETURN_IF_ERROR(wait_posted(k, deadline));
      HPS_RETURN_IF_ERROR(check(k, d));
      for (int32_t q = 0; q < size_ && bytes_per_rank; ++q) {
        uint8_t* target = out + static_cast<size_t>(q) * bytes_per_rank;
        if (q == rank_) {
          if (target != in) std::memcpy(target, in, bytes_per_rank);
          continue;
        }
        HPS_RETURN_IF_ERROR(read_posted(q, k, target, bytes_per_rank));
      }
      return Status::Ok();
    }();
    if (!s.ok()) {
      withdraw(k, deadline);
      return s;
    }
    finish(k);
    return wait_read_by_all(k, deadline);
  }
  const size_t rounds = std::max<size_t>(1, (bytes_per_rank + slot_bytes_ - 1) / slot_bytes_);
  for (size_t j = 0; j < rounds; ++j) {
    const uint64_t k = next_round_++;
    const size_t begin = j * slot_bytes_;
    const size_t len = std::min(slot_bytes_, bytes_per_rank - std::min(bytes_per_rank, begin));
    HPS_RETURN_IF_ERROR(acquire(k, deadline));
    if (len) std::memcpy(slot(rank_, k), in + begin, len);
    post(k, j == 0 ? &d : nullptr);
    HPS_RETURN_IF_ERROR(wait_posted(k, deadline));
    if (j == 0) HPS_RETURN_IF_ERROR(check(k, d));
    for (int32_t q = 0; q < size_; ++q) {
      uint8_t* target = out + static_cast<size_t>(q) * bytes_per_rank + begin;
      const uint8_t* source = q == rank_ ? in + begin : slot(q, k);
      if (len && target != source) std::memcpy(target, source, len);
    }
    finish(k);
  }
  return Status::Ok();
}

Status ShmGroup::broadcast(const CollectiveDescriptor& d, Deadline deadline, void* buffer,
                           size_t bytes, int32_t root) {
  auto* data = static_cast<uint8_t*>(buffer);
  if (direct_) {
    // One round, one copy: the others read the root's buffer; the root returns once they
    // all have.
    const uint64_t k = next_round_++;
    HPS_RETURN_IF_ERROR(acquire(k, deadline));
    control(rank_).address[k % 2] = reinterpret_cast<uint64_t>(buffer);
    post(k, &d);
    Status s = wait_posted(k, deadline);
    if (s.ok()) s = check(k, d);
    if (s.ok() && rank_ != root && bytes) s = read_posted(root, k, data, bytes);
    if (!s.ok()) {
      withdraw(k, deadline);
      return s;
    }
    finish(k);
    return rank_ == root ? wait_read_by_all(k, deadline) : Status::Ok();
  }
  const size_t rounds = std::max<size_t>(1, (bytes + slot_bytes_ - 1) / slot_bytes_);
  for (size_t j = 0; j < rounds; ++j) {
    const uint64_t k = next_round_++;
    const size_t begin = j * slot_bytes_;
    const size_t len = std::min(slot_bytes_, bytes - std::min(bytes, begin));
    HPS_RETURN_IF_ERROR(acquire(k, deadline));
    if (rank_ == root && len) std::memcpy(slot(rank_, k), data + begin, len);
    post(k, j == 0 ? &d : nullptr);
    // The first round checks everyone's descriptor; later ones need the root alone.
    HPS_RETURN_IF_ERROR(wait_posted(k, deadline, j == 0 ? -1 : root));
    if (j == 0) HPS_RETURN_IF_ERROR(check(k, d));
    if (rank_ != root && len) std::memcpy(data + begin, slot(root, k), len);
    finish(k);
  }
  return Status::Ok();
}

Status ShmGroup::reduce_scatter(const CollectiveDescriptor& d, Deadline deadline, const void* send,
                                void* recv, size_t count, DType dtype, ReduceOp op) {
  const size_t element = dtype_size(dtype);
  const auto* in = static_cast<const uint8_t*>(send);
  auto* out = static_cast<uint8_t*>(recv);
  const size_t n = static_cast<size_t>(size_);
  // Each round carries `piece` elements for every destination.
  const size_t piece = std::max<size_t>(1, slot_bytes_ / (n * element));
  const size_t rounds = std::max<size_t>(1, (count + piece - 1) / piece);
  std::vector<const void*> inputs(n);
  for (size_t j = 0; j < rounds; ++j) {
    const uint64_t k = next_round_++;
    const size_t begin = j * piece;
    const size_t len = std::min(piece, count - std::min(count, begin));
    HPS_RETURN_IF_ERROR(acquire(k, deadline));
    uint8_t* mine = slot(rank_, k);
    for (size_t dst = 0; dst < n && len; ++dst) {
      std::memcpy(mine + dst * len * element, in + (dst * count + begin) * element, len * element);
    }
    post(k, j == 0 ? &d : nullptr);
    HPS_RETURN_IF_ERROR(wait_posted(k, deadline));
    if (j == 0) HPS_RETURN_IF_ERROR(check(k, d));
    if (len) {
      for (size_t q = 0; q < n; ++q) {
        inputs[q] = slot(static_cast<int32_t>(q), k) + static_cast<size_t>(rank_) * len * element;
      }
      reduce_many(dtype, op, out + begin * element, inputs.data(), size_, len);
    }
    finish(k);
  }
  return Status::Ok();
}

Status ShmGroup::all_reduce(const CollectiveDescriptor& d, Deadline deadline, const void* send,
                            void* recv, size_t count, DType dtype, ReduceOp op) {
  const size_t element = dtype_size(dtype);
  const auto* in = static_cast<const uint8_t*>(send);
  auto* out = static_cast<uint8_t*>(recv);
  const size_t n = static_cast<size_t>(size_);
  const size_t piece = std::max<size_t>(n, slot_bytes_ / element);
  const size_t rounds = std::max<size_t>(1, (count + piece - 1) / piece);
  std::vector<const void*> inputs(n);
  for (size_t j = 0; j < rounds; ++j) {
    const size_t begin = j * piece;
    const size_t len = std::min(piece, count - std::min(count, begin));
    const uint64_t a = next_round_++;
    HPS_RETURN_IF_ERROR(acquire(a, deadline));
    if (len) std::memcpy(slot(rank_, a), in + begin * element, len * element);
    post(a, j == 0 ? &d : nullptr);
    HPS_RETURN_IF_ERROR(wait_posted(a, deadline));
    if (j == 0) HPS_RETURN_IF_ERROR(check(a, d));
    if (len * element <= kSingleRoundAllReduceBytes) {
      // Small: every rank reduces the whole piece, in the same order, from the slots.
      for (size_t q = 0; q < n; ++q) inputs[q] = slot(static_cast<int32_t>(q), a);
      if (len) reduce_many(dtype, op, out + begin * element, inputs.data(), size_, len);
      finish(a);
      continue;
    }
    // Large: rank r reduces part r of the piece into its slot for the next round, then
    // every rank gathers the parts.
    const uint64_t b = next_round_++;
    HPS_RETURN_IF_ERROR(acquire(b, deadline));
    const auto [first, last] = part(len, size_, rank_);
    for (size_t q = 0; q < n; ++q) inputs[q] = slot(static_cast<int32_t>(q), a) + first * element;
    uint8_t* reduced = slot(rank_, b) + first * element;
    reduce_many(dtype, op, reduced, inputs.data(), size_, last - first);
    finish(a);
    post(b, nullptr);
    HPS_RETURN_IF_ERROR(wait_posted(b, deadline));
    for (int32_t q = 0; q < size_; ++q) {
      const auto [f, l] = part(len, size_, q);
      std::memcpy(out + (begin + f) * element, slot(q, b) + f * element, (l - f) * element);
    }
    finish(b);
  }
  return Status::Ok();
}

}  // namespace hps::shm
