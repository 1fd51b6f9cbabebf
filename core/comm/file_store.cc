// FileStore: ranks meet through a directory on a filesystem they all see (NFS, Lustre, a
// local /tmp for one host). One file per key; a value is written to a temp file and renamed
// over the key's file, so a reader sees the old value or the new one, never a partial one.
// Files are 0600 and a directory that other users may write to is refused: whoever can
// write the keys can steer the job.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <system_error>
#include <thread>

#define XXH_INLINE_ALL  // header-only: libhpshard gains no shared-library dependency
#include <xxhash.h>

#include "core/comm/store.h"
#include "core/common/env.h"

namespace hps {
namespace {

using Clock = std::chrono::steady_clock;

// Polling starts fast (a rank usually sets its key moments after another asks) and backs
// off so a long wait does not spin.
constexpr Milliseconds kFirstBackoff{1};
constexpr Milliseconds kMaxBackoff{20};
// Well under NAME_MAX (255) on every common filesystem.
constexpr size_t kMaxFileName = 240;

std::string errno_message(int error) {
  return std::error_code(error, std::generic_category()).message();
}

// Closes a file descriptor when it goes out of scope.
class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) : fd_(fd) {}
  ~FileDescriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

// Keys may hold '/', '.', bytes of any value: every byte outside [A-Za-z0-9_-] becomes %XX.
// The "k_" prefix keeps key files apart from the store's own ".lock" and ".tmp.*" files. A
// key whose encoding would not fit a file name is named "h_" and the 128-bit XXH3 of the
// key instead (every process derives the same name; the prefixes keep the two kinds apart).
std::string encode_key(std::string_view key) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string name = "k_";
  for (char ch : key) {
    const auto byte = static_cast<unsigned char>(ch);
    if ((byte >= 'a' && byte <= 'z') || (byte >= 'A' && byte <= 'Z') ||
        (byte >= '0' && byte <= '9') || byte == '_' || byte == '-') {
      name += ch;
    } else {
      name += '%';
      name += kHex[byte >> 4];
      name += kHex[byte & 0xF];
    }
  }
  return name;
}

Status write_all(int fd, std::string_view data) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return backend_error("write failed: " + errno_message(errno));
    }
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

// The file's contents, or nothing when it does not exist. The store writes its files
// itself (renamed into place): anything else at the path (a link, a FIFO, a device, more
// than a value's bytes) is refused, naming it, rather than followed, waited on or read
// without end.
StatusOr<std::optional<std::string>> read_file(const std::filesystem::path& path) {
  const int raw = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW);
  if (raw < 0) {
    if (errno == ENOENT) return std::optional<std::string>();
    if (errno == ELOOP) {
      return backend_error("file store: '" + shown_path(path.string()) +
                           "' is a symbolic link; the store's files are regular files");
    }
    return backend_error("file store: cannot open '" + shown_path(path.string()) +
                         "': " + errno_message(errno));
  }
  FileDescriptor fd(raw);
  struct stat info {};
  if (::fstat(fd.get(), &info) != 0) {
    return backend_error("file store: cannot stat '" + shown_path(path.string()) +
                         "': " + errno_message(errno));
  }
  if (!S_ISREG(info.st_mode)) {
    return backend_error("file store: '" + shown_path(path.string()) +
                         "' is not a regular file; the store's files are");
  }
  auto too_large = [&] {
    return backend_error("file store: '" + shown_path(path.string()) + "' holds more than " +
                         std::to_string(kMaxStoreValueBytes) + " bytes, a store value's limit");
  };
  if (static_cast<uint64_t>(info.st_size) > kMaxStoreValueBytes) return too_large();
  std::string contents;
  char buffer[64 * 1024];
  while (true) {
    const ssize_t n = ::read(fd.get(), buffer, sizeof buffer);
    if (n < 0) {
      if (errno == EINTR) continue;
      return backend_error("file store: cannot read '" + shown_path(path.string()) +
                           "': " + errno_message(errno));
    }
    if (n == 0) break;
    contents.append(buffer, static_cast<size_t>(n));
    if (contents.size() > kMaxStoreValueBytes) return too_large();  // it grew meanwhile
  }
  return std::optional<std::string>(std::move(contents));
}

std::string octal(unsigned mode) {
  char text[8];
  std::snprintf(text, sizeof text, "%04o", mode);
  return text;
}

bool file_exists(const std::filesystem::path& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0;
}

class FileStore final : public Store {
 public:
  FileStore(std::filesystem::path directory, Milliseconds timeout)
      : directory_(std::move(directory)), timeout_(clamp_store_wait(timeout)) {}

  Status set(std::string_view key, std::string_view value) override {
    HPS_RETURN_IF_ERROR(check_store_value(key, value.size()));
    HPS_ASSIGN_OR_RETURN(auto path, key_path(key));
    return write_atomically(path, value);
  }

  StatusOr<std::string> get(std::string_view key, Milliseconds timeout) override {
    HPS_ASSIGN_OR_RETURN(auto path, key_path(key));
    timeout = clamp_store_wait(timeout);
    const auto deadline = Clock::now() + timeout;
    Milliseconds backoff = kFirstBackoff;
    while (true) {
      HPS_ASSIGN_OR_RETURN(auto contents, read_file(path));
      if (contents) return std::move(*contents);
      if (!sleep_until_next_poll(deadline, &backoff)) {
        return store_timeout("store get", {std::string(key)}, timeout);
      }
    }
  }

  StatusOr<int64_t> add(std::string_view key, int64_t delta) override {
    HPS_ASSIGN_OR_RETURN(auto path, key_path(key));
    // flock on a file of the directory: every add, from any thread or process, holds it for
    // its read-modify-write. Each call opens its own descriptor, so threads exclude each
    // other as processes do.
    const auto lock_path = directory_ / ".lock";
    const int raw = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (raw < 0) {
      return backend_error("file store add: cannot open '" + shown_path(lock_path.string()) +
                           "': " + errno_message(errno));
    }
    FileDescriptor lock(raw);
    // Polled, not blocking: a holder that stalls (a stopped process) must not hold every
    // other add past the store's timeout.
    const auto deadline = Clock::now() + timeout_;
    Milliseconds backoff = kFirstBackoff;
    while (::flock(lock.get(), LOCK_EX | LOCK_NB) != 0) {
      if (errno == EINTR) continue;
      if (errno != EWOULDBLOCK) {
        return backend_error("file store add: cannot lock '" + shown_path(lock_path.string()) +
                             "': " + errno_message(errno));
      }
      if (!sleep_until_next_poll(deadline, &backoff)) {
        return timeout_error("file store add of '" + std::string(key) + "': its lock '" +
                             shown_path(lock_path.string()) + "' was held for " +
                             std::to_string(timeout_.count()) +
                             " ms (a process that stalled holding it?)");
      }
    }
    // Closing the descriptor (when `lock` goes out of scope) releases the flock.
    HPS_ASSIGN_OR_RETURN(auto contents, read_file(path));
    HPS_ASSIGN_OR_RETURN(int64_t result,
                         store_add_result(key, contents ? &*contents : nullptr, delta));
    HPS_RETURN_IF_ERROR(write_atomically(path, std::to_string(result)));
    return result;
  }

  Status wait(const std::vector<std::string>& keys, Milliseconds timeout) override {
    std::vector<std::filesystem::path> paths;
    for (const auto& key : keys) {
      HPS_ASSIGN_OR_RETURN(auto path, key_path(key));
      paths.push_back(std::move(path));
    }
    timeout = clamp_store_wait(timeout);
    const auto deadline = Clock::now() + timeout;
    Milliseconds backoff = kFirstBackoff;
    while (true) {
      if (std::all_of(paths.begin(), paths.end(), file_exists)) return Status::Ok();
      if (!sleep_until_next_poll(deadline, &backoff)) {
        return store_timeout("store wait", keys, timeout);
      }
    }
  }

  StatusOr<bool> check(const std::vector<std::string>& keys) override {
    std::vector<std::filesystem::path> paths;
    for (const auto& key : keys) {
      HPS_ASSIGN_OR_RETURN(auto path, key_path(key));  // every key is checked, set or not
      paths.push_back(std::move(path));
    }
    return std::all_of(paths.begin(), paths.end(), file_exists);
  }

 private:
  StatusOr<std::filesystem::path> key_path(std::string_view key) const {
    HPS_RETURN_IF_ERROR(check_store_key(key));
    std::string name = encode_key(key);
    if (name.size() > kMaxFileName) {
      const XXH128_hash_t h = XXH3_128bits(key.data(), key.size());
      char hex[40];
      std::snprintf(hex, sizeof hex, "%016llx%016llx", static_cast<unsigned long long>(h.high64),
                    static_cast<unsigned long long>(h.low64));
      name = std::string("h_") + hex;
    }
    return directory_ / name;
  }

  // Sleeps for the next backoff step, cut short at the deadline; false once it has passed.
  static bool sleep_until_next_poll(Clock::time_point deadline, Milliseconds* backoff) {
    const auto now = Clock::now();
    if (now >= deadline) return false;
    std::this_thread::sleep_until(std::min(deadline, now + *backoff));
    *backoff = std::min(*backoff * 2, kMaxBackoff);
    return true;
  }

  // Temp file in the same directory (rename is atomic only within a filesystem), named
  // after host, process and a counter so concurrent writers never share one.
  Status write_atomically(const std::filesystem::path& path, std::string_view value) const {
    static std::atomic<uint64_t> counter{0};
    char host[64] = {};
    ::gethostname(host, sizeof host - 1);
    const auto temp = directory_ / (".tmp." + std::string(host) + "." + std::to_string(::getpid()) +
                                    "." + std::to_string(counter.fetch_add(1)));
    const int raw = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (raw < 0) {
      return backend_error("file store: cannot create '" + shown_path(temp.string()) +
                           "': " + errno_message(errno));
    }
    Status written = Status::Ok();
    {
      FileDescriptor fd(raw);
      written = write_all(fd.get(), value);
    }
    if (written.ok() && ::rename(temp.c_str(), path.c_str()) != 0) {
      written = backend_error("rename failed: " + errno_message(errno));
    }
    if (!written.ok()) {
      ::unlink(temp.c_str());
      return written.with_context("file store: writing '" + shown_path(path.string()) + "'");
    }
    return Status::Ok();
  }

  std::filesystem::path directory_;
  Milliseconds timeout_;  // the longest an add waits for the lock
};

}  // namespace

StatusOr<std::shared_ptr<Store>> make_file_store(std::string directory, Milliseconds timeout) {
  if (directory.empty()) return invalid_argument("file store: the directory is empty");
  std::error_code error;
  const bool existed = std::filesystem::exists(directory, error);
  std::filesystem::create_directories(directory, error);
  if (error) {
    return backend_error("file store: cannot create directory '" + shown_path(directory) +
                         "': " + error.message());
  }
  if (!std::filesystem::is_directory(directory, error)) {
    return invalid_argument("file store: '" + shown_path(directory) + "' is not a directory");
  }
  // A directory made here is this user's alone (parents keep the umask's mode).
  if (!existed && ::chmod(directory.c_str(), 0700) != 0) {
    return backend_error("file store: cannot make '" + shown_path(directory) +
                         "' private: " + errno_message(errno));
  }
  struct stat info {};
  if (::stat(directory.c_str(), &info) != 0) {
    return backend_error("file store: cannot stat '" + shown_path(directory) +
                         "': " + errno_message(errno));
  }
  // Anyone who can create or replace files here can forge keys: refuse such a directory.
  if ((info.st_mode & S_IWOTH) != 0) {
    return failed_precondition(
        "file store: '" + shown_path(directory) + "' is writable by every user (mode " +
        octal(info.st_mode & 07777) + ", owner uid " + std::to_string(info.st_uid) +
        "): another user could read and replace the job's keys; use a directory only you can "
        "write to");
  }
  return std::shared_ptr<Store>(std::make_shared<FileStore>(std::move(directory), timeout));
}

}  // namespace hps
