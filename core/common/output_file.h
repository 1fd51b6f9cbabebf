// Where a program writes an output file the user named, replacing it atomically (written
// beside it under a temporary name, then renamed over it). The rename replaces whatever the
// name holds, so the name is checked first: a symbolic link is followed (the file it points
// to is replaced, the link stays); a name that holds anything but a regular file (a
// directory, a device node such as /dev/full, a FIFO, a socket) is refused, since the rename
// would replace it rather than write into it. The temporary is a name of the writer's own
// (create_beside): two writers of one output never share it, and a file a killed writer
// left is never reopened. A file that must not replace another (a claim, a trace file that
// may share its name with another process's) is placed with place_new instead. Header-only:
// the tools that link no hpshard library use it too.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <string_view>
#include <system_error>

#include "core/common/shown_path.h"

namespace hps {

struct OutputFile {
  std::string target;  // the path to write beside and rename over
  std::string error;   // not empty: why `path` is refused (the path not included)
};

inline OutputFile output_file(const std::string& path) {
  OutputFile out{path, {}};
  if (path.empty()) {
    out.error = "the path is empty";
    return out;
  }
  if (path.back() == '/') {
    out.error = "it ends in '/', which names a folder, not a file";
    return out;
  }
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return out;  // nothing there yet
  if (S_ISLNK(st.st_mode)) {
    std::error_code ec;
    const auto resolved = std::filesystem::canonical(path, ec);
    if (ec) {
      out.error = "a symbolic link to nothing that exists (" + ec.message() + ")";
      return out;
    }
    out.target = resolved.string();
    if (::stat(out.target.c_str(), &st) != 0) {
      out.error = out.target + ": " + std::strerror(errno);
      return out;
    }
  }
  if (!S_ISREG(st.st_mode)) {
    out.error =
        "it is not a regular file (a directory, a device, a FIFO or a socket); the output is "
        "written beside it and renamed there, which would replace it";
  }
  return out;
}

// Creates a new file beside `target` to be renamed over it once complete: `target` +
// ".tmp-" + 12 random hexadecimal digits, created exclusively (O_EXCL), another name tried
// when one exists. Its mode is the existing target's permission bits (the rename must not
// make a private file readable to others, nor a shared one private), or, with no file at
// `target`, 0666 less the umask, as any new file's. Returns the open descriptor
// (close-on-exec) and sets `*temporary`; -1 with errno set when no file could be created.
inline int create_beside(const std::string& target, std::string* temporary) {
  struct stat existing {};
  const bool keep_mode = ::stat(target.c_str(), &existing) == 0 && S_ISREG(existing.st_mode);
  std::random_device device;
  for (int attempt = 0; attempt < 16; ++attempt) {
    char suffix[32];
    std::snprintf(suffix, sizeof suffix, ".tmp-%06x%06x", device() & 0xffffffu,
                  device() & 0xffffffu);
    *temporary = target + suffix;
    // Private until its mode is set: no moment where others may open it.
    const int fd = ::open(temporary->c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC,
                          keep_mode ? 0600 : 0666);
    if (fd < 0 && errno == EEXIST) continue;
    if (fd >= 0 && keep_mode && ::fchmod(fd, existing.st_mode & 0777) != 0) {
      const int err = errno;
      ::close(fd);
      ::unlink(temporary->c_str());
      errno = err;
      return -1;
    }
    return fd;
  }
  errno = EEXIST;
  return -1;
}

// Writes what `produce` puts into a new file beside `target` (create_beside) and sets
// `*temporary` to its name: `produce(put)` calls `put(piece)` for each piece of the content
// in order (written in pieces of about 1 MiB, so content made piece by piece never needs to
// be held whole). Returns the error, naming the file; empty on success. Nothing is left on
// a failure.
template <typename Produce>
std::string write_beside_target_from(const std::string& target, Produce&& produce,
                                     std::string* temporary) {
  const int fd = create_beside(target, temporary);
  if (fd < 0) return "cannot write beside '" + shown_path(target) + "': " + std::strerror(errno);
  int err = 0;
  auto write_all = [&](std::string_view text) {
    while (err == 0 && !text.empty()) {
      const ssize_t n = ::write(fd, text.data(), text.size());
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        err = n < 0 ? errno : EIO;
        return;
      }
      text.remove_prefix(static_cast<size_t>(n));
    }
  };
  constexpr size_t kPiece = size_t{1} << 20;
  std::string pending;
  auto put = [&](std::string_view piece) {
    if (err != 0) return;
    if (piece.size() >= kPiece) {
      write_all(pending);
      pending.clear();
      write_all(piece);
      return;
    }
    pending.append(piece);
    if (pending.size() >= kPiece) {
      write_all(pending);
      pending.clear();
    }
  };
  produce(put);
  write_all(pending);
  if (::close(fd) != 0 && err == 0) err = errno;
  if (err != 0) {
    ::unlink(temporary->c_str());
    return "cannot write '" + shown_path(*temporary) + "': " + std::strerror(err);
  }
  return {};
}

// Writes `text` into a new file beside `target`, as write_beside_target_from.
inline std::string write_beside_target(const std::string& target, const std::string& text,
                                       std::string* temporary) {
  return write_beside_target_from(
      target, [&](const auto& put) { put(text); }, temporary);
}

// Writes `text` to `path` as above (checked, written beside, renamed over it). Returns
// the error, naming the path; empty on success.
inline std::string write_output(const std::string& path, const std::string& text) {
  const OutputFile checked = output_file(path);
  if (!checked.error.empty()) return "cannot write '" + shown_path(path) + "': " + checked.error;
  std::string temporary;
  if (std::string error = write_beside_target(checked.target, text, &temporary); !error.empty()) {
    return error;
  }
  if (std::rename(temporary.c_str(), checked.target.c_str()) != 0) {
    const int err = errno;
    ::unlink(temporary.c_str());
    return "cannot write '" + shown_path(path) + "': " + std::strerror(err);
  }
  return {};
}

// Whether `err`, from place_new, says the file system can neither hard-link nor rename
// without replacing.
inline bool placing_unsupported(int err) {
  return err == EPERM || err == ENOTSUP || err == EOPNOTSUPP || err == ENOSYS || err == EINVAL;
}

// Moves the complete file `temporary` to `target` unless something is there already:
// hard-linked, then unlinked (one winner on every host of a shared file system), or, where
// the file system has no hard links, renamed without replacing (renameat2). Returns 0 once
// placed (`temporary` is gone), else the errno and `temporary` stays: EEXIST when `target` is
// taken, one placing_unsupported() names where the file system can do neither.
inline int place_new(const std::string& temporary, const std::string& target) {
  if (::link(temporary.c_str(), target.c_str()) == 0) {
    (void)::unlink(temporary.c_str());
    return 0;
  }
  const int err = errno;
  if (!placing_unsupported(err)) return err;
  if (::renameat2(AT_FDCWD, temporary.c_str(), AT_FDCWD, target.c_str(), RENAME_NOREPLACE) == 0) {
    return 0;
  }
  return errno;
}

}  // namespace hps
