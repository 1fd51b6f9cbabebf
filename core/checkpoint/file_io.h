// POSIX file operations for checkpoints, each returning a Status that names the path and
// the OS's reason: writes that fail on a full disk, reads that find a file shorter than
// promised, fsync of files and directories, atomic replacement. No exception escapes.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/common/status.h"

namespace hps::ckpt {

// An open file, closed on destruction.
class File {
 public:
  File() = default;
  ~File();
  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  // A new file for writing; ALREADY_EXISTS when `path` exists.
  static StatusOr<File> create(const std::string& path);
  // A new file beside `target`, under a temporary name of its own (its path()), to be
  // renamed over `target` once complete (core/common/output_file.h's create_beside).
  static StatusOr<File> create_beside(const std::string& target);
  // The alignment write_whole() needs of its buffer and of the buffer's capacity.
  static constexpr size_t kDirectAlignment = 4096;
  // How write_whole() learns that more of its buffer is ready: called with how many of
  // the first bytes are ready so far (fewer than the whole), it blocks until more are
  // and returns how many are now (at most the whole); an error stops the writing.
  using ReadyBytes = std::function<StatusOr<size_t>(size_t ready_so_far)>;
  // Writes `bytes` from `data` as the whole content of this new, empty file, bypassing
  // the page cache (O_DIRECT) where the filesystem allows it: the disk reads the buffer
  // itself, and the CPU copies nothing. `data` must be kDirectAlignment-aligned and
  // writable up to `bytes` rounded up to kDirectAlignment: the rounding's bytes are
  // zeroed, written, and cut off again. Falls back to buffered writes where O_DIRECT is
  // refused. With `ready`, the buffer fills while it is written: only bytes `ready` has
  // reported are written (O_DIRECT in whole kDirectAlignment blocks of them), so the
  // writing starts before the buffer is complete; without it every byte is ready.
  // Errors as write_all, and `ready`'s own.
  Status write_whole(uint8_t* data, size_t bytes, const ReadyBytes& ready = nullptr);
  // An existing regular file for reading; NOT_FOUND when it does not exist,
  // INVALID_ARGUMENT when it is something else (a FIFO is refused, never waited on).
  static StatusOr<File> open_read(const std::string& path);

  const std::string& path() const { return path_; }
  // Appends all `bytes`; BACKEND_ERROR naming the file and how much was written on a
  // failure (ENOSPC: the disk is full).
  Status write_all(const void* data, size_t bytes);
  // Reads exactly `bytes` at `offset`; INVALID_ARGUMENT when the file ends before.
  Status pread_all(void* data, size_t bytes, uint64_t offset) const;
  StatusOr<uint64_t> size() const;
  // The file itself as this host sees it: "device:inode:modified (ns):size". Two opens of one
  // path that give different identities opened different files (one was replaced between).
  StatusOr<std::string> identity() const;
  Status sync();
  Status close();
  // Tells the kernel the file's cached pages may go (benchmarks compare cold reads).
  void drop_cache() const;
  // Asks the kernel to start reading at `offset` now (posix_fadvise WILLNEED over `bytes`:
  // Linux reads at most one readahead window of them), so the reads that follow overlap
  // the disk with the caller's work; a hint.
  void will_need(uint64_t offset, uint64_t bytes) const;

 private:
  File(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  // One write(2) of at most 64 MiB of `left`, retried on EINTR.
  ssize_t write_piece(const uint8_t* data, size_t left) const;
  // The error of a write that returned `n` (0: no progress; < 0: errno `err`).
  Status write_error(size_t done, size_t bytes, ssize_t n, int err) const;
  int fd_ = -1;
  std::string path_;
};

// Creates `path` (its parent must exist); ALREADY_EXISTS when it exists.
Status make_directory(const std::string& path);
// fsync of a directory: makes the names created, renamed or removed in it durable.
Status sync_directory(const std::string& path);
// rename(2): atomic within one filesystem; replaces a file at `to`.
Status rename_path(const std::string& from, const std::string& to);
// Removes a file or a directory tree; a missing path is not an error.
Status remove_tree(const std::string& path);
bool path_exists(const std::string& path);
// Whether `path` exists, or why that cannot be told (a folder on the way that cannot be
// searched, one that is not a folder): BACKEND_ERROR naming the path and the reason.
StatusOr<bool> entry_exists(const std::string& path);
// Writes `contents` into a new file beside `target` (File::create_beside), fsyncs and
// closes it; returns its name (removed again on an error). Renamed over `target`, it
// replaces the file atomically: concurrent replacements each publish whole contents.
StatusOr<std::string> write_beside(const std::string& target, const std::string& contents);
// The whole file, refusing one larger than `max_bytes` (INVALID_ARGUMENT).
StatusOr<std::string> read_file(const std::string& path, uint64_t max_bytes);
// The names in directory `path` (not "." or "..").
StatusOr<std::vector<std::string>> list_directory(const std::string& path);
// "a/b" joined; `name` must not be absolute.
std::string join_path(const std::string& dir, const std::string& name);

}  // namespace hps::ckpt
