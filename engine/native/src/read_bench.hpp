// Raw probes: fio-style random reads of the drive (threads, or one io_uring), and RAM read bandwidth.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tw {

struct ReadBenchResult {
  double seconds = 0;
  std::uint64_t bytes = 0;
  std::vector<std::int64_t> latencies_ns;  // one per read
};

// `threads` threads each read `block`-byte blocks at random `block`-aligned offsets of the file (direct
// reads, falling back to cached ones) until `total` bytes have been read.
ReadBenchResult read_benchmark(const std::string& path, std::uint64_t block, int threads, std::uint64_t total,
                               std::uint64_t seed, bool direct);

// One thread keeps `depth` reads of `block` bytes in flight through io_uring (random `block`-aligned offsets)
// until `total` bytes have been read: the drive's deep-queue rate at the cost of one CPU thread. Throws IoError
// where io_uring is unavailable.
ReadBenchResult read_benchmark_uring(const std::string& path, std::uint64_t block, int depth, std::uint64_t total,
                                     std::uint64_t seed, bool direct);

// STREAM-style read bandwidth of RAM: `threads` threads sum their share of a `bytes` buffer (touched first),
// `passes` times; returns the best pass's bytes per second.
double memory_read_bandwidth(std::uint64_t bytes, int threads, int passes);

}  // namespace tw
