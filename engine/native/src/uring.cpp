#include "uring.hpp"

#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "direct_file.hpp"

namespace tw {
namespace {

int sys_setup(unsigned entries, io_uring_params* p) {
  return static_cast<int>(syscall(__NR_io_uring_setup, entries, p));
}

int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
  return static_cast<int>(syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, nullptr, 0));
}

unsigned load_acquire(const unsigned* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void store_release(unsigned* p, unsigned v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

template <typename T>
T* at(void* base, unsigned offset) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

}  // namespace

Uring::Uring(unsigned entries) {
  const char* off = std::getenv("TOKENWING_NO_IO_URING");  // a way out where io_uring misbehaves (and for tests)
  if (off && *off && std::strcmp(off, "0") != 0) throw IoError("io_uring is unavailable: TOKENWING_NO_IO_URING is set");
  io_uring_params p{};
  int fd = sys_setup(entries, &p);
  if (fd < 0) throw IoError(std::string("io_uring is unavailable: ") + std::strerror(errno));
  fd_ = fd;
  sq_entries_ = p.sq_entries;
  cq_entries_ = p.cq_entries;
  sq_ring_bytes_ = p.sq_off.array + p.sq_entries * sizeof(unsigned);
  cq_ring_bytes_ = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
  bool single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
  if (single) sq_ring_bytes_ = cq_ring_bytes_ = std::max(sq_ring_bytes_, cq_ring_bytes_);
  auto map = [&](std::size_t bytes, off_t what) {
    void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, what);
    if (m == MAP_FAILED) {
      int err = errno;
      release();
      throw IoError(std::string("io_uring rings cannot be mapped: ") + std::strerror(err));
    }
    return m;
  };
  sq_ring_ = map(sq_ring_bytes_, IORING_OFF_SQ_RING);
  cq_ring_ = single ? sq_ring_ : map(cq_ring_bytes_, IORING_OFF_CQ_RING);
  sqes_bytes_ = p.sq_entries * sizeof(io_uring_sqe);
  sqes_ = map(sqes_bytes_, IORING_OFF_SQES);
  sq_head_ = at<unsigned>(sq_ring_, p.sq_off.head);
  sq_tail_ = at<unsigned>(sq_ring_, p.sq_off.tail);
  sq_mask_ = at<unsigned>(sq_ring_, p.sq_off.ring_mask);
  sq_array_ = at<unsigned>(sq_ring_, p.sq_off.array);
  cq_head_ = at<unsigned>(cq_ring_, p.cq_off.head);
  cq_tail_ = at<unsigned>(cq_ring_, p.cq_off.tail);
  cq_mask_ = at<unsigned>(cq_ring_, p.cq_off.ring_mask);
  cqes_ = at<void>(cq_ring_, p.cq_off.cqes);
  local_tail_ = *sq_tail_;
}

Uring::~Uring() { release(); }

void Uring::release() {
  if (sqes_) munmap(sqes_, sqes_bytes_);
  if (cq_ring_ && cq_ring_ != sq_ring_) munmap(cq_ring_, cq_ring_bytes_);
  if (sq_ring_) munmap(sq_ring_, sq_ring_bytes_);
  sqes_ = cq_ring_ = sq_ring_ = nullptr;
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

io_uring_sqe* Uring::next_sqe() {
  unsigned head = load_acquire(sq_head_);
  if (local_tail_ - head >= sq_entries_) return nullptr;
  unsigned idx = local_tail_ & *sq_mask_;
  auto* sqe = static_cast<io_uring_sqe*>(sqes_) + idx;
  std::memset(sqe, 0, sizeof(*sqe));
  sq_array_[idx] = idx;
  ++local_tail_;
  ++to_submit_;
  return sqe;
}

bool Uring::prepare_read(int fd, void* dst, std::uint32_t len, std::uint64_t offset, std::uint64_t user_data) {
  io_uring_sqe* sqe = next_sqe();
  if (!sqe) return false;
  sqe->opcode = IORING_OP_READ;
  sqe->fd = fd;
  sqe->addr = reinterpret_cast<std::uint64_t>(dst);
  sqe->len = len;
  sqe->off = offset;
  sqe->user_data = user_data;
  return true;
}

bool Uring::prepare_wake() {
  io_uring_sqe* sqe = next_sqe();
  if (!sqe) return false;
  sqe->opcode = IORING_OP_NOP;
  sqe->user_data = kUringWakeTag;
  return true;
}

unsigned Uring::submit() {
  if (to_submit_ == 0) return 0;
  store_release(sq_tail_, local_tail_);
  unsigned want = to_submit_;
  unsigned done = 0;
  while (done < want) {
    int n = sys_enter(fd_, want - done, 0, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EBUSY) break;  // the kernel takes them on the next call
      throw IoError(std::string("io_uring submit failed: ") + std::strerror(errno));
    }
    if (n == 0) break;
    done += static_cast<unsigned>(n);
  }
  to_submit_ -= done;
  return done;
}

unsigned Uring::reap(UringCompletion* out, unsigned max) {
  unsigned head = *cq_head_;
  unsigned tail = load_acquire(cq_tail_);
  unsigned n = 0;
  while (head != tail && n < max) {
    const auto* cqe = static_cast<const io_uring_cqe*>(cqes_) + (head & *cq_mask_);
    out[n].user_data = cqe->user_data;
    out[n].result = cqe->res;
    ++n;
    ++head;
  }
  store_release(cq_head_, head);
  return n;
}

unsigned Uring::wait(UringCompletion* out, unsigned max) {
  for (;;) {
    unsigned n = reap(out, max);
    if (n) return n;
    int r = sys_enter(fd_, 0, 1, IORING_ENTER_GETEVENTS);
    if (r < 0 && errno != EINTR && errno != EAGAIN && errno != EBUSY)
      throw IoError(std::string("io_uring wait failed: ") + std::strerror(errno));
  }
}

bool uring_available(std::string* why) {
  try {
    Uring probe(2);
    return true;
  } catch (const IoError& e) {
    if (why) *why = e.what();
    return false;
  }
}

}  // namespace tw
