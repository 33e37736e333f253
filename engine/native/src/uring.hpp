// A minimal io_uring for positioned reads, on the raw system calls (no liburing: nothing more to bundle).
//
// Why: a deep queue of direct reads from one thread. With one blocking pread per thread, each read costs a
// wake-up and a context switch on both ends; with a ring, the caller queues many reads in one system call and
// one reaper thread collects completions in batches (on a 2-core machine those switches are compute time).
//
// Threading: the submission side (prepare + submit) must be serialised by the caller (the core's mutex); the
// completion side (wait + reap) belongs to one thread. The kernel allows the two to run at once.
#pragma once

#include <cstdint>
#include <string>

struct io_uring_sqe;

namespace tw {

struct UringCompletion {
  std::uint64_t user_data = 0;
  std::int32_t result = 0;  // bytes read, or -errno
};

class Uring {
 public:
  // Throws IoError with the reason when io_uring is unavailable (old kernel, seccomp, sysctl).
  explicit Uring(unsigned entries);
  ~Uring();
  Uring(const Uring&) = delete;
  Uring& operator=(const Uring&) = delete;

  unsigned capacity() const { return sq_entries_; }
  // Queues a read of `len` bytes at `offset` of `fd` into `dst`; false when the submission ring is full.
  bool prepare_read(int fd, void* dst, std::uint32_t len, std::uint64_t offset, std::uint64_t user_data);
  // Hands every prepared read to the kernel. Returns how many it took.
  unsigned submit();
  // Blocks until at least one completion is there, then copies up to `max` completions into `out`.
  unsigned wait(UringCompletion* out, unsigned max);
  // Wakes a thread blocked in wait(): a no-op whose completion carries kUringWakeTag (submission side).
  bool prepare_wake();

 private:
  unsigned reap(UringCompletion* out, unsigned max);
  io_uring_sqe* next_sqe();  // the next free submission entry, zeroed (nullptr when the ring is full)
  void release();
  int fd_ = -1;
  void* sq_ring_ = nullptr;
  void* cq_ring_ = nullptr;
  void* sqes_ = nullptr;
  std::size_t sq_ring_bytes_ = 0, cq_ring_bytes_ = 0, sqes_bytes_ = 0;
  unsigned sq_entries_ = 0, cq_entries_ = 0;
  unsigned* sq_head_ = nullptr;
  unsigned* sq_tail_ = nullptr;
  unsigned* sq_mask_ = nullptr;
  unsigned* sq_array_ = nullptr;
  unsigned* cq_head_ = nullptr;
  unsigned* cq_tail_ = nullptr;
  unsigned* cq_mask_ = nullptr;
  void* cqes_ = nullptr;
  unsigned local_tail_ = 0;   // prepared but not yet published
  unsigned to_submit_ = 0;
};

// Whether io_uring works here; the reason when it does not.
bool uring_available(std::string* why);

inline constexpr std::uint64_t kUringWakeTag = ~0ull;

}  // namespace tw
