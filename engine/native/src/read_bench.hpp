// A fio-style raw read benchmark of the drive, with the same direct reads the core uses.
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

}  // namespace tw
