// Read-only file access that bypasses the OS file cache where the file system allows it.
//
// Expert reads go straight into RAM-cache slots (O_DIRECT on Linux); the file cache would hold a second
// copy of every expert and evict on its own terms. Where O_DIRECT is refused, the file is opened with
// ordinary cached reads and `direct()` says so, so the caller can print one line about it.
// Only Linux/POSIX is implemented; Windows (FILE_FLAG_NO_BUFFERING) and macOS (F_NOCACHE) belong here too.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace tw {

// A clear, one-line I/O error surfaced to the caller (never a crash, never wrong bytes).
class IoError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

inline constexpr std::size_t kDirectAlignment = 4096;

class DirectFile {
 public:
  // want_direct=false opens with cached reads on purpose (tests, tools reading small headers).
  DirectFile(const std::string& path, bool want_direct);
  ~DirectFile();
  DirectFile(const DirectFile&) = delete;
  DirectFile& operator=(const DirectFile&) = delete;

  bool direct() const { return direct_; }
  std::uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }
  const std::string& fallback_reason() const { return fallback_reason_; }
  int fd() const { return fd_; }  // for io_uring reads (same alignment rules as read_exact)

  // Reads exactly `len` bytes at `offset` into `dst`. With direct I/O, offset, len and dst must be
  // 4 KiB-aligned (the model file guarantees it for experts). Short reads are retried; a read past the
  // end of the file (truncated after open) or an I/O error throws IoError. Safe from many threads.
  void read_exact(std::uint64_t offset, void* dst, std::size_t len) const;

  void close();

 private:
  std::string path_;
  int fd_ = -1;
  bool direct_ = false;
  std::uint64_t size_ = 0;
  std::string fallback_reason_;
};

}  // namespace tw
