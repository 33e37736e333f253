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
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace tw {

enum class SlotState : std::uint8_t { Empty, Loading, Ready, Loaned, Cancelling };
enum class Policy : std::uint8_t { Decay, Lru, History };

inline const char* policy_name(Policy p) {
  return p == Policy::Lru ? "lru" : p == Policy::History ? "history" : "decay";
}
inline Policy parse_policy(const std::string& name) {
  if (name == "decay") return Policy::Decay;
  if (name == "lru") return Policy::Lru;
  if (name == "history") return Policy::History;
  throw std::invalid_argument("policy must be decay, history or lru");
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
};

struct PolicyClock {
  Policy policy = Policy::Decay;
  bool prompt = false;            // prompt batches use LRU whatever the policy
  std::uint64_t decay_tokens = 64;
  std::uint64_t tokens = 0;       // decay clock: +1 per decode token, +n per prompt batch of n
  std::uint64_t use_tick = 0;     // recency clock
  std::uint64_t token_id = 0;     // which token is running (for prediction protection)

  std::int64_t epoch() const { return static_cast<std::int64_t>(tokens / decay_tokens); }
};

inline double decayed(double value, std::int64_t epoch, const PolicyClock& c) {
  std::int64_t halvings = c.epoch() - epoch;
  return halvings > 60 ? 0.0 : std::ldexp(value, -static_cast<int>(halvings));
}

inline double effective_value(const SlotMeta& s, const PolicyClock& c) {
  return s.prefetched_unused ? 0.0 : decayed(s.value, s.epoch, c);
}

inline void record_use(SlotMeta& s, PolicyClock& c) {
  s.value = decayed(s.value, s.epoch, c) + 1.0;
  s.epoch = c.epoch();
  s.prefetched_unused = false;
  s.last_use = ++c.use_tick;
}

// The history policy's memory of a layer: every expert's count as of its last eviction.
struct UseHistory {
  std::vector<double> value;
  std::vector<std::int64_t> epoch;
  explicit UseHistory(std::size_t n_expert = 0) : value(n_expert, 0.0), epoch(n_expert, 0) {}
  void save(const SlotMeta& s) {
    if (s.expert < 0 || static_cast<std::size_t>(s.expert) >= value.size()) return;
    value[static_cast<std::size_t>(s.expert)] = s.value;
    epoch[static_cast<std::size_t>(s.expert)] = s.epoch;
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
  s.prefetched_unused = prefetch;
  s.last_use = ++c.use_tick;
  if (!prefetch) record_use(s, c);
}

enum class Requester : std::uint8_t { Demand, Prefetch, FillEmptyOnly };

// Returns the slot to (re)use, or -1 when none may be taken. Empty slots always go first.
inline int choose_victim(const std::vector<SlotMeta>& slots, const PolicyClock& c, Requester who,
                         bool layer_started) {
  int best = -1, best_protected = -1;
  auto worse = [&](int a, int b) {  // true if slot a should leave before slot b
    const SlotMeta &x = slots[static_cast<std::size_t>(a)], &y = slots[static_cast<std::size_t>(b)];
    if (c.policy != Policy::Lru && !c.prompt) {
      double vx = effective_value(x, c), vy = effective_value(y, c);
      if (vx != vy) return vx < vy;
    }
    if (x.last_use != y.last_use) return x.last_use < y.last_use;
    return x.expert < y.expert;
  };
  for (int i = 0; i < static_cast<int>(slots.size()); ++i) {
    const SlotMeta& s = slots[static_cast<std::size_t>(i)];
    if (s.state == SlotState::Empty) return i;
    if (who == Requester::FillEmptyOnly || s.state != SlotState::Ready || s.pins > 0) continue;
    bool prot = s.protect_token == c.token_id && !layer_started;
    int& target = prot ? best_protected : best;
    if (target < 0 || worse(i, target)) target = i;
  }
  if (best >= 0) return best;
  return who == Requester::Demand ? best_protected : -1;
}

}  // namespace tw
