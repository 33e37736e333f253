// Which expert leaves a layer's RAM cache: the one policy shared by the live core and the trace simulator.
//
// Decode: each expert's value is its use count, halved every `decay_tokens` tokens; the lowest value leaves
// first, ties to the least recently used, then the lower expert ID. A prefetched expert nobody used is worth
// 0. With the history policy, an expert's count survives its eviction (a per-layer table of every expert's
// count): an expert that comes back resumes its count instead of starting at 1, so a popular expert evicted
// once is not the next to go (on the demo model's real routing: 1.33 → 1.25× Belady's misses at 25 % of the
// experts, 1.61 → 1.47× at 50 %; docs/results.md). An expert predicted in this token for a layer that has not run yet is never evicted by a prefetch, and
// by a demand read only if nothing else is left. Prompts use LRU, and each prompt batch ages the values by
// its token count.
//
// Learned (issue 43): each expert keeps its last use and its use counts decayed at several half-lives (kept through
// evictions, as history's count is); a linear score of log2(1 + age) and log2(1 + count) per half-life, fitted
// offline against hindsight's labels (tokenwing/streaming/learned.py, which computes the same features from a
// trace), ranks the slots: the lowest score leaves first.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace tw {

enum class SlotState : std::uint8_t { Empty, Loading, Ready, Loaned, Cancelling };
enum class Policy : std::uint8_t { Decay, Lru, History, Learned };

inline const char* policy_name(Policy p) {
  return p == Policy::Lru ? "lru" : p == Policy::History ? "history" : p == Policy::Learned ? "learned" : "decay";
}
inline Policy parse_policy(const std::string& name) {
  if (name == "decay") return Policy::Decay;
  if (name == "lru") return Policy::Lru;
  if (name == "history") return Policy::History;
  if (name == "learned") return Policy::Learned;
  throw std::invalid_argument("policy must be decay, history, learned or lru");
}

inline constexpr int kLearnedCounts = 6;   // most half-lives a learned model may use
inline constexpr double kMaxAge = 65536.0;  // an expert never used is this many tokens old

// score = w_age · log2(1 + age) + Σ w[i] · log2(1 + count decayed at half_life[i]), age and counts in tokens.
struct LearnedModel {
  int n = 0;
  double half_life[kLearnedCounts] = {};
  double w_age = 0.0;
  double w[kLearnedCounts] = {};
};

// From the flat form [n, half_life × n, w_age, w × n] (learned.py's EvictionModel.core_weights).
inline LearnedModel parse_learned(const std::vector<double>& flat) {
  LearnedModel m;
  if (flat.empty()) throw std::invalid_argument("the learned policy needs a model");
  m.n = static_cast<int>(flat[0]);
  if (m.n < 1 || m.n > kLearnedCounts || flat.size() != static_cast<std::size_t>(2 * m.n + 2))
    throw std::invalid_argument("a learned model is [n, n half-lives, the age's weight, n weights], n in 1..6");
  for (int i = 0; i < m.n; ++i) {
    m.half_life[i] = flat[static_cast<std::size_t>(1 + i)];
    m.w[i] = flat[static_cast<std::size_t>(2 + m.n + i)];
    if (!(m.half_life[i] > 0)) throw std::invalid_argument("a learned model's half-lives must be positive");
  }
  m.w_age = flat[static_cast<std::size_t>(1 + m.n)];
  return m;
}

inline constexpr std::uint64_t kNoToken = std::numeric_limits<std::uint64_t>::max();

struct SlotMeta {
  std::int32_t expert = -1;
  SlotState state = SlotState::Empty;
  double value = 0.0;       // use count as of `epoch`
  std::int64_t epoch = 0;   // decay epoch (tokens / decay_tokens) of `value`
  std::uint64_t last_use = 0;
  std::int32_t pins = 0;    // selected by the layer being computed: never evicted
  std::uint64_t protect_token = kNoToken;  // predicted in this token for a layer not yet run
  bool prefetched_unused = false;
  // The learned policy's features: uses decayed per half-life as of `lused` (the decay clock), -1: never used.
  double lcount[kLearnedCounts] = {};
  double lused = -1.0;
};

struct PolicyClock {
  Policy policy = Policy::Decay;
  bool prompt = false;            // prompt batches use LRU whatever the policy
  std::uint64_t decay_tokens = 64;
  std::uint64_t tokens = 0;       // decay clock: +1 per decode token, +n per prompt batch of n
  std::uint64_t use_tick = 0;     // recency clock
  std::uint64_t token_id = 0;     // which token is running (for prediction protection)
  LearnedModel learned;           // the learned policy's model

  std::int64_t epoch() const { return static_cast<std::int64_t>(tokens / decay_tokens); }
};

inline double decayed(double value, std::int64_t epoch, const PolicyClock& c) {
  std::int64_t halvings = c.epoch() - epoch;
  return halvings > 60 ? 0.0 : std::ldexp(value, -static_cast<int>(halvings));
}

inline double effective_value(const SlotMeta& s, const PolicyClock& c) {
  return s.prefetched_unused ? 0.0 : decayed(s.value, s.epoch, c);
}

// The learned score (higher: comes back sooner); a prefetch nobody used is the first to go, as with history.
inline double learned_score(const SlotMeta& s, const PolicyClock& c) {
  if (s.prefetched_unused) return -std::numeric_limits<double>::infinity();
  const LearnedModel& m = c.learned;
  double now = static_cast<double>(c.tokens);
  double age = s.lused < 0 ? kMaxAge : std::min(now - s.lused, kMaxAge);
  double v = m.w_age * std::log2(1.0 + age);
  for (int i = 0; i < m.n; ++i)
    if (s.lused >= 0) v += m.w[i] * std::log2(1.0 + s.lcount[i] * std::exp2(-(now - s.lused) / m.half_life[i]));
  return v;
}

// What the policy keeps: the lower leaves first (LRU: everything equal, recency decides).
inline double keep_value(const SlotMeta& s, const PolicyClock& c) {
  if (c.prompt || c.policy == Policy::Lru) return 0.0;
  return c.policy == Policy::Learned ? learned_score(s, c) : effective_value(s, c);
}

inline void record_use(SlotMeta& s, PolicyClock& c) {
  if (c.policy == Policy::Learned) {
    double now = static_cast<double>(c.tokens);
    for (int i = 0; i < c.learned.n; ++i)
      s.lcount[i] = (s.lused < 0 ? 0.0 : s.lcount[i] * std::exp2(-(now - s.lused) / c.learned.half_life[i])) + 1.0;
    s.lused = now;
  }
  s.value = decayed(s.value, s.epoch, c) + 1.0;
  s.epoch = c.epoch();
  s.prefetched_unused = false;
  s.last_use = ++c.use_tick;
}

// The history policy's memory of a layer: every expert's count as of its last eviction.
// (The learned policy keeps its features the same way.)
struct UseHistory {
  std::vector<double> value;
  std::vector<std::int64_t> epoch;
  std::vector<double> lused;
  std::vector<double> lcount;  // n_expert × kLearnedCounts
  explicit UseHistory(std::size_t n_expert = 0)
      : value(n_expert, 0.0), epoch(n_expert, 0), lused(n_expert, -1.0), lcount(n_expert * kLearnedCounts, 0.0) {}
  void save(const SlotMeta& s) {
    if (s.expert < 0 || static_cast<std::size_t>(s.expert) >= value.size()) return;
    auto e = static_cast<std::size_t>(s.expert);
    value[e] = s.value;
    epoch[e] = s.epoch;
    lused[e] = s.lused;
    std::copy(s.lcount, s.lcount + kLearnedCounts, lcount.begin() + static_cast<std::ptrdiff_t>(e * kLearnedCounts));
  }
};

// A freshly loaded expert: a demand read is used at once; a prefetch is worth 0 until used. Its count starts at
// 0, or (history) where it was when the expert last left.
inline void record_load(SlotMeta& s, PolicyClock& c, std::int32_t expert, bool prefetch,
                        const UseHistory* history = nullptr) {
  s.expert = expert;
  s.value = 0.0;
  s.epoch = c.epoch();
  if (c.policy == Policy::History && history && expert >= 0 &&
      static_cast<std::size_t>(expert) < history->value.size()) {
    s.value = history->value[static_cast<std::size_t>(expert)];
    s.epoch = history->epoch[static_cast<std::size_t>(expert)];
  }
  s.lused = -1.0;
  std::fill(s.lcount, s.lcount + kLearnedCounts, 0.0);
  if (history && expert >= 0 && static_cast<std::size_t>(expert) < history->lused.size()) {
    auto e = static_cast<std::size_t>(expert);
    s.lused = history->lused[e];
    std::copy(history->lcount.begin() + static_cast<std::ptrdiff_t>(e * kLearnedCounts),
              history->lcount.begin() + static_cast<std::ptrdiff_t>((e + 1) * kLearnedCounts), s.lcount);
  }
  s.prefetched_unused = prefetch;
  s.last_use = ++c.use_tick;
  if (!prefetch) record_use(s, c);
}

enum class Requester : std::uint8_t { Demand, Prefetch, FillEmptyOnly };

// Returns the slot to (re)use, or -1 when none may be taken. Empty slots always go first.
inline int choose_victim(const std::vector<SlotMeta>& slots, const PolicyClock& c, Requester who,
                         bool layer_started) {
  int best = -1, best_protected = -1;
  double best_v = 0.0, best_protected_v = 0.0;  // each slot's value computed once (the learned score is not free)
  auto worse = [&](int a, double va, int b, double vb) {  // true if slot a should leave before slot b
    const SlotMeta &x = slots[static_cast<std::size_t>(a)], &y = slots[static_cast<std::size_t>(b)];
    if (va != vb) return va < vb;
    if (x.last_use != y.last_use) return x.last_use < y.last_use;
    return x.expert < y.expert;
  };
  for (int i = 0; i < static_cast<int>(slots.size()); ++i) {
    const SlotMeta& s = slots[static_cast<std::size_t>(i)];
    if (s.state == SlotState::Empty) return i;
    if (who == Requester::FillEmptyOnly || s.state != SlotState::Ready || s.pins > 0) continue;
    bool prot = s.protect_token == c.token_id && !layer_started;
    int& target = prot ? best_protected : best;
    double& target_v = prot ? best_protected_v : best_v;
    double v = keep_value(s, c);
    if (target < 0 || worse(i, v, target, target_v)) target = i, target_v = v;
  }
  if (best >= 0) return best;
  return who == Requester::Demand ? best_protected : -1;
}

}  // namespace tw
