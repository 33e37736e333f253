#include "direct_file.hpp"

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace tw {
namespace {

std::string errno_text(int err) { return std::strerror(err); }

// O_DIRECT is accepted by open() on some file systems that then fail the first read (EINVAL), so the
// probe reads one aligned block before trusting it.
bool probe_direct_read(int fd, std::uint64_t file_size) {
  if (file_size < kDirectAlignment) return true;  // nothing aligned to read; open() already accepted it
  void* buf = nullptr;
  if (posix_memalign(&buf, kDirectAlignment, kDirectAlignment) != 0) return false;
  ssize_t n = pread(fd, buf, kDirectAlignment, 0);
  std::free(buf);
  return n == static_cast<ssize_t>(kDirectAlignment);
}

}  // namespace

DirectFile::DirectFile(const std::string& path, bool want_direct) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw IoError("cannot open " + path + ": " + errno_text(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    throw IoError("cannot stat " + path + ": " + errno_text(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw IoError(path + " is not a regular file");
  }
  size_ = static_cast<std::uint64_t>(st.st_size);
  fd_ = fd;
  if (!want_direct) return;
#ifdef O_DIRECT
  int dfd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
  if (dfd < 0) {
    fallback_reason_ = "the file system refuses O_DIRECT (" + errno_text(errno) + ")";
    return;
  }
  if (!probe_direct_read(dfd, size_)) {
    ::close(dfd);
    fallback_reason_ = "direct reads fail on this file system";
    return;
  }
  ::close(fd_);
  fd_ = dfd;
  direct_ = true;
#else
  fallback_reason_ = "direct reads are not implemented on this platform yet";
#endif
}

DirectFile::~DirectFile() { close(); }

void DirectFile::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void DirectFile::read_exact(std::uint64_t offset, void* dst, std::size_t len) const {
  if (fd_ < 0) throw IoError(path_ + ": read after close");
  if (direct_) {
    auto addr = reinterpret_cast<std::uintptr_t>(dst);
    if (offset % kDirectAlignment || len % kDirectAlignment || addr % kDirectAlignment)
      throw IoError(path_ + ": unaligned direct read (offset " + std::to_string(offset) + ", length " +
                    std::to_string(len) + ")");
  }
  auto* out = static_cast<unsigned char*>(dst);
  std::size_t done = 0;
  while (done < len) {
    ssize_t n = pread(fd_, out + done, len - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw IoError(path_ + ": read failed at offset " + std::to_string(offset + done) + ": " +
                    errno_text(errno));
    }
    if (n == 0)
      throw IoError(path_ + ": file ends at offset " + std::to_string(offset + done) +
                    " (truncated or replaced?)");
    done += static_cast<std::size_t>(n);
  }
}

}  // namespace tw
