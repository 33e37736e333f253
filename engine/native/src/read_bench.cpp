#include "read_bench.hpp"

#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <random>
#include <stdexcept>
#include <thread>

#include "direct_file.hpp"

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
