#include "common/fileio/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <stdexcept>
#include <atomic>
#include <cerrno>
#include <system_error>

namespace moraine::fileio {

namespace {

std::string unique_temp_path(const std::string& path) {
  // PID for two processes, the counter for two threads (or two files) of one.
  static std::atomic<std::uint64_t> counter{0};
  return path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter.fetch_add(1));
}

std::string parent_dir(const std::string& path) {
  const std::size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

AtomicFile::AtomicFile(std::string path, unsigned mode) : path_(std::move(path)), tmp_(unique_temp_path(path_)) {
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, static_cast<mode_t>(mode));
  if (fd_ < 0) fail("cannot create");
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(tmp_.c_str());
}

void AtomicFile::write(const void* data, std::uint64_t n) {
  if (fd_ < 0) throw std::logic_error(tmp_ + ": write after commit");
  const auto* p = static_cast<const std::uint8_t*>(data);
  while (n > 0) {
    // Linux writes at most ~2 GiB per call; larger buffers go in pieces.
    const std::size_t chunk = static_cast<std::size_t>(std::min<std::uint64_t>(n, std::uint64_t{1} << 30));
    const ssize_t w = ::write(fd_, p, chunk);
    if (w < 0) {
      if (errno == EINTR) continue;
      fail("cannot write " + std::to_string(n) + " bytes at byte offset " + std::to_string(written_));
    }
    p += w;
    n -= static_cast<std::uint64_t>(w);
    written_ += static_cast<std::uint64_t>(w);
  }
}

void AtomicFile::commit() {
  if (fd_ < 0) throw std::logic_error(tmp_ + ": committed twice");
  // Without the fsync a power cut after the rename can leave the new name on an empty file
  // (ext4 delayed allocation): the rename is only as durable as the data under it.
  if (::fsync(fd_) != 0) fail("cannot fsync");
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) fail("cannot close");
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) fail("cannot rename to " + path_);
  committed_ = true;
  // The rename itself lives in the directory: fsync it so the new name survives a power cut.
  const std::string dir = parent_dir(path_);
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) throw std::system_error(errno, std::generic_category(), dir + ": cannot open to fsync after renaming " + path_);
  const int rc = ::fsync(dfd);
  const int err = errno;
  ::close(dfd);
  if (rc != 0) throw std::system_error(err, std::generic_category(), dir + ": cannot fsync after renaming " + path_);
}

void AtomicFile::fail(const std::string& what) const {
  throw std::system_error(errno, std::generic_category(), tmp_ + ": " + what);
}

void write_file_atomic(const std::string& path, std::string_view content, unsigned mode) {
  AtomicFile f(path, mode);
  f.write(content);
  f.commit();
}

}  // namespace moraine::fileio
