// Trace replay: the engine's own eviction policy against LRU and Belady, on recorded or synthetic routing.
#pragma once

#include <cstdint>
#include <vector>

#include "cache_policy.hpp"

namespace tw {

// selected[tok][layer][k] and predicted[tok][layer][dist][k] (predictions FOR that layer made `dist+1`
// layers earlier), -1 where empty; prompt_tokens[tok] > 0 marks a prompt batch of that many tokens.
struct Trace {
  int n_tokens = 0, n_layers = 0, k = 0, n_dist = 0, n_expert = 0;
  std::vector<std::int32_t> selected, predicted;
  std::vector<std::int64_t> prompt_tokens;

  int selected_at(int tok, int li, int j) const {
    return selected[(static_cast<std::size_t>(tok) * n_layers + li) * k + j];
  }
  int predicted_at(int tok, int li, int d, int j) const {
    return predicted[((static_cast<std::size_t>(tok) * n_layers + li) * n_dist + d) * k + j];
  }
  void check() const;
};

struct SimConfig {
  int n_slots = 0;
  Policy policy = Policy::Decay;
  bool prefetch = false;
  std::uint64_t decay_tokens = 64;
  int prefetch_votes = 1;
  std::vector<double> learned;  // the learned policy's model, flat (parse_learned)  // a prediction is read once this many distances predicted it (see StreamConfig)
  // The cache at the start: n_layers × width experts (-1 empty), width ≤ n_slots; empty: a cold cache.
  std::vector<std::int32_t> initial;
  int initial_width = 0;
};

struct LayerSimStats {
  std::uint64_t hits = 0, misses = 0, demand_reads = 0, prefetch_reads = 0, prefetch_used = 0,
                prefetch_wasted = 0, prefetch_dropped = 0;
};

std::vector<LayerSimStats> simulate_policy(const Trace& t, const SimConfig& c);
std::vector<LayerSimStats> simulate_belady(const Trace& t, int n_slots, const std::vector<std::int32_t>& initial = {},
                                           int initial_width = 0);

}  // namespace tw
