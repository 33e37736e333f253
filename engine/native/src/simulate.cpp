// Replaying a routing trace through the cache policy the core uses (decay or LRU), and Belady's optimum.
#include "simulate.hpp"

#include <algorithm>
#include <limits>
#include <stdexcept>

#include "cache_policy.hpp"

namespace tw {
namespace {

struct SimLayer {
  std::vector<SlotMeta> slots;
  std::vector<int> where;  // expert → slot
  UseHistory history;
  std::uint64_t started_token = kNoToken;
};

class Replay {
 public:
  Replay(const Trace& t, const SimConfig& c) : t_(t), c_(c), stats_(static_cast<std::size_t>(t.n_layers)) {
    clock_.policy = c.policy;
    clock_.decay_tokens = c.decay_tokens;
    if (c.policy == Policy::Learned) clock_.learned = parse_learned(c.learned);
    layers_.resize(static_cast<std::size_t>(t.n_layers));
    for (auto& L : layers_) {
      L.slots.resize(static_cast<std::size_t>(c.n_slots));
      L.where.assign(static_cast<std::size_t>(t.n_expert), -1);
      L.history = UseHistory(static_cast<std::size_t>(t.n_expert));
    }
    for (int li = 0; li < t.n_layers && !c.initial.empty(); ++li) {  // a warm start: loaded in this order
      for (int j = 0; j < c.initial_width && j < c.n_slots; ++j) {
        int e = c.initial[static_cast<std::size_t>(li) * static_cast<std::size_t>(c.initial_width) + j];
        SimLayer& L = layers_[static_cast<std::size_t>(li)];
        if (e < 0 || e >= t.n_expert || L.where[static_cast<std::size_t>(e)] >= 0) continue;
        SlotMeta& m = L.slots[static_cast<std::size_t>(j)];
        record_load(m, clock_, e, true);
        m.prefetched_unused = false;
        m.state = SlotState::Ready;
        L.where[static_cast<std::size_t>(e)] = j;
      }
    }
  }

  std::vector<LayerSimStats> run() {
    for (int tok = 0; tok < t_.n_tokens; ++tok) {
      std::int64_t prompt = t_.prompt_tokens.empty() ? 0 : t_.prompt_tokens[static_cast<std::size_t>(tok)];
      clock_.token_id++;
      clock_.prompt = prompt > 0;
      clock_.tokens += prompt > 0 ? static_cast<std::uint64_t>(prompt) : 1;
      // Predictions made before the first streamed layer (from layers that are not streamed).
      for (int li = 0; li < t_.n_layers && c_.prefetch; ++li)
        for (int d = 0; d < t_.n_dist; ++d)
          if (li - d - 1 < 0) prefetch(tok, li, d);
      for (int li = 0; li < t_.n_layers; ++li) {
        run_layer(tok, li);
        for (int d = 0; d < t_.n_dist && c_.prefetch; ++d)
          if (li + d + 1 < t_.n_layers) prefetch(tok, li + d + 1, d);
      }
    }
    return stats_;
  }

 private:
  void run_layer(int tok, int li) {
    SimLayer& L = layers_[static_cast<std::size_t>(li)];
    LayerSimStats& st = stats_[static_cast<std::size_t>(li)];
    L.started_token = clock_.token_id;
    for (auto& s : L.slots) s.pins = 0;
    // As the core does: every selected expert already here is pinned before a miss picks a victim.
    for (int k = 0; k < t_.k; ++k) {
      int e = t_.selected_at(tok, li, k);
      int s = e < 0 ? -1 : L.where[static_cast<std::size_t>(e)];
      if (s >= 0) L.slots[static_cast<std::size_t>(s)].pins = 1;
    }
    std::vector<int> seen;
    for (int k = 0; k < t_.k; ++k) {
      int e = t_.selected_at(tok, li, k);
      if (e < 0 || std::find(seen.begin(), seen.end(), e) != seen.end()) continue;  // (selected twice)
      seen.push_back(e);
      int s = L.where[static_cast<std::size_t>(e)];
      if (s >= 0) {
        SlotMeta& m = L.slots[static_cast<std::size_t>(s)];
        st.hits++;
        if (m.prefetched_unused) st.prefetch_used++;
        record_use(m, clock_);
        continue;
      }
      st.misses++;
      s = choose_victim(L.slots, clock_, Requester::Demand, true);
      if (s < 0) throw std::runtime_error("more selected experts than slots");
      load(L, st, s, e, false);
      L.slots[static_cast<std::size_t>(s)].pins = 1;
    }
  }

  void prefetch(int tok, int li, int d) {
    SimLayer& L = layers_[static_cast<std::size_t>(li)];
    LayerSimStats& st = stats_[static_cast<std::size_t>(li)];
    bool started = L.started_token == clock_.token_id;
    if (started) return;
    for (int k = 0; k < t_.k; ++k) {
      int e = t_.predicted_at(tok, li, d, k);
      if (e < 0) continue;
      int s = L.where[static_cast<std::size_t>(e)];
      if (s >= 0) {
        L.slots[static_cast<std::size_t>(s)].protect_token = clock_.token_id;
        continue;
      }
      if (!clock_.prompt && votes(tok, li, d, e) < std::min(c_.prefetch_votes, predictors(tok, li))) continue;
      s = choose_victim(L.slots, clock_, Requester::Prefetch, started);
      if (s < 0) {
        st.prefetch_dropped++;
        continue;
      }
      load(L, st, s, e, true);
      L.slots[static_cast<std::size_t>(s)].protect_token = clock_.token_id;
    }
  }

  // How many of the predictions made so far in this token for layer li (distance d and farther) name e.
  int votes(int tok, int li, int d, int e) const {
    int n = 0;
    for (int dd = d; dd < t_.n_dist; ++dd) {
      for (int k = 0; k < t_.k; ++k)
        if (t_.predicted_at(tok, li, dd, k) == e) {
          ++n;
          break;
        }
    }
    return n;
  }

  // How many distances predict layer li in this token at all (the votes needed are capped by it, as the core does).
  int predictors(int tok, int li) const {
    int n = 0;
    for (int d = 0; d < t_.n_dist; ++d) n += t_.predicted_at(tok, li, d, 0) >= 0;
    return n;
  }

  void load(SimLayer& L, LayerSimStats& st, int s, int e, bool is_prefetch) {
    SlotMeta& m = L.slots[static_cast<std::size_t>(s)];
    if (m.expert >= 0) {
      if (m.prefetched_unused) st.prefetch_wasted++;
      L.where[static_cast<std::size_t>(m.expert)] = -1;
      L.history.save(m);
    }
    m = SlotMeta{};
    record_load(m, clock_, e, is_prefetch, &L.history);
    m.state = SlotState::Ready;
    L.where[static_cast<std::size_t>(e)] = s;
    (is_prefetch ? st.prefetch_reads : st.demand_reads)++;
  }

  const Trace& t_;
  SimConfig c_;
  PolicyClock clock_;
  std::vector<SimLayer> layers_;
  std::vector<LayerSimStats> stats_;
};

}  // namespace

void Trace::check() const {
  if (n_tokens < 0 || n_layers <= 0 || k <= 0 || n_expert <= 0 || n_dist < 0)
    throw std::invalid_argument("trace dimensions must be positive");
  if (selected.size() != static_cast<std::size_t>(n_tokens) * n_layers * k)
    throw std::invalid_argument("selected has the wrong size");
  if (predicted.size() != static_cast<std::size_t>(n_tokens) * n_layers * n_dist * k)
    throw std::invalid_argument("predicted has the wrong size");
  if (!prompt_tokens.empty() && prompt_tokens.size() != static_cast<std::size_t>(n_tokens))
    throw std::invalid_argument("prompt_tokens has the wrong size");
  for (int e : selected)
    if (e >= n_expert) throw std::invalid_argument("trace selects an expert beyond n_expert");
  for (int e : predicted)
    if (e >= n_expert) throw std::invalid_argument("trace predicts an expert beyond n_expert");
}

void check_initial(const Trace& t, const std::vector<std::int32_t>& initial, int width) {
  if (!initial.empty() && (width <= 0 || initial.size() != static_cast<std::size_t>(t.n_layers) * width))
    throw std::invalid_argument("the initial cache must hold layers × width experts");
}

std::vector<LayerSimStats> simulate_policy(const Trace& t, const SimConfig& c) {
  t.check();
  check_initial(t, c.initial, c.initial_width);
  if (c.n_slots < t.k) throw std::invalid_argument("need at least k slots per layer");
  return Replay(t, c).run();
}

// Belady's MIN for demand reads: on a miss with a full layer cache, evict the expert (not selected by this
// token) whose next use lies furthest ahead. Exact for this cache model: every selected expert of a token
// must be resident at once, and a read happens only on a miss.
std::vector<LayerSimStats> simulate_belady(const Trace& t, int n_slots, const std::vector<std::int32_t>& initial,
                                           int initial_width) {
  t.check();
  check_initial(t, initial, initial_width);
  if (n_slots < t.k) throw std::invalid_argument("need at least k slots per layer");
  std::vector<LayerSimStats> out(static_cast<std::size_t>(t.n_layers));
  constexpr int kNever = std::numeric_limits<int>::max();
  for (int li = 0; li < t.n_layers; ++li) {
    // next_use[tok*k + j]: the next token after tok that selects the same expert.
    std::vector<int> next_use(static_cast<std::size_t>(t.n_tokens) * t.k, kNever);
    std::vector<int> upcoming(static_cast<std::size_t>(t.n_expert), kNever);
    for (int tok = t.n_tokens - 1; tok >= 0; --tok) {
      for (int j = 0; j < t.k; ++j) {
        int e = t.selected_at(tok, li, j);
        if (e >= 0) next_use[static_cast<std::size_t>(tok) * t.k + j] = upcoming[static_cast<std::size_t>(e)];
      }
      for (int j = 0; j < t.k; ++j) {
        int e = t.selected_at(tok, li, j);
        if (e >= 0) upcoming[static_cast<std::size_t>(e)] = tok;
      }
    }
    std::vector<int> resident;                                   // experts in the cache
    std::vector<int> nxt(static_cast<std::size_t>(t.n_expert), kNever);  // next use of each resident expert
    std::vector<int> in_token(static_cast<std::size_t>(t.n_expert), -1);
    for (int j = 0; j < initial_width && j < n_slots && !initial.empty(); ++j) {  // a warm start
      int e = initial[static_cast<std::size_t>(li) * static_cast<std::size_t>(initial_width) + j];
      if (e < 0 || e >= t.n_expert || std::find(resident.begin(), resident.end(), e) != resident.end()) continue;
      resident.push_back(e);
      nxt[static_cast<std::size_t>(e)] = upcoming[static_cast<std::size_t>(e)];  // its first use in the trace
    }
    LayerSimStats& st = out[static_cast<std::size_t>(li)];
    for (int tok = 0; tok < t.n_tokens; ++tok) {
      for (int j = 0; j < t.k; ++j) {
        int e = t.selected_at(tok, li, j);
        if (e < 0 || in_token[static_cast<std::size_t>(e)] == tok) continue;
        in_token[static_cast<std::size_t>(e)] = tok;
        nxt[static_cast<std::size_t>(e)] = next_use[static_cast<std::size_t>(tok) * t.k + j];
        if (std::find(resident.begin(), resident.end(), e) != resident.end()) {
          st.hits++;
          continue;
        }
        st.misses++;
        st.demand_reads++;
        if (static_cast<int>(resident.size()) < n_slots) {
          resident.push_back(e);
          continue;
        }
        int victim = -1;
        for (int i = 0; i < static_cast<int>(resident.size()); ++i) {
          int r = resident[static_cast<std::size_t>(i)];
          if (in_token[static_cast<std::size_t>(r)] == tok) continue;
          if (victim < 0 || nxt[static_cast<std::size_t>(r)] >
                                nxt[static_cast<std::size_t>(resident[static_cast<std::size_t>(victim)])])
            victim = i;
        }
        resident[static_cast<std::size_t>(victim)] = e;
      }
    }
  }
  return out;
}

}  // namespace tw
