#include "core/checkpoint/checkpointer.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <system_error>
#include <thread>
#include <tuple>

#include "core/checkpoint/file_io.h"
#include "core/checkpoint/safetensors.h"
#include "core/checkpoint/staging.h"
#include "core/comm/agreement.h"
#include "core/comm/host.h"
#include "core/comm/store.h"
#include "core/common/env.h"
#include "core/common/logging.h"
#include "core/common/output_file.h"
#include "core/device/cpu/stream.h"
#include "core/device/host_sync.h"

namespace hps {

using ckpt::File;
using ckpt::join_path;
using json = nlohmann::json;

namespace {

// The model a checkpoint holds, for rotation: its parameters' names and shapes (not their
// dtypes, stage or optimizer, which a resumed run may change), as one XXH3 value.
uint64_t model_of(const std::vector<ckpt::StoredTensor>& tensors) {
  std::vector<std::string> params;
  for (const auto& t : tensors) {
    if (t.name.rfind("param/", 0) != 0) continue;
    std::string entry = t.name;
    entry += '\0';
    for (int64_t d : t.shape) entry += std::to_string(d) + ",";
    params.push_back(std::move(entry));
  }
  std::sort(params.begin(), params.end());
  std::string all;
  for (const auto& e : params) all += e + '\n';
  return ckpt::checksum(all.data(), all.size());
}

}  // namespace

// What the listings of a root use of each checkpoint's manifest, kept by the checkpoint's
// name and its manifest file's identity (one stat: device, inode, size, modification and
// change times), so a manifest is read and parsed once while its file stays as it is (the
// saves list the root at every save). A file that changed is read again, one that went is
// forgotten. A manifest refused for what it holds (INVALID_ARGUMENT: not JSON, a checksum
// or a field that does not check) is remembered as refused; one that failed otherwise (out
// of memory, an I/O error) is read again by the next listing.
class PublishedManifests {
 public:
  struct Summary {
    uint64_t sequence = 0;
    int64_t created_unix_ns = 0;
    std::string id;
    CheckpointTopology topology;
    uint64_t model = 0;  // model_of its tensors
  };
  struct Listed {
    std::string name;
    Summary summary;
  };

  explicit PublishedManifests(std::string root) : root_(std::move(root)) {}

  // The checkpoints under the root (a valid name and a manifest this code reads), in the
  // directory's order; into `unreadable`, when given, the names of those whose manifest is
  // there but refused (damaged, or a newer hpshard's). The writer thread and the caller's
  // both list: one at a time.
  StatusOr<std::vector<Listed>> list(std::vector<std::string>* unreadable = nullptr) {
    std::lock_guard lock(mutex_);
    HPS_ASSIGN_OR_RETURN(auto names, ckpt::list_directory(root_));
    std::map<std::string, Known> still;  // what the next listing may take as known
    std::vector<Listed> listed;
    for (const auto& n : names) {
      if (n.empty() || n[0] == '.' || !ckpt::check_checkpoint_name(n).ok()) continue;
      const std::string directory = join_path(root_, n);
      const std::string path = join_path(directory, std::string(ckpt::kManifestFile));
      const std::optional<Identity> file = identity_of(path);
      if (auto known = known_.find(n);
          file && known != known_.end() && known->second.file == *file) {
        if (known->second.summary) {
          listed.push_back({n, *known->second.summary});
        } else if (unreadable != nullptr) {
          unreadable->push_back(n);
        }
        still.insert(known_.extract(known));
        continue;
      }
      auto m = ckpt::read_manifest(directory);
      std::optional<Summary> summary;
      if (m.ok()) {
        summary =
            Summary{m->sequence, m->created_unix_ns, m->id, m->topology, model_of(m->tensors)};
      }
      if (summary) {
        listed.push_back({n, *summary});
      } else if (unreadable != nullptr && file) {
        unreadable->push_back(n);
      }
      // Kept when the verdict is the file's own and the file read is the one stat'ed before
      // and after (not replaced or written while it was read).
      if (file && (m.ok() || m.status().code() == StatusCode::kInvalidArgument) &&
          identity_of(path) == file) {
        still.emplace(n, Known{*file, std::move(summary)});
      }
    }
    known_ = std::move(still);
    return listed;
  }

 private:
  struct Identity {
    dev_t device;
    ino_t inode;
    off_t size;
    struct timespec modified, changed;
    bool operator==(const Identity& o) const {
      return device == o.device && inode == o.inode && size == o.size &&
             modified.tv_sec == o.modified.tv_sec && modified.tv_nsec == o.modified.tv_nsec &&
             changed.tv_sec == o.changed.tv_sec && changed.tv_nsec == o.changed.tv_nsec;
    }
  };
  struct Known {
    Identity file;
    std::optional<Summary> summary;  // none: the manifest was refused
  };

  static std::optional<Identity> identity_of(const std::string& path) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) return std::nullopt;
    return Identity{st.st_dev, st.st_ino, st.st_size, st.st_mtim, st.st_ctim};
  }

  const std::string root_;
  std::mutex mutex_;
  std::map<std::string, Known> known_;  // by the checkpoint's name
};

namespace {

// The ranks that see one file system: this host (and boot and pid namespace) and this mount
// namespace.
std::string host_and_mounts() {
  struct stat st {};
  const uint64_t mounts = ::stat("/proc/self/ns/mnt", &st) == 0 ? st.st_ino : 0;
  return host::identity() + "/" + std::to_string(mounts);
}

// The snapshot's copies are marked in groups of this many chunks or bytes, whichever
// comes first: the writer writes the groups complete while the later ones are copied.
constexpr size_t kMarkChunks = 16;
constexpr uint64_t kMarkBytes = uint64_t{16} << 20;
// A save's metadata, keys and values as JSON strings (quoted, escaped), in all.
constexpr uint64_t kMaxMetadataJsonBytes = uint64_t{64} << 20;

// Waits for a collective of the checkpoint's own communicator. The background writer's
// waits are not counted as host syncs: they block no thread of the training.
Status finish(const std::shared_ptr<Work>& work, bool counted) {
  if (counted) return work->wait();
  HPS_RETURN_IF_ERROR(work->done_event().synchronize_uncounted());
  return work->status();
}

Status broadcast_string(Communicator& comm, std::string& text, bool counted) {
  int64_t length = static_cast<int64_t>(text.size());
  HPS_ASSIGN_OR_RETURN(auto w, comm.broadcast(&length, 1, DType::kInt64, 0));
  HPS_RETURN_IF_ERROR(finish(w, counted));
  if (length < 0 || length > (int64_t{1} << 31)) return internal_error("checkpoint: bad length");
  text.resize(static_cast<size_t>(length));
  if (length == 0) return Status::Ok();
  HPS_ASSIGN_OR_RETURN(w, comm.broadcast(text.data(), text.size(), DType::kUInt8, 0));
  return finish(w, counted);
}

StatusOr<std::vector<std::string>> all_gather_strings(Communicator& comm, const std::string& mine,
                                                      bool counted) {
  const size_t n = static_cast<size_t>(comm.size());
  int64_t length = static_cast<int64_t>(mine.size());
  std::vector<int64_t> lengths(n);
  HPS_ASSIGN_OR_RETURN(auto w, comm.all_gather(&length, lengths.data(), 1, DType::kInt64));
  HPS_RETURN_IF_ERROR(finish(w, counted));
  int64_t longest = 0;
  for (int64_t l : lengths) {
    if (l < 0 || l > (int64_t{1} << 30)) return internal_error("checkpoint: bad length");
    longest = std::max(longest, l);
  }
  std::vector<std::string> out(n);
  if (longest == 0) return out;
  const size_t width = static_cast<size_t>(longest);
  std::string send(width, '\0'), all(width * n, '\0');
  std::memcpy(send.data(), mine.data(), mine.size());
  HPS_ASSIGN_OR_RETURN(w, comm.all_gather(send.data(), all.data(), width, DType::kUInt8));
  HPS_RETURN_IF_ERROR(finish(w, counted));
  for (size_t r = 0; r < n; ++r) out[r] = all.substr(r * width, static_cast<size_t>(lengths[r]));
  return out;
}

// "ok" or "<code>\n<message>": a Status through a string collective.
std::string encode(const Status& s) {
  if (s.ok()) return "ok";
  return std::to_string(static_cast<int32_t>(s.code())) + "\n" + s.message();
}

Status decode(const std::string& text, const std::string& context) {
  if (text == "ok") return Status::Ok();
  const size_t newline = text.find('\n');
  int32_t code = static_cast<int32_t>(StatusCode::kInternal);
  try {
    code = std::stoi(text.substr(0, newline));
  } catch (const std::exception&) {
  }
  if (code <= 0 || code > static_cast<int32_t>(StatusCode::kBackendError)) {
    code = static_cast<int32_t>(StatusCode::kInternal);
  }
  const std::string message = newline == std::string::npos ? text : text.substr(newline + 1);
  return Status(static_cast<StatusCode>(code), context + message);
}

int64_t now_unix_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// A root holds the checkpoints of one part of a model cut across mp and pp (or of a whole
// model): its rotation counts and deletes every checkpoint under it, and `latest` names one.
// The first part's engine to create a checkpointer there claims it with this file, written
// aside and linked into place (atomic: one claim wins, on every host of a shared file
// system); a whole model's root has none. Where there is none yet, the checkpoints already
// under the root must be of the engine's own part (a whole model's among them).
constexpr char kPartFile[] = ".hpshard-part";

std::string part_text(const CheckpointTopology& t) {
  if (t.mp == 1 && t.pp == 1) return "the whole model";
  return "the model's part at mp rank " + std::to_string(t.mp_rank) + " of " +
         std::to_string(t.mp) + ", pp rank " + std::to_string(t.pp_rank) + " of " +
         std::to_string(t.pp);
}

bool same_part(const CheckpointTopology& a, const CheckpointTopology& b) {
  return a.mp == b.mp && a.mp_rank == b.mp_rank && a.pp == b.pp && a.pp_rank == b.pp_rank;
}

// A root no part has claimed may still hold checkpoints, of a whole model or written before
// parts claimed roots: this engine takes it only if every checkpoint there (as rotation
// counts them) is of its own part.
Status check_unclaimed_root(const std::string& root, const CheckpointTopology& t,
                            PublishedManifests& manifests) {
  std::vector<std::string> unreadable;
  HPS_ASSIGN_OR_RETURN(auto listed, manifests.list(&unreadable));
  for (const auto& [n, m] : listed) {
    if (same_part(m.topology, t)) continue;
    return invalid_argument("checkpoint: the root '" + root + "' holds checkpoint '" +
                            shown_value(n) + "' of " + part_text(m.topology) + "; this engine is " +
                            part_text(t) +
                            ": give each part of the model its own root (its rotation and "
                            "'latest' would take the other part's checkpoints)");
  }
  // One whose manifest cannot be read (damaged, or a newer hpshard's) may be any part's: a
  // part does not take the root (a whole model, whose root it most likely is, still saves).
  if (!unreadable.empty() && (t.mp > 1 || t.pp > 1)) {
    return invalid_argument("checkpoint: the root '" + root + "' holds checkpoint '" +
                            shown_value(unreadable.front()) +
                            "' whose manifest cannot be read (damaged, or written by a newer "
                            "hpshard), so which part of a model wrote it is unknown; this "
                            "engine is " +
                            part_text(t) + ": give it a root of its own");
  }
  return Status::Ok();
}

// The metadata keys of a part's safetensors export: its mp, mp rank, pp and pp rank.
constexpr const char* kPartKeys[] = {"hpshard_mp", "hpshard_mp_rank", "hpshard_pp",
                                     "hpshard_pp_rank"};

// A safetensors file exported from a part's checkpoint initialises only that part (a file
// without the keys, from elsewhere, is taken as it is: its names and shapes are checked).
Status check_safetensors_part(const std::string& path,
                              const std::map<std::string, std::string>& metadata,
                              const CheckpointTopology& t) {
  CheckpointTopology file;
  bool any = false;
  int32_t* fields[] = {&file.mp, &file.mp_rank, &file.pp, &file.pp_rank};
  for (size_t k = 0; k < 4; ++k) {
    auto it = metadata.find(kPartKeys[k]);
    if (it == metadata.end()) continue;
    any = true;
    const std::string& text = it->second;
    int64_t v = -1;
    if (!text.empty() && text.size() <= 9 &&
        std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      v = std::stoll(text);
    }
    if (v < 0 || v > (1 << 24)) {
      return invalid_argument("checkpoint: " + path + ": metadata '" + kPartKeys[k] + "' is '" +
                              shown_value(text) + "', not a part's coordinate");
    }
    *fields[k] = static_cast<int32_t>(v);
  }
  if (!any || same_part(file, t)) return Status::Ok();
  return invalid_argument("checkpoint: " + path + " was exported from " + part_text(file) +
                          "; this engine is " + part_text(t));
}

// The root's save lock (ckpt::kSaveLockFile), held from construction to destruction. The
// file is removed while still locked, so a process that opened it before the removal finds
// on locking that its file is no longer the one the name holds, and opens the name again.
class SaveLock {
 public:
  // Waits until the lock is free, up to `patience`, or until `stopped` says to give up.
  static StatusOr<SaveLock> acquire(const std::string& root, Milliseconds patience,
                                    const std::function<bool()>& stopped) {
    const std::string path = join_path(root, std::string(ckpt::kSaveLockFile));
    const auto deadline = std::chrono::steady_clock::now() + patience;
    std::string holder;
    while (true) {
      const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
      if (fd < 0) {
        return backend_error("checkpoint: cannot open the save lock '" + path +
                             "': " + std::strerror(errno));
      }
      if (::flock(fd, LOCK_EX | LOCK_NB) == 0) {
        struct stat mine {};
        struct stat named {};
        if (::fstat(fd, &mine) == 0 && ::stat(path.c_str(), &named) == 0 &&
            mine.st_dev == named.st_dev && mine.st_ino == named.st_ino) {
          char host[256] = {};
          (void)::gethostname(host, sizeof host - 1);
          const std::string text =
              "pid " + std::to_string(::getpid()) + " on " + std::string(host) + "\n";
          // The holder's name is for messages only: the lock holds without it.
          const bool named_holder =
              ::ftruncate(fd, 0) == 0 &&
              ::pwrite(fd, text.data(), text.size(), 0) == static_cast<ssize_t>(text.size());
          (void)named_holder;
          return SaveLock(fd, path);
        }
        ::close(fd);  // removed by its holder in between: lock the name's new file
        continue;
      }
      const int err = errno;
      if (err == ENOLCK || err == EOPNOTSUPP || err == ENOSYS || err == EINVAL) {
        // A file system without flock: saves go on unlocked, as they did before the lock.
        HPS_LOG(kWarn) << "checkpoint: '" << path << "' cannot be locked here ("
                       << std::strerror(err) << "); one job at a time must save into '" << root
                       << "'";
        return SaveLock(fd, path);
      }
      if (err != EWOULDBLOCK && err != EINTR) {
        ::close(fd);
        return backend_error("checkpoint: cannot lock '" + path + "': " + std::strerror(err));
      }
      char text[300] = {};
      const ssize_t n = ::pread(fd, text, sizeof text - 1, 0);
      std::string held(text, n > 0 ? static_cast<size_t>(n) : 0);
      while (!held.empty() && (held.back() == '\n' || held.back() == ' ')) held.pop_back();
      holder = shown_value(held);
      ::close(fd);
      if (stopped && stopped()) {
        return aborted(
            "checkpoint: the group was aborted while the save waited for the root's "
            "save lock");
      }
      if (std::chrono::steady_clock::now() >= deadline) {
        return timeout_error("checkpoint: another save into '" + root + "' held its lock ('" +
                             path + "'" + (holder.empty() ? std::string() : ": " + holder) +
                             ") for " + std::to_string(patience.count()) +
                             " ms; one job at a time saves into a root, so nothing was saved");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

  SaveLock(SaveLock&& other) noexcept
      : fd_(std::exchange(other.fd_, -1)), path_(std::move(other.path_)) {}
  SaveLock& operator=(SaveLock&&) = delete;
  SaveLock(const SaveLock&) = delete;
  ~SaveLock() {
    if (fd_ < 0) return;
    (void)::unlink(path_.c_str());  // still locked: see the class comment
    ::close(fd_);
  }

 private:
  SaveLock(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  int fd_;
  std::string path_;
};

// What saves a crash interrupted left in `root`: their temporary directories, the
// directories of a keep_last deletion, a half-written replacement of the latest pointer.
// Only under the root's save lock (no save of another job is in flight).
Status remove_leftovers(const std::string& root) {
  HPS_ASSIGN_OR_RETURN(auto names, ckpt::list_directory(root));
  for (const auto& n : names) {
    if (starts_with(n, ckpt::kTemporaryPrefix) || starts_with(n, ckpt::kTrashPrefix)) {
      (void)ckpt::remove_tree(join_path(root, n));
    } else if (starts_with(n, ckpt::kLatestTemporaryPrefix)) {
      (void)::unlink(join_path(root, n).c_str());  // a file, never a checkpoint
    }
  }
  return Status::Ok();
}

// The files a claim writes aside exist for a moment; one a crash left behind (an hour
// old) is removed by the next part that claims the root.
void remove_stale_claims(const std::string& root) {
  auto names = ckpt::list_directory(root);
  if (!names.ok()) return;
  const std::string prefix = std::string(kPartFile) + ".tmp-";
  const auto now = std::filesystem::file_time_type::clock::now();
  for (const auto& n : *names) {
    if (n.compare(0, prefix.size(), prefix) != 0) continue;
    std::error_code ec;
    const std::string path = join_path(root, n);
    const auto status = std::filesystem::symlink_status(path, ec);
    if (ec || !std::filesystem::is_regular_file(status)) continue;
    const auto written = std::filesystem::last_write_time(path, ec);
    if (!ec && now - written > std::chrono::hours(1)) (void)::unlink(path.c_str());
  }
}

// Puts `text` at `marker` unless something is there already (then OK: the caller reads
// it): written aside and hard-linked into place, so a reader never sees it half written and
// one claim wins on every host of a shared file system; where the file system has no hard
// links, renamed into place without replacing (renameat2), or, where that is missing too,
// created exclusively.
Status place_claim(const std::string& marker, const std::string& text) {
  HPS_ASSIGN_OR_RETURN(const std::string aside, ckpt::write_beside(marker, text));
  int err = place_new(aside, marker);
  if (err != 0) (void)::unlink(aside.c_str());
  if (placing_unsupported(err)) {
    const int fd = ::open(marker.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    err = fd >= 0 ? 0 : errno;
    if (fd >= 0) {
      const bool written =
          ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()) &&
          ::fsync(fd) == 0;
      err = written ? 0 : errno;
      ::close(fd);
      if (!written) (void)::unlink(marker.c_str());
    }
  }
  if (err != 0 && err != EEXIST) {
    return backend_error("checkpoint: cannot create '" + marker + "': " + std::strerror(err));
  }
  return Status::Ok();
}

Status claim_root(const std::string& root, const CheckpointTopology& t,
                  PublishedManifests& manifests) {
  const std::string marker = join_path(root, kPartFile);
  const std::string mine = part_text(t);
  const bool part = t.mp > 1 || t.pp > 1;
  if (!ckpt::path_exists(marker)) HPS_RETURN_IF_ERROR(check_unclaimed_root(root, t, manifests));
  if (part) remove_stale_claims(root);
  if (part && !ckpt::path_exists(marker)) HPS_RETURN_IF_ERROR(place_claim(marker, mine + "\n"));
  std::string claimed = "the whole model";
  if (ckpt::path_exists(marker)) {
    HPS_ASSIGN_OR_RETURN(std::string text, ckpt::read_file(marker, 256));
    if (!text.empty() && text.back() == '\n') text.pop_back();
    claimed = shown_value(text);
  }
  if (claimed == mine) return Status::Ok();
  return invalid_argument("checkpoint: the root '" + root + "' holds the checkpoints of " +
                          claimed + " (" + marker + "); this engine is " + mine +
                          ": give each part of the model its own root (its rotation and "
                          "'latest' would take the other part's checkpoints)");
}

// Ordered by publication: its sequence, then (for equal ones: written without one, or at
// the limit) its creation time and name.
struct Published {
  uint64_t sequence;
  int64_t created_unix_ns;
  std::string name;
  std::string id;
  uint64_t model;
  bool operator<(const Published& o) const {
    return std::tie(sequence, created_unix_ns, name) <
           std::tie(o.sequence, o.created_unix_ns, o.name);
  }
};

// The checkpoints published under the root (a valid name and a manifest this code reads),
// oldest first. Directories of another kind are not listed.
StatusOr<std::vector<Published>> published_checkpoints(PublishedManifests& manifests) {
  HPS_ASSIGN_OR_RETURN(auto listed, manifests.list());
  std::vector<Published> published;
  for (auto& [n, m] : listed) {
    published.push_back({m.sequence, m.created_unix_ns, std::move(n), std::move(m.id), m.model});
  }
  std::sort(published.begin(), published.end());
  return published;
}

// A checkpoint's name as one value of a collective: odd, so never kFailed or kDiffer.
constexpr uint64_t kFailed = 0, kDiffer = 2;
uint64_t name_value(const std::string& name) {
  return ckpt::checksum(name.data(), name.size()) | 1;
}
uint64_t same_or_differ(uint64_t a, uint64_t b) {
  if (a == kFailed || b == kFailed) return kFailed;
  return a == b ? a : kDiffer;
}

}  // namespace

// What one save carries from save() (the caller's thread) to its writer thread.
struct Checkpointer::SaveJob {
  std::string name;
  std::map<std::string, std::string> metadata;
  std::vector<StateTensor> tensors;
  struct Written {
    size_t tensor;
    uint64_t offset;  // in the data file
  };
  std::vector<Written> written;
  // The checksummed chunks of the written ranges, in file order; their sums are taken by
  // the snapshot's copies where they run on the host, by the writer otherwise.
  struct Chunk {
    size_t tensor;
    uint64_t begin, end;  // elements of the logical tensor
    uint64_t offset;      // in the data file
    uint64_t sum = 0;
  };
  std::vector<Chunk> chunks;
  bool summed = false;
  // The snapshot in groups of chunks, in file order: once `event` completes, the chunks
  // [first, last) are in the staging memory, the file's first `ready` bytes with them.
  struct Mark {
    size_t first, last;
    uint64_t ready;
    std::unique_ptr<Event> event;
  };
  std::vector<Mark> marks;
  uint64_t file_bytes = 0;    // header and data; 0 when this rank writes nothing
  ckpt::HostStaging staging;  // the data file, header included, and its rounding
  std::unique_ptr<Event> snapshot;
  CheckpointTopology topology;
  EngineOptions engine_options;
  int64_t steps = 0;               // the engine's steps_taken() at save()
  std::string id;                  // agreed on by the writers
  std::string directory;           // the temporary directory
  std::vector<std::string> trash;  // rank 0: older checkpoints renamed away, to delete
};

Checkpointer::Checkpointer(Checkpointable& engine, std::unique_ptr<Communicator> comm,
                           std::string root, CheckpointOptions options,
                           std::unique_ptr<Stream> side,
                           std::unique_ptr<PublishedManifests> manifests)
    : engine_(engine),
      comm_(std::move(comm)),
      root_(std::move(root)),
      options_(options),
      side_(std::move(side)),
      manifests_(std::move(manifests)) {}

Checkpointer::~Checkpointer() {
  std::lock_guard calls(calls_);
  if (writer_.joinable()) writer_.join();
}

StatusOr<std::unique_ptr<Checkpointer>> Checkpointer::create(Checkpointable& engine,
                                                             std::shared_ptr<Communicator> group,
                                                             std::string root,
                                                             CheckpointOptions options) {
  if (!group) return invalid_argument("checkpoint: the group communicator is null");
  if (group->device().type != DeviceType::kCpu) {
    return invalid_argument(
        "checkpoint: the group must be a CPU communicator (its ranks agree "
        "on each save in host memory), not one on " +
        group->device().to_string());
  }
  const CheckpointTopology t = engine.checkpoint_topology();
  if (group->size() != t.sharding * t.dp) {
    return invalid_argument("checkpoint: the group has " + std::to_string(group->size()) +
                            " ranks but the engine's state is held by " +
                            std::to_string(t.sharding * t.dp) + " (sharding " +
                            std::to_string(t.sharding) + " x dp " + std::to_string(t.dp) + ")");
  }
  if (root.empty()) return invalid_argument("checkpoint: the root directory is empty");
  if (options.keep_last < 0) return invalid_argument("checkpoint: keep_last must be >= 0");
  if (options.chunk_bytes < 1 || options.chunk_bytes > ckpt::kMaxChunkBytes) {
    return invalid_argument("checkpoint: chunk_bytes must be in [1, 2^34]");
  }
  if (options.timeout.count() <= 0) return invalid_argument("checkpoint: timeout must be > 0");
  // A timeout longer than a year is a year: deadlines (now + the timeout, or half of it for
  // the save lock) never overflow.
  CheckpointOptions bounded = options;
  bounded.timeout = std::min(options.timeout, kMaxStoreWait);
  std::vector<int32_t> everyone(static_cast<size_t>(group->size()));
  std::iota(everyone.begin(), everyone.end(), 0);
  HPS_ASSIGN_OR_RETURN(auto comm,
                       group->split(everyone, derived_comm_name(group->name(), ".checkpoint")));
  comm->set_timeout(bounded.timeout);
  std::error_code ec;
  std::filesystem::create_directories(root, ec);
  if (ec) return backend_error("checkpoint: cannot create '" + root + "': " + ec.message());
  auto manifests = std::make_unique<PublishedManifests>(root);
  HPS_RETURN_IF_ERROR(claim_root(root, t, *manifests));
  HPS_ASSIGN_OR_RETURN(auto side, create_stream(engine.state_stream().device()));
  side->set_name("checkpoint snapshot, rank " + std::to_string(comm->rank()));
  return std::unique_ptr<Checkpointer>(new Checkpointer(
      engine, std::move(comm), std::move(root), bounded, std::move(side), std::move(manifests)));
}

Status Checkpointer::wait() {
  std::lock_guard calls(calls_);
  if (!in_flight_) return Status::Ok();
  Status s = in_flight_->wait();
  if (writer_.joinable()) writer_.join();
  return s;
}

StatusOr<std::shared_ptr<Work>> Checkpointer::save(const std::string& name,
                                                   std::map<std::string, std::string> metadata) {
  std::lock_guard calls(calls_);
  HPS_RETURN_IF_ERROR(ckpt::check_checkpoint_name(name));
  // The manifest and an export's safetensors header carry the metadata: in all it stays
  // well within what their readers take (kMaxManifestBytes, kMaxSafetensorsHeaderBytes).
  if (metadata.size() > ckpt::kMaxMetadataEntries) {
    return invalid_argument("checkpoint: the metadata has " + std::to_string(metadata.size()) +
                            " entries, more than the " + std::to_string(ckpt::kMaxMetadataEntries) +
                            " allowed");
  }
  uint64_t written = 0;
  for (const auto& [key, value] : metadata) {
    if (key.empty() || key.size() > ckpt::kMaxNameBytes || value.size() > (size_t{1} << 20)) {
      return invalid_argument(
          "checkpoint: metadata keys need 1 to 4096 bytes, values at most 1 MiB");
    }
    // The manifest is JSON: a key or value that is not UTF-8 could not be written as it is.
    for (const std::string* text : {&key, &value}) {
      if (!is_utf8(*text)) {
        return invalid_argument("checkpoint: metadata " +
                                std::string(text == &key ? "key" : "value of key") + " '" +
                                shown_value(key) + "' is not valid UTF-8");
      }
      written += json(*text).dump().size();
    }
  }
  if (written > kMaxMetadataJsonBytes) {
    return invalid_argument("checkpoint: the metadata takes " + std::to_string(written) +
                            " bytes as JSON, more than the " +
                            std::to_string(kMaxMetadataJsonBytes) + " allowed");
  }
  finish_in_flight();  // a second save waits for the first (documented)
  if (ckpt::path_exists(join_path(root_, name))) {
    return already_exists("checkpoint: '" + join_path(root_, name) + "' exists already");
  }
  auto job = std::make_unique<SaveJob>();
  job->name = name;
  job->metadata = std::move(metadata);
  HPS_ASSIGN_OR_RETURN(job->tensors, engine_.state_tensors());
  job->topology = engine_.checkpoint_topology();
  job->engine_options = engine_.checkpoint_options();
  job->steps = engine_.steps_taken();
  // The data file's layout: this rank's written ranges back to back, 64-byte aligned.
  uint64_t at = ckpt::kDataHeaderBytes;
  for (size_t i = 0; i < job->tensors.size(); ++i) {
    const StateTensor& t = job->tensors[i];
    if (!t.writer || t.begin == t.end) continue;
    at = ckpt::round_up(at, ckpt::kDataAlignment);
    job->written.push_back({i, at});
    const uint64_t element = dtype_size(t.dtype);
    const uint64_t per_chunk = std::max<uint64_t>(1, options_.chunk_bytes / element);
    for (const auto& [b, e] : ckpt::cut_into_chunks(t.begin, t.end, per_chunk)) {
      job->chunks.push_back({i, b, e, at + (b - t.begin) * element});
    }
    at += (t.end - t.begin) * element;
  }
  Stream& state = engine_.state_stream();
  if (!job->written.empty()) {
    job->file_bytes = at;
    // Room for write_whole's rounding of the file.
    HPS_ASSIGN_OR_RETURN(job->staging,
                         take_staging(state.device(), ckpt::round_up(at, File::kDirectAlignment)));
    // Alignment gaps are zeros in the file.
    uint64_t end = ckpt::kDataHeaderBytes;
    for (const auto& w : job->written) {
      std::memset(job->staging.data() + end, 0, w.offset - end);
      const StateTensor& t = job->tensors[w.tensor];
      end = w.offset + (t.end - t.begin) * dtype_size(t.dtype);
    }
  }
  // The snapshot: after the work on the state stream so far, on the side stream; the state
  // stream's later work (the next steps' updates) waits for the copies.
  Status snapshot = [&]() -> Status {
    HPS_ASSIGN_OR_RETURN(auto ready, create_event(state.device()));
    HPS_RETURN_IF_ERROR(ready->record(state));
    HPS_RETURN_IF_ERROR(side_->wait(*ready));
    // In groups (kMarkChunks, kMarkBytes), each marked by an event, so the writer writes a
    // group while the next ones are copied.
    auto* host = dynamic_cast<cpu::HostQueue*>(side_.get());
    job->summed = host != nullptr;
    uint8_t* staging = job->staging.data();
    auto bytes_of = [&](const SaveJob::Chunk& c) {
      return (c.end - c.begin) * dtype_size(job->tensors[c.tensor].dtype);
    };
    auto source_of = [&](const SaveJob::Chunk& c) {
      const StateTensor& t = job->tensors[c.tensor];
      return static_cast<const uint8_t*>(t.data) + (c.begin - t.begin) * dtype_size(t.dtype);
    };
    for (size_t first = 0; first < job->chunks.size();) {
      size_t last = first;
      for (uint64_t group = 0; last < job->chunks.size() && last - first < kMarkChunks &&
                               (last == first || group < kMarkBytes);
           ++last) {
        group += bytes_of(job->chunks[last]);
      }
      for (size_t i = first; i < last; ++i) {
        SaveJob::Chunk& c = job->chunks[i];
        if (host != nullptr) {
          // On the host each chunk is checksummed as it is copied (one pass over the state).
          host->enqueue(
              [&c, dst = staging + c.offset, src = source_of(c), bytes = bytes_of(c)] {
                c.sum = ckpt::copy_with_checksum(dst, src, bytes);
              },
              "checkpoint snapshot");
          continue;
        }
        // One copy for the group's chunks of one tensor (back to back on both sides).
        size_t run = i;
        uint64_t bytes = bytes_of(c);
        while (run + 1 < last && job->chunks[run + 1].tensor == c.tensor) {
          bytes += bytes_of(job->chunks[++run]);
        }
        HPS_RETURN_IF_ERROR(side_->memcpy_async(staging + c.offset, source_of(c), bytes));
        i = run;
      }
      SaveJob::Mark mark{first, last,
                         job->chunks[last - 1].offset + bytes_of(job->chunks[last - 1]), nullptr};
      HPS_ASSIGN_OR_RETURN(mark.event, create_event(state.device()));
      HPS_RETURN_IF_ERROR(mark.event->record(*side_));
      job->marks.push_back(std::move(mark));
      first = last;
    }
    HPS_ASSIGN_OR_RETURN(job->snapshot, create_event(state.device()));
    HPS_RETURN_IF_ERROR(job->snapshot->record(*side_));
    return state.wait(*job->snapshot);
  }();
  if (!snapshot.ok()) {
    // Copies may be queued into the staging memory this return frees.
    (void)side_->synchronize();
    return snapshot;
  }

  auto done = std::make_unique<cpu::CpuEvent>();
  auto mark = done->record_detached();
  auto work = std::make_shared<Work>("checkpoint save '" + name + "'", std::move(done));
  writer_ = std::thread([this, job = std::move(job), work, mark]() mutable {
    // Beside training, the writing takes what the training threads leave.
    (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 10);
    if (Status d = use_device_on_this_thread(job->snapshot->device()); !d.ok()) {
      HPS_LOG(kWarn) << "checkpoint writer: " << d.to_string();
    }
    Status s;
    try {
      s = write_job(*job);
    } catch (const std::exception& e) {
      s = internal_error(std::string("checkpoint: unexpected exception: ") + e.what());
    }
    // A failed save may have stopped before the snapshot's last copies into the staging
    // memory: they complete before it is kept for the next save.
    (void)job->snapshot->synchronize_uncounted();
    keep_staging(std::move(job->staging));
    std::vector<std::string> trash = std::move(job->trash);
    job.reset();
    work->set_status(s);
    mark->complete();
    // The checkpoints beyond keep_last are gone from the root already (renamed away); their
    // files go after the save completes, before the next save or load starts (both join
    // this thread), or at the next save's start after a crash.
    for (const auto& path : trash) (void)ckpt::remove_tree(path);
  });
  in_flight_ = work;
  return work;
}

Status Checkpointer::write_job(SaveJob& job) {
  Communicator& comm = *comm_;
  const int32_t rank = comm.rank();
  // 1. Rank 0 takes the root's save lock, held until the checkpoint is published, and
  //    picks the id and creates the temporary directory; leftovers of saves a crash
  //    interrupted go first (under the lock, no other save is in flight in the root).
  std::string agreed;
  std::optional<SaveLock> lock;
  if (rank == 0) {
    auto locked = SaveLock::acquire(root_, Milliseconds(options_.timeout.count() / 2),
                                    [&comm] { return comm.was_aborted(); });
    Status s = locked.status();
    if (locked.ok()) {
      lock.emplace(std::move(*locked));
      s = remove_leftovers(root_);
    }
    job.id = ckpt::new_checkpoint_id();
    job.directory = join_path(root_, std::string(ckpt::kTemporaryPrefix) + job.name + "-" + job.id);
    if (s.ok() && ckpt::path_exists(join_path(root_, job.name))) {
      s = already_exists("checkpoint: '" + join_path(root_, job.name) + "' exists already");
    }
    if (s.ok()) s = ckpt::make_directory(job.directory);
    agreed =
        s.ok() ? "ok\n" + job.id + "\n" + std::to_string(job.steps) + "\n" + job.name : encode(s);
  }
  // Rank 0 removes the temporary directory on every way out short of publishing it (which
  // renames it: removing the old name is then a no-op), a peer's death included.
  struct RemoveUnpublished {
    const std::string& directory;
    bool armed;
    ~RemoveUnpublished() {
      if (armed && !directory.empty()) (void)ckpt::remove_tree(directory);
    }
  } unpublished{job.directory, rank == 0};
  HPS_RETURN_IF_ERROR(broadcast_string(comm, agreed, false));
  if (!starts_with(agreed, "ok\n")) return decode(agreed, "");
  // "ok\n<id>\n<rank 0's steps>\n<rank 0's name>": a rank that was asked for another name,
  // or after another number of steps, writes nothing and fails the save on every rank
  // (step 3).
  const size_t newline = agreed.find('\n', 3);
  const size_t steps_end = newline == std::string::npos ? newline : agreed.find('\n', newline + 1);
  if (steps_end == std::string::npos) return internal_error("checkpoint: bad agreement message");
  job.id = agreed.substr(3, newline - 3);
  const std::string steps_of_rank0 = agreed.substr(newline + 1, steps_end - newline - 1);
  const std::string name_of_rank0 = agreed.substr(steps_end + 1);
  job.directory =
      join_path(root_, std::string(ckpt::kTemporaryPrefix) + name_of_rank0 + "-" + job.id);

  // 2. This rank's data file, written while the snapshot fills the staging memory (the
  //    header in its first bytes, so the file goes to the disk in one piece), fsync. Where
  //    the snapshot did not checksum its chunks, each group's are checksummed here as it
  //    completes, before it is written.
  json report;
  json tensors = json::array();
  const std::string file = ckpt::data_file_name(rank);
  Status local;
  if (name_of_rank0 != job.name) {
    (void)job.snapshot->synchronize_uncounted();
    local = invalid_argument("checkpoint: the ranks saved under different names (rank 0: '" +
                             name_of_rank0 + "', rank " + std::to_string(rank) + ": '" + job.name +
                             "'), so nothing was published");
  } else if (steps_of_rank0 != std::to_string(job.steps)) {
    (void)job.snapshot->synchronize_uncounted();
    local = invalid_argument(
        "checkpoint: the ranks saved '" + job.name +
        "' at different points of training (rank "
        "0 after " +
        steps_of_rank0 + " steps, rank " + std::to_string(rank) + " after " +
        std::to_string(job.steps) +
        "): each saves the state its last step left, so the "
        "checkpoint would mix two steps; nothing was published (every rank saves after the "
        "same step() calls)");
  } else if (job.written.empty()) {
    local = job.snapshot->synchronize_uncounted();
  } else {
    const std::string header = ckpt::data_file_header(job.id, rank);
    std::memcpy(job.staging.data(), header.data(), ckpt::kDataHeaderBytes);
    size_t next = 0;  // the first group not known complete
    auto ready = [&job, &next, &comm](size_t so_far) -> StatusOr<size_t> {
      uint64_t now = so_far;
      // The groups complete by now; the next one waited for when none is.
      while (next < job.marks.size()) {
        SaveJob::Mark& m = job.marks[next];
        if (now > so_far) {
          HPS_ASSIGN_OR_RETURN(bool complete, m.event->query());
          if (!complete) break;
        } else {
          HPS_RETURN_IF_ERROR(m.event->synchronize_uncounted());
        }
        for (size_t i = m.first; i < m.last && !job.summed; ++i) {
          SaveJob::Chunk& c = job.chunks[i];
          const uint64_t element = dtype_size(job.tensors[c.tensor].dtype);
          c.sum = ckpt::checksum(job.staging.data() + c.offset, (c.end - c.begin) * element);
        }
        now = m.ready;
        ++next;
      }
      // The reports' gathering would fail anyway: not after writing the rest.
      if (comm.was_aborted()) {
        return aborted("checkpoint: the group was aborted while the save wrote its data file");
      }
      return static_cast<size_t>(now);
    };
    auto f = File::create(join_path(job.directory, file));
    local = f.status();
    if (local.ok()) local = f->write_whole(job.staging.data(), job.file_bytes, ready);
    if (local.ok()) local = f->sync();
    if (local.ok()) local = f->close();
  }
  std::vector<json> chunks_of(job.tensors.size(), json::array());
  for (const SaveJob::Chunk& c : job.chunks) {
    if (!local.ok()) break;
    chunks_of[c.tensor].push_back({c.begin, c.end, c.offset, ckpt::hex64(c.sum)});
  }
  for (size_t i = 0; i < job.tensors.size(); ++i) {
    const StateTensor& t = job.tensors[i];
    tensors.push_back({{"name", t.name},
                       {"dtype", std::string(dtype_name(t.dtype))},
                       {"shape", t.shape},
                       {"chunks", std::move(chunks_of[i])}});
  }
  report["status"] = encode(local);
  report["file_bytes"] = local.ok() ? job.file_bytes : 0;
  report["tensors"] = std::move(tensors);

  // 3. Every writer's report reaches rank 0, which publishes or cleans up.
  HPS_ASSIGN_OR_RETURN(
      auto reports,
      all_gather_strings(comm, report.dump(-1, ' ', false, json::error_handler_t::replace), false));
  std::string result;
  if (rank == 0) {
    std::string published;
    Status s = publish(job, reports, published);
    if (s.ok()) job.trash = collect_garbage(job.name, job.topology);
    lock.reset();
    result = encode(s);
  }
  HPS_RETURN_IF_ERROR(broadcast_string(comm, result, false));
  return decode(result, "");
}

Status Checkpointer::publish(SaveJob& job, const std::vector<std::string>& reports,
                             std::string& directory) {
  ckpt::Manifest m;
  m.id = job.id;
  m.name = job.name;
  m.chunk_bytes = options_.chunk_bytes;
  m.topology = job.topology;
  m.world = comm_->size();
  m.engine = job.engine_options;
  m.metadata = job.metadata;
  std::map<std::string, size_t> index;
  for (size_t r = 0; r < reports.size(); ++r) {
    const json rj = json::parse(reports[r], nullptr, false);
    if (rj.is_discarded() || !rj.is_object()) {
      return internal_error("checkpoint: " + comm_->rank_names()(static_cast<int32_t>(r)) +
                            " sent a garbled report");
    }
    HPS_RETURN_IF_ERROR(decode(
        rj.at("status").get<std::string>(),
        "checkpoint: " + comm_->rank_names()(static_cast<int32_t>(r)) + " failed to write: "));
    const uint64_t bytes = rj.at("file_bytes").get<uint64_t>();
    const uint32_t file = static_cast<uint32_t>(m.files.size());
    if (bytes > 0)
      m.files.push_back(
          {ckpt::data_file_name(static_cast<int32_t>(r)), static_cast<int32_t>(r), bytes});
    for (const json& tj : rj.at("tensors")) {
      const std::string name = tj.at("name").get<std::string>();
      auto it = index.find(name);
      if (it == index.end()) {
        ckpt::StoredTensor t;
        t.name = name;
        t.dtype = *dtype_from_name(tj.at("dtype").get<std::string>());
        t.shape = tj.at("shape").get<std::vector<int64_t>>();
        t.numel = 1;
        for (int64_t d : t.shape) t.numel *= static_cast<uint64_t>(d);
        it = index.emplace(name, m.tensors.size()).first;
        m.tensors.push_back(std::move(t));
      }
      ckpt::StoredTensor& t = m.tensors[it->second];
      if (std::string(dtype_name(t.dtype)) != tj.at("dtype").get<std::string>() ||
          t.shape != tj.at("shape").get<std::vector<int64_t>>()) {
        return internal_error("checkpoint: ranks disagree on the dtype or shape of '" + name + "'");
      }
      for (const json& c : tj.at("chunks")) {
        t.chunks.push_back({file, c[0].get<uint64_t>(), c[1].get<uint64_t>(), c[2].get<uint64_t>(),
                            ckpt::parse_hex64(c[3].get<std::string>())});
      }
    }
  }
  // Exactly one writer for every element of every tensor.
  for (auto& t : m.tensors) {
    std::sort(
        t.chunks.begin(), t.chunks.end(),
        [](const ckpt::StoredChunk& a, const ckpt::StoredChunk& b) { return a.begin < b.begin; });
    uint64_t covered = 0;
    for (const auto& c : t.chunks) {
      if (c.begin != covered) break;
      covered = c.end;
    }
    if (covered != t.numel) {
      return internal_error("checkpoint: the ranks' written ranges of '" + t.name +
                            "' overlap or leave a gap (" + std::to_string(covered) + " of " +
                            std::to_string(t.numel) + " elements in order)");
    }
  }
  m.created_unix_ns = now_unix_ns();
  // After every checkpoint published under the root (under the save lock, so no other
  // job's save publishes in between).
  m.sequence = 1;
  if (auto listed = published_checkpoints(*manifests_); listed.ok() && !listed->empty()) {
    m.sequence = std::min(listed->back().sequence + 1, ckpt::kMaxSequence);
  }
  // The manifest last, then the directory's names, then the rename publishes it.
  HPS_RETURN_IF_ERROR(ckpt::sync_directory(job.directory));
  const std::string text = ckpt::manifest_to_json(m);
  if (text.size() > ckpt::kMaxManifestBytes) {  // a load would refuse it
    return invalid_argument("checkpoint: the manifest would have " + std::to_string(text.size()) +
                            " bytes, more than the " + std::to_string(ckpt::kMaxManifestBytes) +
                            " a load reads (a larger chunk_bytes makes fewer chunks)");
  }
  HPS_ASSIGN_OR_RETURN(File f,
                       File::create(join_path(job.directory, std::string(ckpt::kManifestFile))));
  HPS_RETURN_IF_ERROR(f.write_all(text.data(), text.size()));
  HPS_RETURN_IF_ERROR(f.sync());
  HPS_RETURN_IF_ERROR(f.close());
  HPS_RETURN_IF_ERROR(ckpt::sync_directory(job.directory));
  // The new `latest` is written aside before anything is published: a disk too full for it
  // fails the save with nothing published. Then the rename publishes the checkpoint and the
  // second renames the pointer over `latest`; one that fails (`latest` a directory) takes
  // the checkpoint back under its temporary name, which the save's way out removes.
  const std::string latest = join_path(root_, std::string(ckpt::kLatestFile));
  HPS_ASSIGN_OR_RETURN(const std::string pointer, ckpt::write_beside(latest, job.name + "\n"));
  directory = join_path(root_, job.name);
  Status s = ckpt::rename_path(job.directory, directory);
  if (s.ok()) {
    s = ckpt::sync_directory(root_);
    if (s.ok()) s = ckpt::rename_path(pointer, latest);
    if (!s.ok()) {
      const Status back = ckpt::rename_path(directory, job.directory);
      if (!back.ok()) {
        s = Status(s.code(), s.message() + "; and taking the checkpoint back failed, so '" +
                                 directory +
                                 "' stays, published but not named by 'latest': " + back.message());
      }
    }
  }
  if (!s.ok()) {
    (void)::unlink(pointer.c_str());
    (void)ckpt::sync_directory(root_);
    return s;
  }
  return ckpt::sync_directory(root_);
}

StatusOr<ckpt::HostStaging> Checkpointer::take_staging(Device device, size_t bytes) {
  {
    std::lock_guard lock(spare_mutex_);
    if (spare_.reuse(device, bytes)) return std::move(spare_);
  }
  return ckpt::HostStaging::allocate(device, bytes);
}

void Checkpointer::keep_staging(ckpt::HostStaging staging) {
  std::lock_guard lock(spare_mutex_);
  if (staging.size() >= spare_.size()) spare_ = std::move(staging);
}

std::vector<std::string> Checkpointer::collect_garbage(const std::string& keep,
                                                       const CheckpointTopology& part) {
  std::vector<std::string> trash;
  if (options_.keep_last <= 0) return trash;
  auto listed = published_checkpoints(*manifests_);
  if (!listed.ok()) return trash;
  // Only the checkpoints of this model rotate: another engine's under the same root (a
  // GAN's other network, a model before a new head was added) is never deleted by this
  // one's keep_last.
  auto mine = std::find_if(listed->begin(), listed->end(),
                           [&](const Published& p) { return p.name == keep; });
  if (mine == listed->end()) return trash;
  std::vector<Published> published;
  std::string others;
  for (Published& p : *listed) {
    if (p.model == mine->model) {
      published.push_back(std::move(p));
    } else if (others.empty()) {
      others = p.name;
    }
  }
  if (!others.empty() && !std::exchange(warned_of_other_models_, true)) {
    HPS_LOG(kWarn) << "checkpoint: keep_last leaves the checkpoints of another model under "
                   << shown_value(root_) << " (such as " << shown_value(others)
                   << "): give each model a root of its own";
  }
  // A part of a model keeps the one before its newest too: a save that did not complete on
  // every part then leaves one checkpoint every part holds (the one `latest` loads).
  const int32_t floor = part.mp > 1 || part.pp > 1 ? 2 : 1;
  const size_t keep_count = static_cast<size_t>(std::max(options_.keep_last, floor));
  if (published.size() <= keep_count) return trash;
  for (size_t i = 0; i + keep_count < published.size(); ++i) {
    const Published& p = published[i];
    if (p.name == keep) continue;
    // Renamed away first: a crash while its files go never leaves a half checkpoint.
    const std::string away =
        join_path(root_, std::string(ckpt::kTrashPrefix) + p.name + "-" + p.id);
    if (!ckpt::rename_path(join_path(root_, p.name), away).ok()) continue;
    (void)ckpt::sync_directory(root_);
    trash.push_back(away);
  }
  return trash;
}

Status Checkpointer::agree(const Status& local, const char* what, const std::string& source,
                           const std::string& on_host) {
  // "ok\n<source>\0<host>\0<on_host>" or an encoded failure.
  std::string mine = local.ok() ? "ok\n" + source : encode(local);
  if (local.ok()) {
    mine += '\0';
    mine += on_host.empty() ? std::string() : host_and_mounts();
    mine += '\0';
    mine += on_host;
  }
  HPS_ASSIGN_OR_RETURN(auto all, all_gather_strings(*comm_, mine, true));
  if (!local.ok()) return local;
  for (size_t r = 0; r < all.size(); ++r) {
    if (!starts_with(all[r], "ok\n")) {
      return decode(all[r], std::string("checkpoint: ") + what + " failed on " +
                                comm_->rank_names()(static_cast<int32_t>(r)) +
                                ", so no rank changed its engine: ");
    }
  }
  // Each rank's three fields; a rank that sent no separators names only a source.
  struct Said {
    std::string source, host, on_host;
  };
  std::vector<Said> said(all.size());
  for (size_t r = 0; r < all.size(); ++r) {
    const std::string& text = all[r];
    const size_t a = text.find('\0', 3);
    const size_t b = a == std::string::npos ? a : text.find('\0', a + 1);
    if (b == std::string::npos) {
      said[r].source = text.substr(3);
    } else {
      said[r] = {text.substr(3, a - 3), text.substr(a + 1, b - a - 1), text.substr(b + 1)};
    }
  }
  for (size_t r = 0; r < all.size(); ++r) {
    if (said[r].source != source) {
      return invalid_argument(std::string("checkpoint: the ranks would ") + what +
                              " different sources (this rank: " + shown_value(source) + ", rank " +
                              std::to_string(r) + ": " + shown_value(said[r].source) +
                              "), so no rank changed its engine; every rank names the same one");
    }
  }
  // Every rank judges every host alike, so all reach one verdict.
  std::map<std::string, size_t> first_of_host;
  for (size_t r = 0; r < all.size(); ++r) {
    if (said[r].host.empty() || said[r].on_host.empty()) continue;
    const auto [it, added] = first_of_host.emplace(said[r].host, r);
    const Said& first = said[it->second];
    if (added || first.on_host == said[r].on_host) continue;
    return invalid_argument(
        std::string("checkpoint: ranks ") + std::to_string(it->second) + " and " +
        std::to_string(r) + " of one host would " + what + " different files (" +
        shown_value(first.on_host) + " and " + shown_value(said[r].on_host) +
        " as device:inode:modified:size: the file was replaced while they opened it, or they "
        "named two copies), so no rank changed its engine; the ranks of a host read one file");
  }
  return Status::Ok();
}

Status Checkpointer::agree_across_parts(const Status& agreed, const std::string& name) {
  const std::vector<Communicator*> groups = engine_.model_parallel_groups();
  if (groups.empty()) return agreed;
  // kFailed: failed somewhere; kDiffer: the parts named different checkpoints.
  uint64_t mine = kFailed;
  if (agreed.ok()) mine = name.empty() ? 1 : name_value(name);
  HPS_ASSIGN_OR_RETURN(const uint64_t verdict, combine_over(groups, mine, same_or_differ));
  if (!agreed.ok()) return agreed;
  if (verdict == kFailed) {
    return aborted(
        "checkpoint: the load failed on another part of the model (mp or pp), so "
        "no part changed its engine (that part's ranks name the cause)");
  }
  if (verdict == kDiffer) {
    return invalid_argument(
        "checkpoint: the parts of the model (mp or pp) would load different checkpoints (this "
        "part: '" +
        shown_value(name) +
        "'), so no part changed its engine: load by name a checkpoint every part holds");
  }
  return Status::Ok();
}

StatusOr<std::string> Checkpointer::latest_of_every_part(const std::vector<Communicator*>& groups) {
  const StatusOr<std::string> latest = latest_checkpoint(root_);
  HPS_ASSIGN_OR_RETURN(
      const uint64_t verdict,
      combine_over(groups, latest.ok() ? name_value(*latest) : kFailed, same_or_differ));
  if (!latest.ok()) return latest.status();
  if (verdict == kFailed) {
    return aborted(
        "checkpoint: another part of the model (mp or pp) could not read its 'latest' (that "
        "part's ranks name the cause), so no part changed its engine");
  }
  if (verdict != kDiffer) return *latest;
  // A save that did not complete on every part left their `latest` apart: the newest
  // checkpoint every part holds, by this part's order of publication (a part whose order
  // differs names another one, and the load's agreement refuses it).
  auto listed = published_checkpoints(*manifests_);
  std::vector<Published> newest_first;
  if (listed.ok()) newest_first.assign(listed->rbegin(), listed->rend());
  std::vector<uint64_t> mine;
  for (const Published& p : newest_first) mine.push_back(name_value(p.name));
  HPS_ASSIGN_OR_RETURN(const uint64_t width,
                       combine_over(groups, listed.ok() ? mine.size() : 0,
                                    [](uint64_t a, uint64_t b) { return std::max(a, b); }));
  mine.resize(static_cast<size_t>(width), kFailed);
  for (Communicator* group : groups) {
    if (group == nullptr || group->size() == 1 || width == 0) continue;
    HPS_ASSIGN_OR_RETURN(const std::vector<uint64_t> all, gather_values(*group, mine));
    for (size_t r = 0; r < static_cast<size_t>(group->size()); ++r) {
      const auto begin = all.begin() + static_cast<ptrdiff_t>(r * width);
      const std::vector<uint64_t> theirs(begin, begin + static_cast<ptrdiff_t>(width));
      for (uint64_t& v : mine) {
        if (std::find(theirs.begin(), theirs.end(), v) == theirs.end()) v = kFailed;
      }
    }
  }
  if (!listed.ok()) return listed.status();
  for (size_t i = 0; i < newest_first.size(); ++i) {
    if (mine[i] != kFailed) {
      HPS_LOG(kWarn) << "checkpoint: the parts of the model (mp or pp) have their 'latest' "
                        "apart (this part's: '"
                     << *latest << "'); loading '" << newest_first[i].name
                     << "', the newest checkpoint every part holds";
      return newest_first[i].name;
    }
  }
  return invalid_argument(
      "checkpoint: the parts of the model (mp or pp) have their 'latest' apart "
      "(this part's: '" +
      *latest + "') and hold no checkpoint in common, so no part changed its engine");
}

void Checkpointer::finish_in_flight() {
  if (!in_flight_) return;
  // A finished save costs no wait; one still writing blocks the host (counted).
  auto done = in_flight_->done_event().query();
  if (!done.ok() || !*done) (void)in_flight_->wait();
  if (writer_.joinable()) writer_.join();
  in_flight_.reset();
}

StatusOr<LoadReport> Checkpointer::load(const std::string& name, CheckpointLoadOptions options) {
  std::lock_guard calls(calls_);
  finish_in_flight();
  LoadReport report;
  bool saved_loss_scaling = true;
  std::string resolved = name;
  auto source = [&]() -> StatusOr<ckpt::SourceIndex> {
    std::string& n = resolved;
    if (n.empty()) {
      const std::vector<Communicator*> parts = engine_.model_parallel_groups();
      HPS_ASSIGN_OR_RETURN(n,
                           parts.empty() ? latest_checkpoint(root_) : latest_of_every_part(parts));
    } else {
      HPS_RETURN_IF_ERROR(ckpt::check_checkpoint_name(n));
    }
    const std::string directory = join_path(root_, n);
    HPS_ASSIGN_OR_RETURN(ckpt::Manifest m, ckpt::read_manifest(directory));
    // Resharding spans the sharding and dp axes; a part of a model cut across mp and pp
    // loads only into the same part.
    const CheckpointTopology mine = engine_.checkpoint_topology();
    const CheckpointTopology& saved = m.topology;
    if (saved.mp != mine.mp || saved.mp_rank != mine.mp_rank || saved.pp != mine.pp ||
        saved.pp_rank != mine.pp_rank) {
      return invalid_argument("checkpoint: '" + directory + "' holds " + part_text(saved) +
                              "; this engine is " + part_text(mine) +
                              " (a part loads only into the same part)");
    }
    report.directory = directory;
    saved_loss_scaling = !m.engine || m.engine->dynamic_loss_scaling;
    report.id = m.id;
    report.metadata = m.metadata;
    return ckpt::source_of(m, directory);
  }();
  return run_load(std::move(source), ckpt::SourceNaming::kCheckpoint, options, std::move(report),
                  saved_loss_scaling, resolved.empty() ? std::string("?") : resolved);
}

StatusOr<LoadReport> Checkpointer::import_safetensors(const std::string& path,
                                                      CheckpointLoadOptions options) {
  std::lock_guard calls(calls_);
  finish_in_flight();
  LoadReport report;
  report.directory = path;
  auto source = ckpt::read_safetensors(path, &report.metadata);
  if (source.ok()) {
    Status part = check_safetensors_part(path, report.metadata, engine_.checkpoint_topology());
    if (!part.ok()) source = part;
  }
  return run_load(std::move(source), ckpt::SourceNaming::kBareParameters, options,
                  std::move(report));
}

StatusOr<LoadReport> Checkpointer::run_load(StatusOr<ckpt::SourceIndex> source,
                                            ckpt::SourceNaming naming,
                                            const CheckpointLoadOptions& options, LoadReport report,
                                            bool saved_loss_scaling, const std::string& name) {
  // Everything that can fail happens before any rank changes its engine.
  Status local = source.status();
  std::vector<StateTensor> tensors;
  std::vector<ckpt::TargetRange> targets;
  std::vector<size_t> tensor_of;  // targets[t] is tensors[tensor_of[t]]
  ckpt::LoadPlan plan;
  // Every target's elements, 64-byte aligned in one staging buffer, kept for the next save
  // or load.
  ckpt::HostStaging memory;
  std::vector<uint8_t*> staging;
  std::vector<uint64_t> staged_bytes;
  if (local.ok()) {
    auto t = engine_.state_tensors();
    local = t.status();
    if (local.ok()) tensors = std::move(*t);
  }
  if (local.ok()) local = engine_.begin_state_load();
  if (local.ok()) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      const std::string& n = tensors[i].name;
      // A model file fills parameters (and their masters) only.
      if (naming == ckpt::SourceNaming::kBareParameters && !starts_with(n, kParamPrefix) &&
          !starts_with(n, kMasterPrefix)) {
        continue;
      }
      targets.push_back(ckpt::target_ranges({tensors[i]})[0]);
      tensor_of.push_back(i);
    }
    auto p = ckpt::plan_load(*source, targets, naming, options.allow_partial);
    local = p.status();
    if (local.ok()) plan = std::move(*p);
  }
  Stream& state = engine_.state_stream();
  // A host-memory engine is read into in place: each target's current values are first
  // copied aside into the staging memory (on the state stream, while the reads wait for the
  // disk), each target's reads wait for its copy, and a failure on any rank copies them all
  // back. Other devices read into the staging memory, and the engine takes it only once
  // every rank read and verified all of it.
  const bool in_place = state.device().type == DeviceType::kCpu;
  std::vector<uint8_t*> into;                 // where the reads write target t
  std::vector<std::unique_ptr<Event>> aside;  // in place: target t's values are copied aside
  if (local.ok()) {
    std::vector<uint64_t> offset(targets.size(), 0);
    staged_bytes.assign(targets.size(), 0);
    uint64_t total = 0;
    for (size_t t = 0; t < targets.size(); ++t) {
      if (plan.source_of_target[t] < 0) continue;
      staged_bytes[t] = (targets[t].end - targets[t].begin) * dtype_size(targets[t].dtype);
      offset[t] = total;
      total = ckpt::round_up(total + staged_bytes[t], ckpt::kDataAlignment);
    }
    auto m = take_staging(state.device(), total);
    local = m.status();
    if (local.ok()) memory = std::move(*m);
    if (local.ok()) {
      staging.assign(targets.size(), nullptr);
      for (size_t t = 0; t < targets.size(); ++t) staging[t] = memory.data() + offset[t];
      into = staging;
      if (in_place) {
        // In the order the reads first write the targets, so the first read waits for one
        // copy only.
        std::vector<size_t> order;
        std::vector<uint8_t> listed(targets.size(), 0);
        for (const ckpt::ReadPiece& p : plan.pieces) {
          if (!listed[p.target]) order.push_back(p.target);
          listed[p.target] = 1;
        }
        aside.resize(targets.size());
        for (size_t t : order) {
          if (staged_bytes[t] == 0) continue;
          into[t] = static_cast<uint8_t*>(tensors[tensor_of[t]].data);
          auto event = create_event(state.device());
          local = event.status();
          if (local.ok()) local = state.memcpy_async(staging[t], into[t], staged_bytes[t]);
          if (local.ok()) local = (*event)->record(state);
          if (local.ok()) aside[t] = std::move(*event);
          if (!local.ok()) break;
        }
      }
    }
    if (local.ok()) {
      local = ckpt::read_plan(
          *source, targets, plan, into,
          [&](size_t t) -> Status {
            return aside.empty() || !aside[t] ? Status::Ok() : aside[t]->synchronize_uncounted();
          },
          [&]() -> Status {
            // The agreement below would refuse the load anyway: not after reading it all.
            return comm_->was_aborted()
                       ? aborted("checkpoint: the group was aborted while the load read '" +
                                 report.directory + "'")
                       : Status::Ok();
          });
    }
  }
  // The ranks of the group must read one checkpoint: its name and id (`latest` may move
  // between two ranks' reads of it). An import's file, which may lie at other paths on other
  // hosts, by its header's checksum and its size, and on one host by the file itself (it may
  // be replaced, an export over it, between two ranks' opens).
  std::string source_identity, on_host;
  if (naming == ckpt::SourceNaming::kCheckpoint) {
    source_identity = "'" + name + "' (id " + report.id + ")";
  } else if (source.ok()) {
    source_identity = source->identity;
    on_host = source->identity_on_host;
  }
  if (Status s = agree_across_parts(agree(local, "load", source_identity, on_host), name);
      !s.ok()) {
    // In place: every value a read may have changed goes back (after every copy aside).
    Status restored;
    if (!aside.empty()) {
      restored = state.synchronize();
      for (size_t t = 0; t < aside.size() && restored.ok(); ++t) {
        if (aside[t]) restored = state.memcpy_async(into[t], staging[t], staged_bytes[t]);
      }
      if (restored.ok()) restored = state.synchronize();
    }
    if (restored.ok()) keep_staging(std::move(memory));
    if (!restored.ok()) {
      return Status(s.code(), s.message() + "; restoring the engine's state failed too: " +
                                  restored.to_string());
    }
    return s;
  }
  Status copied;
  for (size_t t = 0; t < targets.size() && copied.ok(); ++t) {
    if (plan.source_of_target[t] < 0) continue;
    ++report.tensors_loaded;
    if (staged_bytes[t] == 0 || in_place) continue;
    copied = state.memcpy_async(tensors[tensor_of[t]].data, staging[t], staged_bytes[t]);
  }
  // The copies read the staging memory: it is kept only after they are done.
  Status done = state.synchronize();
  if (done.ok()) keep_staging(std::move(memory));
  HPS_RETURN_IF_ERROR(copied);
  HPS_RETURN_IF_ERROR(done);
  HPS_RETURN_IF_ERROR(engine_.end_state_load());
  if (!saved_loss_scaling) HPS_RETURN_IF_ERROR(engine_.restart_loss_scaling());
  report.unchanged = std::move(plan.unchanged);
  report.unused = std::move(plan.unused);
  return report;
}

StatusOr<std::string> latest_checkpoint(const std::string& root) {
  const std::string path = join_path(root, std::string(ckpt::kLatestFile));
  auto text = ckpt::read_file(path, 4096);
  if (!text.ok()) {
    if (text.status().code() == StatusCode::kNotFound) {
      return not_found("checkpoint: no checkpoint under '" + root + "' (" + path +
                       " does not exist)");
    }
    return text.status();
  }
  std::string name = *text;
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r')) name.pop_back();
  Status s = ckpt::check_checkpoint_name(name);
  if (!s.ok()) return invalid_argument("checkpoint: " + path + ": " + s.message());
  return name;
}

StatusOr<std::string> resolve_checkpoint(const std::string& path) {
  // A folder that cannot be searched says so: it may hold either.
  HPS_ASSIGN_OR_RETURN(const bool manifest,
                       ckpt::entry_exists(join_path(path, std::string(ckpt::kManifestFile))));
  if (manifest) return path;
  HPS_ASSIGN_OR_RETURN(const bool latest,
                       ckpt::entry_exists(join_path(path, std::string(ckpt::kLatestFile))));
  if (latest) {
    HPS_ASSIGN_OR_RETURN(std::string name, latest_checkpoint(path));
    return join_path(path, name);
  }
  return not_found("checkpoint: '" + path + "' holds neither " + std::string(ckpt::kManifestFile) +
                   " (a checkpoint) nor " + std::string(ckpt::kLatestFile) +
                   " (a root of checkpoints)");
}

StatusOr<ckpt::VerifyReport> verify_checkpoint(const std::string& directory) {
  HPS_ASSIGN_OR_RETURN(ckpt::Manifest m, ckpt::read_manifest(directory));
  HPS_ASSIGN_OR_RETURN(ckpt::VerifyReport report,
                       ckpt::verify_source(ckpt::source_of(m, directory)));
  report.manifest_checksummed = m.checksummed;
  return report;
}

namespace {

// Whether `folder` is a root of checkpoints: the root of `checkpoint` (the directory being
// read), or one with a pointer to its latest, a part's claim or a checkpoint under it.
bool is_checkpoint_root(const std::filesystem::path& folder, const std::string& checkpoint) {
  std::error_code ec;
  auto own = std::filesystem::absolute(checkpoint, ec).lexically_normal();
  if (!own.has_filename()) own = own.parent_path();  // "root/name/"
  const auto own_root = own.parent_path();
  if (!ec && std::filesystem::equivalent(folder, own_root, ec) && !ec) return true;
  const std::string root = folder.string();
  if (latest_checkpoint(root).ok() || ckpt::path_exists(join_path(root, kPartFile))) return true;
  auto names = ckpt::list_directory(root);
  if (!names.ok()) return false;
  return std::any_of(names->begin(), names->end(), [&](const std::string& n) {
    return !n.empty() && n[0] != '.' &&
           ckpt::path_exists(join_path(join_path(root, n), std::string(ckpt::kManifestFile)));
  });
}

}  // namespace

Status export_safetensors(const std::string& directory, const std::string& path, bool fp32) {
  HPS_ASSIGN_OR_RETURN(ckpt::Manifest m, ckpt::read_manifest(directory));
  const ckpt::SourceIndex source = ckpt::source_of(m, directory);
  std::vector<ckpt::SafetensorsEntry> entries;
  std::vector<size_t> from;  // the stored tensor each entry is read from
  for (size_t i = 0; i < source.tensors.size(); ++i) {
    const ckpt::StoredTensor& t = source.tensors[i];
    if (!starts_with(t.name, kParamPrefix)) continue;
    const std::string param = t.name.substr(kParamPrefix.size());
    size_t read = i;
    if (fp32) {
      for (size_t k = 0; k < source.tensors.size(); ++k) {
        if (source.tensors[k].name == std::string(kMasterPrefix) + param) read = k;
      }
      if (source.tensors[read].shape != t.shape) {
        return invalid_argument("checkpoint " + directory + ": '" + source.tensors[read].name +
                                "' has shape " + ckpt::shape_text(source.tensors[read].shape) +
                                " but '" + t.name + "' " + ckpt::shape_text(t.shape));
      }
    }
    entries.push_back({param, fp32 ? DType::kFloat32 : t.dtype, t.shape});
    from.push_back(read);
  }
  std::map<std::string, std::string> metadata = m.metadata;
  {  // Keys the export writes itself: a user's value of one is not exported, and is named.
    std::string yielded;
    for (const char* key :
         {"format", "hpshard_checkpoint", kPartKeys[0], kPartKeys[1], kPartKeys[2], kPartKeys[3]}) {
      if (m.metadata.count(key) != 0)
        yielded += (yielded.empty() ? "'" : ", '") + std::string(key) + "'";
    }
    if (!yielded.empty()) {
      HPS_LOG(kWarn) << "export of checkpoint " << directory << ": its metadata " << yielded
                     << " not exported: the export writes these keys itself ('format' is "
                        "'pt', 'hpshard_checkpoint' the checkpoint's id, the hpshard_mp/pp keys "
                        "a part's place, absent for a whole model)";
    }
  }
  metadata["format"] = "pt";  // what transformers' loaders look for
  metadata["hpshard_checkpoint"] = m.id;
  // A part's export says which part it is; importing it into another part is refused.
  for (auto [key, value] :
       {std::pair{kPartKeys[0], m.topology.mp}, std::pair{kPartKeys[1], m.topology.mp_rank},
        std::pair{kPartKeys[2], m.topology.pp}, std::pair{kPartKeys[3], m.topology.pp_rank}}) {
    if (m.topology.mp > 1 || m.topology.pp > 1) {
      metadata[key] = std::to_string(value);
    } else {
      metadata.erase(key);
    }
  }
  uint64_t data_bytes = 0;
  auto made = ckpt::safetensors_header(entries, metadata, &data_bytes);
  if (!made.ok()) {
    return Status(made.status().code(),
                  "export of checkpoint " + directory + ": " + made.status().message());
  }
  std::string header = std::move(*made);
  // The file `path` names (core/common/output_file.h).
  const OutputFile output = output_file(path);
  if (!output.error.empty()) {
    return invalid_argument("checkpoint: cannot export to '" + path + "': " + output.error);
  }
  const std::string& target = output.target;
  // Never into the checkpoint itself (the rename would replace one of its files).
  std::error_code ec;
  const auto parent_of_out =
      std::filesystem::absolute(std::filesystem::path(target), ec).parent_path();
  if (!ec && std::filesystem::equivalent(parent_of_out, directory, ec) && !ec) {
    return invalid_argument("checkpoint: '" + path + "' lies in the checkpoint " + directory +
                            " it is exported from");
  }
  // Nor into another checkpoint (a folder holding a manifest): the rename would replace one of
  // its files, a data file or the manifest, and that checkpoint would no longer load.
  if (!ec && ckpt::path_exists((parent_of_out / std::string(ckpt::kManifestFile)).string())) {
    return invalid_argument("checkpoint: '" + path + "' lies in the checkpoint " +
                            parent_of_out.string() + " (an export never writes into one)");
  }
  // Nor over a root's pointer to its latest checkpoint: in the checkpoint's own root, or in
  // a folder that is a root (a pointer, a part's claim, or a checkpoint under it), with its
  // pointer there or not.
  if (std::filesystem::path(target).filename() == ckpt::kLatestFile &&
      is_checkpoint_root(parent_of_out, directory)) {
    return invalid_argument("checkpoint: '" + path +
                            "' is the pointer to the latest checkpoint of a root of checkpoints");
  }
  // A temporary name of this export's own (O_EXCL), renamed over `path` once complete:
  // concurrent exports to one path each publish a whole file, and nothing else is touched.
  HPS_ASSIGN_OR_RETURN(File out, File::create_beside(target));
  const std::string temporary = out.path();
  Status s = out.write_all(header.data(), header.size());
  // Tensor by tensor, in windows: memory stays bounded whatever the model's size.
  constexpr uint64_t kWindowBytes = uint64_t{64} << 20;
  std::vector<uint8_t> window;
  for (size_t e = 0; e < entries.size() && s.ok(); ++e) {
    const ckpt::StoredTensor& t = source.tensors[from[e]];
    const uint64_t element = dtype_size(entries[e].dtype);
    const uint64_t step = std::max<uint64_t>(1, kWindowBytes / element);
    for (uint64_t b = 0; b < t.numel && s.ok(); b += step) {
      const uint64_t end = std::min(t.numel, b + step);
      window.resize((end - b) * element);
      s = ckpt::read_tensor_range(source, from[e], b, end, entries[e].dtype, window.data());
      if (s.ok()) s = out.write_all(window.data(), window.size());
    }
  }
  if (s.ok()) s = out.sync();
  if (s.ok()) s = out.close();
  if (s.ok()) s = ckpt::rename_path(temporary, target);
  if (!s.ok()) {
    (void)::unlink(temporary.c_str());
    return s;
  }
  const std::string parent = std::filesystem::path(target).parent_path().string();
  return ckpt::sync_directory(parent.empty() ? "." : parent);
}

}  // namespace hps
