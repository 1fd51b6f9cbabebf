#include "core/checkpoint/file_io.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "core/common/output_file.h"

namespace hps::ckpt {
namespace {

std::string reason(int err) { return std::strerror(err); }

Status os_error(const std::string& what, const std::string& path, int err) {
  const std::string text = what + " '" + path + "': " + reason(err);
  if (err == ENOENT) return not_found(text);
  if (err == EEXIST) return already_exists(text);
  if (err == ENOMEM) return out_of_memory(text);
  return backend_error(text);
}

}  // namespace

File::~File() {
  if (fd_ >= 0) ::close(fd_);
}

File::File(File&& other) noexcept : fd_(other.fd_), path_(std::move(other.path_)) {
  other.fd_ = -1;
}

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    path_ = std::move(other.path_);
    other.fd_ = -1;
  }
  return *this;
}

StatusOr<File> File::create(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return os_error("cannot create", path, errno);
  return File(fd, path);
}

StatusOr<File> File::create_beside(const std::string& target) {
  std::string temporary;
  const int fd = hps::create_beside(target, &temporary);
  if (fd < 0) return os_error("cannot create a file beside", target, errno);
  return File(fd, temporary);
}

StatusOr<File> File::open_read(const std::string& path) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return os_error("cannot open", path, errno);
  File file(fd, path);
  struct stat st {};
  if (::fstat(fd, &st) != 0) return os_error("cannot stat", path, errno);
  if (!S_ISREG(st.st_mode)) {
    return invalid_argument("'" + path + "' is not a regular file (a directory, FIFO, socket or " +
                            "device)");
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    return os_error("cannot open", path, errno);
  }
  return file;
}

ssize_t File::write_piece(const uint8_t* data, size_t left) const {
  // Bounded pieces: one huge write would hold the kernel's file lock for its whole length.
  const size_t piece = std::min<size_t>(left, size_t{64} << 20);
  while (true) {
    const ssize_t n = ::write(fd_, data, piece);
    if (n >= 0 || errno != EINTR) return n;
  }
}

Status File::write_error(size_t done, size_t bytes, ssize_t n, int err) const {
  if (n == 0) {
    return backend_error("writing '" + path_ + "' made no progress after " + std::to_string(done) +
                         " of " + std::to_string(bytes) + " bytes");
  }
  return backend_error("writing '" + path_ + "' failed after " + std::to_string(done) + " of " +
                       std::to_string(bytes) + " bytes: " + reason(err));
}

Status File::write_whole(uint8_t* data, size_t bytes, const ReadyBytes& ready) {
  const size_t padded = (bytes + kDirectAlignment - 1) / kDirectAlignment * kDirectAlignment;
  const int flags = ::fcntl(fd_, F_GETFL);
  bool direct = flags >= 0 && reinterpret_cast<uintptr_t>(data) % kDirectAlignment == 0 &&
                ::fcntl(fd_, F_SETFL, flags | O_DIRECT) == 0;
  size_t available = 0;  // the bytes of `data` ready to be written
  size_t done = 0;       // the bytes in the file
  while (done < (direct ? padded : bytes)) {
    // O_DIRECT writes whole blocks: the last one once every byte is ready.
    const size_t end = !direct              ? available
                       : available == bytes ? padded
                                            : available / kDirectAlignment * kDirectAlignment;
    if (end <= done) {
      size_t now = bytes;
      if (ready) {
        auto more = ready(available);
        if (!more.ok()) return more.status();
        now = *more;
      }
      if (now <= available || now > bytes) {
        return internal_error("writing '" + path_ + "': told " + std::to_string(now) + " of " +
                              std::to_string(bytes) + " bytes are ready after " +
                              std::to_string(available));
      }
      available = now;
      if (available == bytes) std::memset(data + bytes, 0, padded - bytes);
      continue;
    }
    const ssize_t n = write_piece(data + done, end - done);
    const int err = errno;
    if (direct &&
        ((n < 0 && err == EINVAL) || (n > 0 && static_cast<size_t>(n) % kDirectAlignment != 0))) {
      // The filesystem takes O_DIRECT's flag but not these writes, or wrote a part of a
      // block: the rest through the page cache, from the first byte not surely written.
      if (n > 0) done += static_cast<size_t>(n) / kDirectAlignment * kDirectAlignment;
      if (::fcntl(fd_, F_SETFL, flags) != 0 ||
          ::lseek(fd_, static_cast<off_t>(done), SEEK_SET) != static_cast<off_t>(done)) {
        return os_error("writing", path_, errno);
      }
      direct = false;
      continue;
    }
    if (n <= 0) return write_error(std::min(done, bytes), bytes, n, err);
    done += static_cast<size_t>(n);
  }
  if (flags >= 0) (void)::fcntl(fd_, F_SETFL, flags);
  // The file ends where the data does (a write through the page cache may have ended there
  // or past it: the rounding is cut off either way).
  if (::ftruncate(fd_, static_cast<off_t>(bytes)) != 0) return os_error("truncating", path_, errno);
  return Status::Ok();
}

Status File::write_all(const void* data, size_t bytes) {
  const auto* p = static_cast<const uint8_t*>(data);
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = write_piece(p + done, bytes - done);
    if (n <= 0) return write_error(done, bytes, n, errno);
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status File::pread_all(void* data, size_t bytes, uint64_t offset) const {
  auto* p = static_cast<uint8_t*>(data);
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pread(fd_, p + done, bytes - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return os_error("reading", path_, errno);
    }
    if (n == 0) {
      return invalid_argument("file '" + path_ + "' is truncated: it ends at byte " +
                              std::to_string(offset + done) + ", before " +
                              std::to_string(offset + bytes));
    }
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

StatusOr<std::string> File::identity() const {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) return os_error("cannot stat", path_, errno);
  const int64_t modified_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1'000'000'000 +
                              static_cast<int64_t>(st.st_mtim.tv_nsec);
  return std::to_string(static_cast<uint64_t>(st.st_dev)) + ":" +
         std::to_string(static_cast<uint64_t>(st.st_ino)) + ":" + std::to_string(modified_ns) +
         ":" + std::to_string(static_cast<int64_t>(st.st_size));
}

StatusOr<uint64_t> File::size() const {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) return os_error("cannot stat", path_, errno);
  return static_cast<uint64_t>(st.st_size);
}

Status File::sync() {
  if (::fsync(fd_) != 0) return os_error("fsync of", path_, errno);
  return Status::Ok();
}

Status File::close() {
  if (fd_ < 0) return Status::Ok();
  const int fd = fd_;
  fd_ = -1;
  // A failed close can report a write error the earlier calls did not (NFS, quotas).
  if (::close(fd) != 0) return os_error("closing", path_, errno);
  return Status::Ok();
}

void File::drop_cache() const {
  if (fd_ >= 0) (void)::posix_fadvise(fd_, 0, 0, POSIX_FADV_DONTNEED);
}

void File::will_need(uint64_t offset, uint64_t bytes) const {
  if (fd_ >= 0 && bytes > 0) {
    (void)::posix_fadvise(fd_, static_cast<off_t>(offset), static_cast<off_t>(bytes),
                          POSIX_FADV_WILLNEED);
  }
}

Status make_directory(const std::string& path) {
  if (::mkdir(path.c_str(), 0755) != 0) return os_error("cannot create directory", path, errno);
  return Status::Ok();
}

Status sync_directory(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return os_error("cannot open directory", path, errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return os_error("fsync of directory", path, err);
  return Status::Ok();
}

Status rename_path(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) {
    return os_error("cannot rename '" + from + "' to", to, errno);
  }
  return Status::Ok();
}

Status remove_tree(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  if (ec) return backend_error("cannot remove '" + path + "': " + ec.message());
  return Status::Ok();
}

bool path_exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

StatusOr<bool> entry_exists(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0) return true;
  if (errno == ENOENT) return false;
  return os_error("cannot look for", path, errno);
}

StatusOr<std::string> write_beside(const std::string& target, const std::string& contents) {
  HPS_ASSIGN_OR_RETURN(File file, File::create_beside(target));
  Status s = file.write_all(contents.data(), contents.size());
  if (s.ok()) s = file.sync();
  if (s.ok()) s = file.close();
  if (!s.ok()) {
    (void)::unlink(file.path().c_str());
    return s;
  }
  return file.path();
}

StatusOr<std::string> read_file(const std::string& path, uint64_t max_bytes) {
  HPS_ASSIGN_OR_RETURN(File file, File::open_read(path));
  HPS_ASSIGN_OR_RETURN(uint64_t size, file.size());
  if (size > max_bytes) {
    return invalid_argument("file '" + path + "' has " + std::to_string(size) +
                            " bytes, more than the " + std::to_string(max_bytes) + " allowed");
  }
  std::string out(static_cast<size_t>(size), '\0');
  HPS_RETURN_IF_ERROR(file.pread_all(out.data(), out.size(), 0));
  return out;
}

StatusOr<std::vector<std::string>> list_directory(const std::string& path) {
  DIR* dir = ::opendir(path.c_str());
  if (dir == nullptr) return os_error("cannot list directory", path, errno);
  std::vector<std::string> names;
  while (const dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(dir);
  return names;
}

std::string join_path(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  if (dir.back() == '/') return dir + name;
  return dir + "/" + name;
}

}  // namespace hps::ckpt
