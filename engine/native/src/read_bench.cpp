#include "read_bench.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <random>
#include <stdexcept>
#include <thread>

#include "direct_file.hpp"
#include "uring.hpp"

namespace tw {

ReadBenchResult read_benchmark(const std::string& path, std::uint64_t block, int threads, std::uint64_t total,
                               std::uint64_t seed, bool direct) {
  if (block == 0 || block % kDirectAlignment) throw std::invalid_argument("block must be a multiple of 4096");
  if (threads < 1 || threads > 256) throw std::invalid_argument("threads must be 1..256");
  DirectFile file(path, direct);
  if (file.size() < block) throw std::invalid_argument("file is smaller than one block");
  std::uint64_t n_blocks = file.size() / block;
  std::uint64_t n_reads = std::max<std::uint64_t>(1, total / block);
  std::atomic<std::uint64_t> next{0};
  std::mutex mu;
  ReadBenchResult result;
  std::string error;
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      void* mem = mmap(nullptr, block, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (mem == MAP_FAILED) return;
      std::mt19937_64 rng(seed * 1000003u + static_cast<std::uint64_t>(t));
      std::uniform_int_distribution<std::uint64_t> pick(0, n_blocks - 1);
      std::vector<std::int64_t> lat;
      try {
        while (next.fetch_add(1) < n_reads) {
          auto a = std::chrono::steady_clock::now();
          file.read_exact(pick(rng) * block, mem, static_cast<std::size_t>(block));
          lat.push_back((std::chrono::steady_clock::now() - a).count());
        }
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mu);
        error = e.what();
      }
      munmap(mem, block);
      std::lock_guard<std::mutex> lock(mu);
      result.latencies_ns.insert(result.latencies_ns.end(), lat.begin(), lat.end());
    });
  }
  for (auto& th : pool) th.join();
  if (!error.empty()) throw IoError(error);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  result.bytes = static_cast<std::uint64_t>(result.latencies_ns.size()) * block;
  return result;
}

}  // namespace tw

namespace tw {

ReadBenchResult read_benchmark_uring(const std::string& path, std::uint64_t block, int depth, std::uint64_t total,
                                     std::uint64_t seed, bool direct) {
  if (block == 0 || block % kDirectAlignment || block > (1u << 30))
    throw std::invalid_argument("block must be a multiple of 4096 (at most 1 GiB)");
  if (depth < 1 || depth > 1024) throw std::invalid_argument("depth must be 1..1024");
  DirectFile file(path, direct);
  if (file.size() < block) throw std::invalid_argument("file is smaller than one block");
  Uring ring(static_cast<unsigned>(depth));
  auto slots = static_cast<std::size_t>(std::min<unsigned>(static_cast<unsigned>(depth), ring.capacity()));
  std::size_t bytes = static_cast<std::size_t>(block) * slots;
  void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) throw std::bad_alloc();
  auto* base = static_cast<std::uint8_t*>(mem);
  std::uint64_t n_blocks = file.size() / block;
  std::uint64_t n_reads = std::max<std::uint64_t>(1, total / block);
  std::mt19937_64 rng(seed * 1000003u + 77u);
  std::uniform_int_distribution<std::uint64_t> pick(0, n_blocks - 1);
  std::vector<std::chrono::steady_clock::time_point> started(slots);
  ReadBenchResult result;
  std::vector<UringCompletion> done(slots);
  std::uint64_t issued = 0, finished = 0;
  std::string error;
  auto issue = [&](std::size_t s) {
    started[s] = std::chrono::steady_clock::now();
    ring.prepare_read(file.fd(), base + s * block, static_cast<std::uint32_t>(block), pick(rng) * block, s);
    ++issued;
  };
  auto t0 = std::chrono::steady_clock::now();
  for (std::size_t s = 0; s < slots && issued < n_reads; ++s) issue(s);
  ring.submit();
  while (finished < issued) {
    unsigned n = ring.wait(done.data(), static_cast<unsigned>(done.size()));
    auto now = std::chrono::steady_clock::now();
    for (unsigned i = 0; i < n; ++i) {
      auto s = static_cast<std::size_t>(done[i].user_data);
      ++finished;
      if (done[i].result != static_cast<std::int32_t>(block)) {
        // (a short direct read at a random aligned offset inside the file does not happen; treat it as an error)
        if (error.empty())
          error = path + ": read failed (" +
                  (done[i].result < 0 ? std::string(std::strerror(-done[i].result)) : std::string("short read")) +
                  ")";
        continue;
      }
      result.latencies_ns.push_back((now - started[s]).count());
      if (issued < n_reads && error.empty()) issue(s);
    }
    ring.submit();
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  munmap(mem, bytes);
  if (!error.empty()) throw IoError(error);
  result.bytes = static_cast<std::uint64_t>(result.latencies_ns.size()) * block;
  return result;
}

double memory_read_bandwidth(std::uint64_t bytes, int threads, int passes) {
  if (threads < 1 || threads > 256) throw std::invalid_argument("threads must be 1..256");
  if (passes < 1) throw std::invalid_argument("passes must be positive");
  std::size_t words = static_cast<std::size_t>(bytes / sizeof(std::uint64_t));
  words -= words % (static_cast<std::size_t>(threads) * 8);
  if (words == 0) throw std::invalid_argument("buffer too small");
  std::vector<std::uint64_t> buf(words);
  for (std::size_t i = 0; i < words; ++i) buf[i] = i;  // touched: every page is really there
  std::size_t per = words / static_cast<std::size_t>(threads);
  std::atomic<std::uint64_t> sink{0};
  double best = 0;
  for (int p = 0; p < passes; ++p) {
    std::atomic<int> ready{0};
    std::atomic<bool> go{false};
    std::vector<std::thread> pool;
    std::vector<double> secs(static_cast<std::size_t>(threads));
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        const std::uint64_t* a = buf.data() + per * static_cast<std::size_t>(t);
        ready.fetch_add(1);
        while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
        auto t1 = std::chrono::steady_clock::now();
        // Eight independent sums: loads, not the adds, bound the loop (the compiler vectorises it).
        std::uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0;
        for (std::size_t i = 0; i < per; i += 8) {
          s0 += a[i], s1 += a[i + 1], s2 += a[i + 2], s3 += a[i + 3];
          s4 += a[i + 4], s5 += a[i + 5], s6 += a[i + 6], s7 += a[i + 7];
        }
        secs[static_cast<std::size_t>(t)] =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
        sink.fetch_add(s0 + s1 + s2 + s3 + s4 + s5 + s6 + s7);
      });
    }
    while (ready.load() < threads) std::this_thread::yield();
    go.store(true, std::memory_order_release);
    for (auto& th : pool) th.join();
    double slowest = *std::max_element(secs.begin(), secs.end());
    if (slowest > 0) best = std::max(best, static_cast<double>(per * static_cast<std::size_t>(threads) * 8) / slowest);
  }
  return best;
}

}  // namespace tw
