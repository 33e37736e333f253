#include "stream_core.hpp"

#include <cstring>

#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>

#include <algorithm>
#include <stdexcept>

namespace tw {

namespace {

using Clock = std::chrono::steady_clock;

std::int64_t now_ns() { return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count(); }

void name_thread(const char* name) { pthread_setname_np(pthread_self(), name); }

std::uint64_t overlap(std::uint64_t a0, std::uint64_t a1, std::uint64_t b0, std::uint64_t b1) {
  std::uint64_t lo = std::max(a0, b0), hi = std::min(a1, b1);
  return hi > lo ? hi - lo : 0;
}

}  // namespace

const char* counter_name(int c) {
  static const char* names[kNumCounters] = {
      "hits",           "misses",           "demand_reads",      "prefetch_issued", "prefetch_used",
      "prefetch_wasted", "prefetch_cancelled", "prefetch_promoted", "prefetch_dropped", "idle_fills",
      "bytes_read",     "wait_ns",          "read_errors",       "prefetch_late",   "demand_predicted",
      "known_reads",    "known_late",       "known_wait_ns"};
  return (c >= 0 && c < kNumCounters) ? names[c] : "?";
}

StreamCore::StreamCore(const std::string& path, int n_expert, std::vector<LayerGeometry> layers,
                       StreamConfig config)
    : file_(path, config.direct), n_expert_(n_expert), cfg_(config) {
  if (n_expert <= 0) throw std::invalid_argument("n_expert must be positive");
  if (layers.empty()) throw std::invalid_argument("no streamed layers");
  if (cfg_.io_threads < 1 || cfg_.io_threads > 256) throw std::invalid_argument("io_threads must be 1..256");
  if (cfg_.chunk_bytes == 0 || cfg_.chunk_bytes % kDirectAlignment)
    throw std::invalid_argument("chunk size must be a positive multiple of 4096");
  if (cfg_.decay_tokens == 0) throw std::invalid_argument("decay_tokens must be positive");
  clock_.policy = cfg_.policy;
  clock_.decay_tokens = cfg_.decay_tokens;
  if (cfg_.policy == Policy::Learned) clock_.learned = parse_learned(cfg_.learned);
  layers_ = std::vector<Layer>(layers.size());  // in place: Layer is not cheaply movable
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const LayerGeometry& g = layers[i];
    if (g.n_slots <= 0)
      throw std::invalid_argument("layer " + std::to_string(i) + " has a budget of zero slots");
    if (g.record_size == 0 || g.record_size % kDirectAlignment || g.offset % kDirectAlignment)
      throw std::invalid_argument("expert records must be 4096-aligned");
    for (int p = 0; p < 3; ++p)
      if (g.proj_offset[p] + g.proj_size[p] > g.record_size)
        throw std::invalid_argument("projection outside its record");
    if (g.offset + g.record_size * static_cast<std::uint64_t>(n_expert) > file_.size())
      throw IoError(path + ": the expert records run past the end of the file");
    Layer& L = layers_[i];
    L.geo = g;
    std::size_t bytes = static_cast<std::size_t>(g.record_size) * static_cast<std::size_t>(g.n_slots);
    void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) {
      for (std::size_t j = 0; j < i; ++j)
        munmap(layers_[j].memory, layers_[j].geo.record_size * static_cast<std::size_t>(layers_[j].geo.n_slots));
      throw std::bad_alloc();
    }
    L.memory = static_cast<std::uint8_t*>(mem);
#ifdef MADV_HUGEPAGE
    // Huge pages where the kernel allows them on request: far fewer TLB misses when kernels sweep experts.
    madvise(mem, bytes, MADV_HUGEPAGE);
#endif
    for (int s = 0; s < g.n_slots; ++s) L.slots.push_back(std::make_unique<Slot>());
    L.metas.resize(static_cast<std::size_t>(g.n_slots));
    L.expert_slot.assign(static_cast<std::size_t>(n_expert), -1);
    L.history = UseHistory(static_cast<std::size_t>(n_expert));
  }
  last_activity_ = Clock::now();
  if (cfg_.io_engine == IoEngine::Uring) {
    try {
      ring_ = std::make_unique<Uring>(static_cast<unsigned>(cfg_.io_threads));
    } catch (const IoError& e) {
      io_fallback_ = std::string(e.what()) + ": reads use I/O threads";
    }
  }
  if (ring_) {
    ops_.resize(static_cast<std::size_t>(cfg_.io_threads));
    for (int i = cfg_.io_threads - 1; i >= 0; --i) free_ops_.push_back(i);
    reaper_ = std::thread([this] { reap_loop(); });
  } else {
    for (int t = 0; t < cfg_.io_threads; ++t) threads_.emplace_back([this] { io_loop(); });
  }
  if (cfg_.idle_fill_ms >= 0) idle_thread_ = std::thread([this] { idle_loop(); });
  populate_thread_ = std::thread([this] { populate_loop(); });
}

StreamCore::~StreamCore() { close(); }

void StreamCore::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    closed_ = stop_ = true;
    if (ring_ && ring_->prepare_wake()) ring_->submit();  // the reaper leaves once its reads have landed
  }
  io_cv_.notify_all();
  ready_cv_.notify_all();
  idle_cv_.notify_all();
  other_cv_.notify_all();
  for (auto& t : threads_) t.join();
  threads_.clear();
  if (reaper_.joinable()) reaper_.join();
  ring_.reset();
  if (idle_thread_.joinable()) idle_thread_.join();
  if (populate_thread_.joinable()) populate_thread_.join();
  for (Layer& L : layers_) {
    if (L.memory) munmap(L.memory, L.geo.record_size * static_cast<std::size_t>(L.geo.n_slots));
    L.memory = nullptr;
  }
  file_.close();
}

StreamCore::Layer& StreamCore::layer(int li) {
  if (li < 0 || li >= n_layers()) throw std::out_of_range("no streamed layer " + std::to_string(li));
  return layers_[static_cast<std::size_t>(li)];
}
const StreamCore::Layer& StreamCore::layer(int li) const {
  if (li < 0 || li >= n_layers()) throw std::out_of_range("no streamed layer " + std::to_string(li));
  return layers_[static_cast<std::size_t>(li)];
}
void StreamCore::check_expert(int expert) const {
  if (expert < 0 || expert >= n_expert_)
    throw std::out_of_range("no expert " + std::to_string(expert) + " (the model has " +
                            std::to_string(n_expert_) + ")");
}

int StreamCore::n_slots(int li) const { return layer(li).geo.n_slots; }
std::uint64_t StreamCore::record_size(int li) const { return layer(li).geo.record_size; }
std::uint8_t* StreamCore::slot_memory(int li) const { return layer(li).memory; }

// ------------------------------------------------------------------------------------------- the API

void StreamCore::begin_token(std::uint64_t prompt_tokens) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stop_) throw IoError("the streaming core is closed");
  touch();
  clock_.token_id++;
  clock_.prompt = prompt_tokens > 0;
  clock_.tokens += prompt_tokens > 0 ? prompt_tokens : 1;
  // Predictions of the previous token that never started are stale.
  waiting_.erase(std::remove_if(waiting_.begin(), waiting_.end(), [](const Prediction& p) { return !p.fill; }),
                 waiting_.end());
}

std::vector<bool> StreamCore::begin_layer(int li, const std::vector<int>& experts, const std::vector<int>& keep) {
  std::unique_lock<std::mutex> lock(mu_);
  if (stop_) throw IoError("the streaming core is closed");
  Layer& L = layer(li);
  for (int e : experts) check_expert(e);
  for (int e : keep) check_expert(e);
  std::vector<int> selected = experts;
  selected.insert(selected.end(), keep.begin(), keep.end());
  std::sort(selected.begin(), selected.end());
  selected.erase(std::unique(selected.begin(), selected.end()), selected.end());
  int usable = 0;
  for (auto& s : L.slots) usable += s->meta.state != SlotState::Loaned;
  if (static_cast<int>(selected.size()) > usable)
    throw std::invalid_argument("layer " + std::to_string(li) + " needs " + std::to_string(selected.size()) +
                                " slots but has " + std::to_string(usable));
  touch();
  std::int64_t now = now_ns();
  if (!clock_.prompt && last_begin_token_ == clock_.token_id && li > last_begin_li_) {
    double sample = static_cast<double>(now - last_begin_ns_) / (li - last_begin_li_);
    layer_ns_ = layer_ns_ == 0 ? sample : 0.8 * layer_ns_ + 0.2 * sample;
  }
  last_begin_ns_ = now, last_begin_li_ = li, last_begin_token_ = clock_.token_id;
  L.started_token = clock_.token_id;
  for (auto& s : L.slots) s->meta.pins = 0;  // the previous step of this layer is done
  L.pending_demand.clear();
  auto is_selected = [&](int e) { return std::binary_search(selected.begin(), selected.end(), e); };

  // Cancel: this layer's predictions the router did not select.
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    if (it->li == li && !it->fill && !is_selected(it->expert)) {
      L.count[kPrefetchCancelled]++;
      it = waiting_.erase(it);
    } else {
      ++it;
    }
  }
  for (int s = 0; s < L.geo.n_slots; ++s) {
    Slot& sl = *L.slots[static_cast<std::size_t>(s)];
    if (sl.meta.state != SlotState::Loading || !sl.is_prefetch || is_selected(sl.meta.expert)) continue;
    auto drop = [&](std::deque<Chunk>& q) {
      q.erase(std::remove_if(q.begin(), q.end(), [&](const Chunk& c) { return c.li == li && c.slot == s; }),
              q.end());
    };
    drop(prefetch_q_);
    sl.queued = 0;
    L.expert_slot[static_cast<std::size_t>(sl.meta.expert)] = -1;
    sl.meta.expert = -1;
    sl.meta.state = sl.inflight > 0 ? SlotState::Cancelling : SlotState::Empty;
    L.count[kPrefetchCancelled]++;
  }

  std::vector<int> order;  // the router's order, each expert once
  for (int e : experts)
    if (std::find(order.begin(), order.end(), e) == order.end()) order.push_back(e);
  // Pin every selected or kept expert already here before any read picks a victim: a miss early in the list
  // must not evict a hit later in it, nor a later wave's expert (kept: pinned, not counted as used).
  for (int e : selected) {
    int s = L.expert_slot[static_cast<std::size_t>(e)];
    if (s >= 0) L.slots[static_cast<std::size_t>(s)]->meta.pins++;
  }
  for (int e : order) {
    int s = L.expert_slot[static_cast<std::size_t>(e)];
    if (s >= 0) {
      Slot& sl = *L.slots[static_cast<std::size_t>(s)];
      if (sl.meta.state == SlotState::Ready) {
        L.count[kHits]++;
        if (sl.meta.prefetched_unused && !sl.known) L.count[kPrefetchUsed]++;
        sl.known = false;
      } else {  // still loading
        L.count[kMisses]++;
        if (sl.known) {
          L.count[kKnownLate]++;  // (its read is a demand read already: the layer waits on it)
        } else if (sl.is_prefetch) {
          L.count[kPrefetchUsed]++;
          L.count[kPrefetchPromoted]++;
          sl.is_prefetch = false;
          // Promote: its queued chunks move to the demand queue, in order.
          std::deque<Chunk> moved;
          for (auto it = prefetch_q_.begin(); it != prefetch_q_.end();) {
            if (it->li == li && it->slot == s) {
              Chunk c = *it;
              c.demand = true;
              moved.push_back(c);
              it = prefetch_q_.erase(it);
            } else {
              ++it;
            }
          }
          for (const Chunk& c : moved) demand_q_.push_back(c);
          sl.issued = Clock::now();
          sl.timing = true;
        }
      }
      record_use(sl.meta, clock_);
      continue;
    }
    L.count[kMisses]++;
    if (remove_prediction(li, e)) L.count[kDemandPredicted]++;  // predicted, but its read had not started
    int free_slot = find_slot(L, Requester::Demand);
    if (free_slot < 0) {
      L.pending_demand.push_back(e);
      continue;
    }
    start_demand(li, e, free_slot);
  }
  std::vector<bool> ready;  // what the caller can compute at once, without asking again
  ready.reserve(experts.size());
  for (int e : experts) {
    int s = L.expert_slot[static_cast<std::size_t>(e)];
    ready.push_back(s >= 0 && L.slots[static_cast<std::size_t>(s)]->meta.state == SlotState::Ready);
  }
  // Wake the I/O threads only when there is something to read: waking them for a layer of hits costs
  // context switches the compute threads pay for (measured: 35 µs per layer on 2 cores).
  bool work = !demand_q_.empty() || !prefetch_q_.empty() || !waiting_.empty() || !L.pending_demand.empty();
  if (work) {
    kick(lock);
  }
  return ready;
}

void StreamCore::kick(std::unique_lock<std::mutex>& lock) {
  if (ring_) {
    pump();
    lock.unlock();
  } else {
    lock.unlock();
    io_cv_.notify_all();
  }
}

void StreamCore::end_layer(int li) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& s : layer(li).slots) s->meta.pins = 0, s->known = false;
}

// A known expert is certain, so its read is a demand read issued early: in the demand queue (ahead of every
// prediction, in call order), outside the prefetch caps, in chunks (queue_chunks). Issued as predictions (probability 1, read first) they
// were bound a 512 KiB chunk at a time under the prefetch cap (4 chunks in flight), so on ds4-bench at 25 % a fifth
// of them had not started when layer 0 began (its attention takes a few ms, 6 experts of 1.7 MB take ~6 ms at
// 1.8 GB/s) and became demand reads there: 1.25 / 1.44 / 1.19 a token in the three hash layers.
void StreamCore::read_known(int li, const std::vector<int>& experts) {
  std::unique_lock<std::mutex> lock(mu_);
  if (stop_) throw IoError("the streaming core is closed");
  Layer& L = layer(li);
  for (int e : experts) check_expert(e);
  touch();
  if (layer_started(L)) return;  // too late for this token: begin_layer reads them
  // Demand reads still waiting for a slot (a layer under way, when another thread begins a token) come first: a
  // known read pins its slot until the layer's next start, which that layer's waiter could then never reach.
  if (!L.pending_demand.empty()) return;
  bool added = false;
  for (int e : experts) {
    int s = L.expert_slot[static_cast<std::size_t>(e)];
    if (s < 0) {
      remove_prediction(li, e);
      s = find_slot(L, Requester::Demand);
      if (s < 0) continue;  // every slot pinned: begin_layer reads it on demand
      Slot& sl = *L.slots[static_cast<std::size_t>(s)];
      record_load(sl.meta, clock_, e, true, &L.history);  // (its use is counted when its layer begins)
      sl.meta.state = SlotState::Loading;
      sl.is_prefetch = false;
      sl.known = true;
      sl.timing = false;  // (the demand latencies are those of reads a layer asked for)
      L.expert_slot[static_cast<std::size_t>(e)] = s;
      L.count[kKnownReads]++;
      queue_chunks(li, s, true, nullptr, false);
      added = true;
    }
    // Resident or on its way: kept until its layer begins (begin_layer unpins, then pins what it selects)
    SlotMeta& m = L.slots[static_cast<std::size_t>(s)]->meta;
    m.pins = std::max(m.pins, 1);
    m.protect_token = clock_.token_id;
  }
  if (added) kick(lock);
}

void StreamCore::predict(int li, const std::vector<int>& experts, int distance, const std::vector<double>& probs,
                         int max_votes) {
  std::unique_lock<std::mutex> lock(mu_);
  if (stop_) throw IoError("the streaming core is closed");
  Layer& L = layer(li);
  for (int e : experts) check_expert(e);
  touch();
  if (layer_started(L)) return;  // too late for this token
  // When its layer is expected to start: the layers between, at the measured decode pace.
  std::int64_t deadline = 0;
  if (layer_ns_ > 0 && !clock_.prompt) {
    bool same_token = last_begin_token_ == clock_.token_id && li > last_begin_li_;
    int between = same_token ? li - last_begin_li_ : distance;
    deadline = (same_token ? last_begin_ns_ : now_ns()) + static_cast<std::int64_t>(between * layer_ns_);
  }
  bool added = false;
  int rank = 0;
  for (std::size_t i = 0; i < experts.size(); ++i) {
    int e = experts[i];
    int s = L.expert_slot[static_cast<std::size_t>(e)];
    if (s >= 0) {  // resident or on its way: protect it for this token
      L.slots[static_cast<std::size_t>(s)]->meta.protect_token = clock_.token_id;
      ++rank;
      continue;
    }
    auto it = std::find_if(waiting_.begin(), waiting_.end(),
                           [&](const Prediction& p) { return p.li == li && p.expert == e; });
    Prediction p{li, e, distance, rank++, pred_seq_++, false, i < probs.size() ? probs[i] : 0.0, 1, max_votes, deadline};
    if (it != waiting_.end()) {
      if (!it->fill) p.votes = it->votes + 1;
      Prediction keep = (it->fill || before(p, *it)) ? p : *it;
      keep.votes = p.votes;
      keep.max_votes = std::max(p.max_votes, it->fill ? 0 : it->max_votes);
      keep.deadline = std::max(keep.deadline, it->fill ? 0 : it->deadline);
      waiting_.erase(it);
      p = keep;
    }
    waiting_.insert(std::upper_bound(waiting_.begin(), waiting_.end(), p, before), p);
    added = true;
  }
  if (added) {
    kick(lock);
  }
}

template <typename Test>
std::vector<bool> StreamCore::slot_states(int li, const std::vector<int>& experts, Test test) {
  std::lock_guard<std::mutex> lock(mu_);
  Layer& L = layer(li);
  std::vector<bool> out;
  for (int e : experts) {
    check_expert(e);
    int s = L.expert_slot[static_cast<std::size_t>(e)];
    out.push_back(s >= 0 && test(L.slots[static_cast<std::size_t>(s)].get()));
  }
  return out;
}

std::vector<bool> StreamCore::holding(int li, const std::vector<int>& experts) {
  return slot_states(li, experts, [](const Slot*) { return true; });
}

std::vector<bool> StreamCore::ready(int li, const std::vector<int>& experts) {
  return slot_states(li, experts, [](const Slot* s) { return s->meta.state == SlotState::Ready; });
}

int StreamCore::wait(int li, int expert, int proj) {
  if (proj < -1 || proj > 2) throw std::out_of_range("projection must be -1, 0, 1 or 2");
  std::unique_lock<std::mutex> lock(mu_);
  Layer& L = layer(li);
  check_expert(expert);
  auto t0 = Clock::now();
  bool waited = false;
  for (;;) {
    if (stop_) throw IoError("the streaming core is closed");
    auto err = L.errors.find(expert);
    if (err != L.errors.end()) {
      std::string msg = err->second;
      L.errors.erase(err);
      throw IoError(msg);
    }
    int s = L.expert_slot[static_cast<std::size_t>(expert)];
    if (s >= 0) {
      Slot& sl = *L.slots[static_cast<std::size_t>(s)];
      std::uint32_t want = proj < 0 ? 7u : (1u << proj);
      if ((sl.ready_mask.load(std::memory_order_acquire) & want) == want) {
        if (waited) {
          auto ns = static_cast<std::uint64_t>((Clock::now() - t0).count());
          L.count[kWaitNs] += ns;
          if (sl.known) L.count[kKnownWaitNs] += ns;
        }
        return s;
      }
    } else if (std::find(L.pending_demand.begin(), L.pending_demand.end(), expert) == L.pending_demand.end()) {
      throw std::logic_error("expert " + std::to_string(expert) + " of layer " + std::to_string(li) +
                             " was not selected (call begin_layer first)");
    }
    waited = true;
    waiters_.emplace_back(li, expert);
    ready_cv_.wait(lock);
    waiters_.erase(std::find(waiters_.begin(), waiters_.end(), std::make_pair(li, expert)));
  }
}

void StreamCore::note_waiter_slot(int li, int slot) {
  if (waiters_.empty()) return;
  int expert = layers_[static_cast<std::size_t>(li)].slots[static_cast<std::size_t>(slot)]->meta.expert;
  for (const auto& w : waiters_)
    if (w.first == li && w.second == expert) wake_waiters_ = true;
}

std::vector<int> StreamCore::wait_all(int li, const std::vector<int>& experts) {
  std::vector<int> slots;
  slots.reserve(experts.size());
  for (int e : experts) slots.push_back(wait(li, e, -1));
  return slots;
}

// --------------------------------------------------------------------------------- slots and queues

int StreamCore::find_slot(Layer& L, Requester who) {
  for (std::size_t i = 0; i < L.slots.size(); ++i) L.metas[i] = L.slots[i]->meta;
  int s = choose_victim(L.metas, clock_, who, layer_started(L));
  if (s >= 0) evict(L, s);
  return s;
}

void StreamCore::evict(Layer& L, int s) {
  Slot& sl = *L.slots[static_cast<std::size_t>(s)];
  if (sl.meta.state == SlotState::Ready && sl.meta.expert >= 0) {
    if (sl.meta.prefetched_unused) L.count[kPrefetchWasted]++;
    L.expert_slot[static_cast<std::size_t>(sl.meta.expert)] = -1;
    L.history.save(sl.meta);
  }
  sl.meta = SlotMeta{};
  sl.known = false;
  sl.ready_mask.store(0, std::memory_order_release);
}

void StreamCore::start_demand(int li, int expert, int s) {
  Layer& L = layers_[static_cast<std::size_t>(li)];
  Slot& sl = *L.slots[static_cast<std::size_t>(s)];
  record_load(sl.meta, clock_, expert, false, &L.history);
  sl.meta.state = SlotState::Loading;
  sl.meta.pins = 1;
  sl.is_prefetch = false;
  sl.known = false;
  sl.issued = Clock::now();
  sl.timing = true;
  L.expert_slot[static_cast<std::size_t>(expert)] = s;
  L.count[kDemandReads]++;
  queue_chunks(li, s, true, nullptr, true);
}

// A demand read is one whole request — or, with split_demand, two: gate and up (which lie first in a record), then
// down, so the gate/up products can start while down lands; a prefetch is split into chunks, and so is a known read
// (read_known), though it waits in the demand queue: the known experts of a token are many reads queued at once, and
// in chunks they are served strictly in order, layer 0's first, at the drive's best rate (ds4-bench's probe:
// 512 KiB × 8 in flight 2.6 GB/s, 2 MiB × 8 1.4-1.5). With `first`, the first chunk is handed to the calling I/O
// thread instead of queued, and each other chunk wakes a thread of its own.
void StreamCore::queue_chunks(int li, int s, bool demand, Chunk* first, bool whole) {
  Layer& L = layers_[static_cast<std::size_t>(li)];
  Slot& sl = *L.slots[static_cast<std::size_t>(s)];
  sl.gen++;
  sl.remaining = L.geo.proj_size;
  sl.ready_mask.store(0, std::memory_order_release);
  std::vector<std::uint64_t> cuts;  // chunk starts
  const auto& po = L.geo.proj_offset;
  if (whole) {
    cuts.push_back(0);
    bool down_last = po[2] > po[0] && po[2] > po[1] && po[2] % kDirectAlignment == 0;
    if (cfg_.split_demand && down_last) cuts.push_back(po[2]);
  } else {
    for (std::uint64_t off = 0; off < L.geo.record_size; off += cfg_.chunk_bytes) cuts.push_back(off);
  }
  bool handed = false;
  for (std::size_t i = 0; i < cuts.size(); ++i) {
    std::uint64_t end = i + 1 < cuts.size() ? cuts[i + 1] : L.geo.record_size;
    Chunk c{li, s, sl.gen, cuts[i], end - cuts[i], demand};
    if (first && !handed) {
      *first = c;
      handed = true;
      sl.inflight++;
      continue;
    }
    (demand ? demand_q_ : prefetch_q_).push_back(c);
    sl.queued++;
    if (!ring_) io_cv_.notify_one();
  }
}

bool StreamCore::remove_prediction(int li, int expert) {
  auto end = std::remove_if(waiting_.begin(), waiting_.end(),
                            [&](const Prediction& p) { return p.li == li && p.expert == expert && !p.fill; });
  bool predicted = end != waiting_.end();
  waiting_.erase(end, waiting_.end());
  // (an idle fill's entry goes too, uncounted: it is no prediction of this token)
  waiting_.erase(std::remove_if(waiting_.begin(), waiting_.end(),
                                [&](const Prediction& p) { return p.li == li && p.expert == expert; }),
                 waiting_.end());
  return predicted;
}

void StreamCore::assign_pending(int li) {
  Layer& L = layers_[static_cast<std::size_t>(li)];
  while (!L.pending_demand.empty()) {
    int s = find_slot(L, Requester::Demand);
    if (s < 0) return;
    int e = L.pending_demand.front();
    L.pending_demand.pop_front();
    start_demand(li, e, s);
  }
}

bool StreamCore::take_work(Chunk& out) {
  if (stop_) return false;
  bool taken;
  if (io_allowance_ >= 0) {
    if (io_allowance_ == 0) return false;
    taken = take_any(out);
    if (taken) io_allowance_--;
  } else {
    taken = take_any(out);
  }
  if (taken && in_service_++ == 0) busy_since_ = now_ns();
  return taken;
}

bool StreamCore::take_any(Chunk& out) {
  if (!demand_q_.empty()) {
    out = demand_q_.front();
    demand_q_.pop_front();
    demand_busy_++;
    marks_[2] = std::max(marks_[2], static_cast<std::uint64_t>(demand_busy_));
    Slot& sl = *layers_[static_cast<std::size_t>(out.li)].slots[static_cast<std::size_t>(out.slot)];
    sl.queued--;
    sl.inflight++;
    return true;
  }
  int cap = demand_busy_ > 0 ? cfg_.prefetch_cap_busy : cfg_.prefetch_cap_idle;
  if (prefetch_busy_ < cap) {
    if (!prefetch_q_.empty()) {
      out = prefetch_q_.front();
      prefetch_q_.pop_front();
      prefetch_busy_++;
      note_prefetch_start();
      Slot& sl = *layers_[static_cast<std::size_t>(out.li)].slots[static_cast<std::size_t>(out.slot)];
      sl.queued--;
      sl.inflight++;
      return true;
    }
    if (bind_prediction(out)) {
      prefetch_busy_++;
      note_prefetch_start();
      return true;
    }
  }
  return take_other(out);
}

// Another file's read goes last: only when no expert read may start, and never into the last free reader, so a
// demand read queued next starts at once (behind reads already on the drive, none queued ahead of it).
bool StreamCore::take_other(Chunk& out) {
  int readers = std::max(1, cfg_.io_threads - 1);
  if (demand_busy_ + prefetch_busy_ + other_busy_ >= readers) return false;
  while (!other_q_.empty()) {
    OtherJob* j = other_q_.front();
    if (!j->error.empty() || j->issued >= j->len) {
      other_q_.pop_front();
      continue;
    }
    out = Chunk{};
    out.other = j;
    out.off = j->issued;
    out.len = std::min(j->chunk, j->len - j->issued);
    j->issued += out.len;
    j->inflight++;
    other_busy_++;
    if (j->issued >= j->len) other_q_.pop_front();
    return true;
  }
  return false;
}

void StreamCore::complete_other(const Chunk& c, const std::string* error) {
  OtherJob& j = *c.other;
  other_busy_--;
  j.inflight--;
  if (--in_service_ == 0) busy_ns_ += now_ns() - busy_since_;
  if (error) {
    if (j.error.empty()) j.error = *error;
  } else {
    j.landed += c.len;
  }
  other_cv_.notify_all();
}

std::uint64_t StreamCore::start_other(const DirectFile& file, std::uint64_t offset, void* dst, std::uint64_t len,
                                      std::uint64_t chunk) {
  if (chunk == 0 || (file.direct() && chunk % kDirectAlignment))
    throw std::invalid_argument("chunk size must be a positive multiple of 4096");
  if (file.direct() && (offset % kDirectAlignment || len % kDirectAlignment ||
                        reinterpret_cast<std::uintptr_t>(dst) % kDirectAlignment))
    throw IoError(file.path() + ": unaligned direct read");
  std::unique_lock<std::mutex> lock(mu_);
  if (stop_) throw IoError("the streaming core is closed");
  auto job = std::make_unique<OtherJob>();
  job->file = &file;
  job->dst = static_cast<std::uint8_t*>(dst);
  job->offset = offset;
  job->len = len;
  job->chunk = chunk;
  std::uint64_t id = ++other_seq_;
  if (len > 0) other_q_.push_back(job.get());
  other_jobs_[id] = std::move(job);
  kick(lock);
  return id;
}

void StreamCore::wait_other(std::uint64_t id) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = other_jobs_.find(id);
  if (it == other_jobs_.end()) throw std::invalid_argument("no such read");
  OtherJob& j = *it->second;
  other_cv_.wait(lock, [&] {
    return j.inflight == 0 && (j.landed == j.len || !j.error.empty() || stop_);
  });
  std::string error = j.landed == j.len ? std::string() : j.error.empty() ? "the streaming core is closed" : j.error;
  std::erase(other_q_, &j);
  other_jobs_.erase(it);
  if (!error.empty()) throw IoError(error);
}

std::array<std::uint64_t, 2> StreamCore::other_depths() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::uint64_t left = 0;
  for (const auto& [id, j] : other_jobs_)
    if (j->error.empty()) left += j->len - j->issued;
  return {left, static_cast<std::uint64_t>(other_busy_)};
}

void StreamCore::note_prefetch_start() {
  auto& mark = demand_busy_ > 0 ? marks_[0] : marks_[1];
  mark = std::max(mark, static_cast<std::uint64_t>(prefetch_busy_));
}

// Late binding: a prediction gets a slot only now, when this thread has nothing more urgent to do.
bool StreamCore::bind_prediction(Chunk& out) {
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    int need = it->max_votes > 0 ? std::min(cfg_.prefetch_votes, it->max_votes) : cfg_.prefetch_votes;
    if (!it->fill && !clock_.prompt && it->votes < need) {  // waits for a nearer one to confirm it
      ++it;
      continue;
    }
    Prediction p = *it;
    it = waiting_.erase(it);
    Layer& L = layers_[static_cast<std::size_t>(p.li)];
    if (L.expert_slot[static_cast<std::size_t>(p.expert)] >= 0) continue;
    if (!p.fill && layer_started(L)) continue;
    if (!p.fill && cfg_.skip_late && late(p, L)) {
      L.count[kPrefetchLate]++;
      continue;
    }
    int s = find_slot(L, p.fill ? Requester::FillEmptyOnly : Requester::Prefetch);
    if (s < 0) {
      if (!p.fill) L.count[kPrefetchDropped]++;
      continue;
    }
    Slot& sl = *L.slots[static_cast<std::size_t>(s)];
    record_load(sl.meta, clock_, p.expert, true, &L.history);
    sl.meta.state = SlotState::Loading;
    if (!p.fill) sl.meta.protect_token = clock_.token_id;
    sl.is_prefetch = true;
    sl.known = false;
    sl.timing = false;
    L.expert_slot[static_cast<std::size_t>(p.expert)] = s;
    L.count[p.fill ? kIdleFills : kPrefetchIssued]++;
    queue_chunks(p.li, s, false, &out, false);
    return true;
  }
  return false;
}

// Whether a prediction's read, queued now behind everything already queued, would land after its layer starts
// (at the throughput reads have had while in flight): then it is not read at all.
bool StreamCore::late(const Prediction& p, const Layer& L) const {
  std::int64_t busy = busy_ns_ + (in_service_ > 0 ? now_ns() - busy_since_ : 0);
  if (p.deadline == 0 || busy <= 0 || bytes_done_ == 0) return false;
  double bytes_per_ns = static_cast<double>(bytes_done_) / static_cast<double>(busy);
  std::uint64_t ahead = L.geo.record_size;
  for (const Chunk& c : demand_q_) ahead += c.len;
  for (const Chunk& c : prefetch_q_) ahead += c.len;
  return now_ns() + static_cast<std::int64_t>(static_cast<double>(ahead) / bytes_per_ns) > p.deadline;
}

std::array<double, 2> StreamCore::estimates() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::int64_t busy = busy_ns_ + (in_service_ > 0 ? now_ns() - busy_since_ : 0);
  return {busy > 0 ? static_cast<double>(bytes_done_) * 1e9 / static_cast<double>(busy) : 0.0, layer_ns_};
}

void StreamCore::complete(const Chunk& c, const std::string* error, std::vector<int>& transforms) {
  Layer& L = layers_[static_cast<std::size_t>(c.li)];
  Slot& sl = *L.slots[static_cast<std::size_t>(c.slot)];
  (c.demand ? demand_busy_ : prefetch_busy_)--;
  sl.inflight--;
  if (--in_service_ == 0) busy_ns_ += now_ns() - busy_since_;
  if (!error) {
    bytes_done_ += c.len;
    if (bytes_done_ > (std::uint64_t{1} << 32)) bytes_done_ /= 2, busy_ns_ /= 2;  // the recent rate counts
  }
  if (sl.meta.state == SlotState::Cancelling) {
    if (sl.inflight == 0 && sl.queued == 0) {
      sl.meta = SlotMeta{};
      sl.ready_mask.store(0, std::memory_order_release);
      assign_pending(c.li);
    }
    return;
  }
  if (sl.meta.state != SlotState::Loading || sl.gen != c.gen) return;
  if (error) {
    L.count[kReadErrors]++;
    int expert = sl.meta.expert;
    // Drop the rest of this expert's reads; the slot is free once nothing is in flight.
    auto drop = [&](std::deque<Chunk>& q) {
      q.erase(std::remove_if(q.begin(), q.end(), [&](const Chunk& x) { return x.li == c.li && x.slot == c.slot; }),
              q.end());
    };
    drop(demand_q_);
    drop(prefetch_q_);
    sl.queued = 0;
    L.expert_slot[static_cast<std::size_t>(expert)] = -1;
    if (!sl.is_prefetch || sl.meta.pins > 0) L.errors[expert] = *error;
    wake_waiters_ = true;
    sl.meta.expert = -1;
    sl.meta.state = sl.inflight > 0 ? SlotState::Cancelling : SlotState::Empty;
    if (sl.meta.state == SlotState::Empty) {
      sl.meta = SlotMeta{};
      assign_pending(c.li);
    }
    return;
  }
  L.count[kBytesRead] += c.len;
  std::uint32_t mask = sl.ready_mask.load(std::memory_order_relaxed);
  for (int p = 0; p < 3; ++p) {
    auto pi = static_cast<std::size_t>(p);
    std::uint64_t o = L.geo.proj_offset[pi];
    std::uint64_t got = overlap(c.off, c.off + c.len, o, o + L.geo.proj_size[pi]);
    std::uint64_t& rem = sl.remaining[pi];
    bool landed = got > 0 && rem > 0 && rem <= got;
    rem -= std::min(rem, got);
    if (L.transform[pi].fn == nullptr) {
      if (rem == 0) mask |= 1u << p;
    } else if (landed) {
      sl.inflight++;  // the transform holds the slot like a read in flight
      transforms.push_back(p);
    }
  }
  if (mask != sl.ready_mask.load(std::memory_order_relaxed)) note_waiter_slot(c.li, c.slot);
  sl.ready_mask.store(mask, std::memory_order_release);
  finish_if_done(sl);
  if (sl.meta.state == SlotState::Ready) {
    note_waiter_slot(c.li, c.slot);
    // A slot that was not evictable (a known read its layer did not select) is now: demand reads waiting for a
    // slot take it, or they would wait for the layer's next start, which their waiter never reaches.
    if (!L.pending_demand.empty()) assign_pending(c.li);
  }
}

void StreamCore::finish_if_done(Slot& sl) {
  if (sl.inflight != 0 || sl.queued != 0) return;
  sl.meta.state = SlotState::Ready;
  sl.ready_mask.store(7u, std::memory_order_release);
  if (sl.timing) {
    latencies_.push_back(static_cast<std::int64_t>((Clock::now() - sl.issued).count()));
    sl.timing = false;
  }
}

void StreamCore::run_transform(int li, int slot, int proj, std::vector<std::uint8_t>& staging) {
  // Without the lock: the slot cannot be reassigned while its transform counts as in flight.
  Layer& L = layers_[static_cast<std::size_t>(li)];
  auto pi = static_cast<std::size_t>(proj);
  std::size_t size = static_cast<std::size_t>(L.geo.proj_size[pi]);
  std::uint8_t* at = L.memory + static_cast<std::size_t>(slot) * L.geo.record_size + L.geo.proj_offset[pi];
  if (staging.size() < size) staging.resize(size);
  std::memcpy(staging.data(), at, size);
  L.transform[pi].fn(L.transform[pi].ctx[static_cast<std::size_t>(slot)], staging.data(), 0, size);
}

void StreamCore::transformed(int li, int slot, int proj, std::uint32_t gen) {
  Layer& L = layers_[static_cast<std::size_t>(li)];
  Slot& sl = *L.slots[static_cast<std::size_t>(slot)];
  sl.inflight--;
  if (sl.meta.state == SlotState::Cancelling) {
    if (sl.inflight == 0 && sl.queued == 0) {
      sl.meta = SlotMeta{};
      sl.ready_mask.store(0, std::memory_order_release);
      assign_pending(li);
    }
    return;
  }
  if (sl.meta.state != SlotState::Loading || sl.gen != gen) return;
  sl.ready_mask.store(sl.ready_mask.load(std::memory_order_relaxed) | (1u << proj), std::memory_order_release);
  note_waiter_slot(li, slot);
  finish_if_done(sl);
  if (sl.meta.state == SlotState::Ready && !L.pending_demand.empty()) assign_pending(li);  // (as in complete)
}

void StreamCore::set_transform(int li, int proj, TransformFn fn, std::vector<void*> ctx) {
  std::lock_guard<std::mutex> lock(mu_);
  Layer& L = layer(li);
  if (proj < 0 || proj > 2) throw std::invalid_argument("projection must be 0, 1 or 2");
  if (fn != nullptr && ctx.size() != L.slots.size())
    throw std::invalid_argument("a transform needs one context per slot");
  L.transform[static_cast<std::size_t>(proj)] = Transform{fn, std::move(ctx)};
}

// A finished read (under the lock): bookkeeping, the transforms it completed (run without the lock), then the
// waiters whose expert it was are woken — only they: a wake-up per landed chunk is a context switch that the
// compute threads pay for on a small machine.
void StreamCore::after_read(const Chunk& c, const std::string* error, std::unique_lock<std::mutex>& lock,
                            std::vector<int>& transforms, std::vector<std::uint8_t>& staging) {
  if (c.other) {
    complete_other(c, error);
    return;
  }
  transforms.clear();
  complete(c, error, transforms);
  std::uint32_t gen = c.gen;
  for (int p : transforms) {
    lock.unlock();
    run_transform(c.li, c.slot, p, staging);
    lock.lock();
    transformed(c.li, c.slot, p, gen);
  }
  if (wake_waiters_) {
    wake_waiters_ = false;
    ready_cv_.notify_all();
  }
}

void StreamCore::io_loop() {
  name_thread("tw-io");
  std::vector<int> transforms;
  std::vector<std::uint8_t> staging;  // a projection's plain bytes while it is rewritten in place
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    Chunk c;
    if (!take_work(c)) {
      io_cv_.wait(lock);
      continue;
    }
    const DirectFile* file = &file_;
    std::uint8_t* dst;
    std::uint64_t at;
    if (c.other) {
      file = c.other->file;
      dst = c.other->dst + c.off;
      at = c.other->offset + c.off;
    } else {
      Layer& L = layers_[static_cast<std::size_t>(c.li)];
      dst = L.memory + static_cast<std::size_t>(c.slot) * L.geo.record_size + c.off;
      at = L.geo.offset +
           static_cast<std::uint64_t>(L.slots[static_cast<std::size_t>(c.slot)]->meta.expert) * L.geo.record_size +
           c.off;
    }
    lock.unlock();
    std::string error;
    bool failed = false;
    try {
      file->read_exact(at, dst, static_cast<std::size_t>(c.len));
    } catch (const std::exception& e) {
      error = e.what();
      failed = true;
    }
    lock.lock();
    after_read(c, failed ? &error : nullptr, lock, transforms, staging);
    io_cv_.notify_one();  // a cap may have opened
  }
}

// io_uring: whoever holds the lock with new work submits it (one system call for all of it); the caps and the
// queues' order are the same as with threads, and `io_threads` reads are in flight at most.
void StreamCore::pump() {
  if (!ring_) return;
  bool any = false;
  while (!free_ops_.empty()) {
    Chunk c;
    if (!take_work(c)) break;
    int op = free_ops_.back();
    free_ops_.pop_back();
    ops_[static_cast<std::size_t>(op)] = RingOp{c, 0};
    submit_op(op);
    any = true;
  }
  if (any) ring_->submit();
}

void StreamCore::submit_op(int op) {
  RingOp& o = ops_[static_cast<std::size_t>(op)];
  if (o.c.other) {
    const OtherJob& j = *o.c.other;
    ring_->prepare_read(j.file->fd(), j.dst + o.c.off + o.done, static_cast<std::uint32_t>(o.c.len - o.done),
                        j.offset + o.c.off + o.done, static_cast<std::uint64_t>(op));
    return;
  }
  Layer& L = layers_[static_cast<std::size_t>(o.c.li)];
  std::uint64_t expert = static_cast<std::uint64_t>(L.slots[static_cast<std::size_t>(o.c.slot)]->meta.expert);
  std::uint8_t* dst = L.memory + static_cast<std::size_t>(o.c.slot) * L.geo.record_size + o.c.off + o.done;
  std::uint64_t at = L.geo.offset + expert * L.geo.record_size + o.c.off + o.done;
  ring_->prepare_read(file_.fd(), dst, static_cast<std::uint32_t>(o.c.len - o.done), at,
                      static_cast<std::uint64_t>(op));
}

void StreamCore::reap_loop() {
  name_thread("tw-reap");
  std::vector<UringCompletion> got(64);
  std::vector<int> transforms;
  std::vector<std::uint8_t> staging;
  for (;;) {
    unsigned n = 0;
    std::string wait_error;
    try {
      n = ring_->wait(got.data(), static_cast<unsigned>(got.size()));
    } catch (const std::exception& e) {
      wait_error = e.what();
    }
    std::unique_lock<std::mutex> lock(mu_);
    if (!wait_error.empty()) {  // the ring itself failed: every read in flight fails with it
      for (std::size_t op = 0; op < ops_.size(); ++op) {
        if (std::find(free_ops_.begin(), free_ops_.end(), static_cast<int>(op)) != free_ops_.end()) continue;
        Chunk c = ops_[op].c;
        free_ops_.push_back(static_cast<int>(op));
        after_read(c, &wait_error, lock, transforms, staging);
      }
    }
    for (unsigned i = 0; i < n; ++i) {
      if (got[i].user_data == kUringWakeTag) continue;
      int op = static_cast<int>(got[i].user_data);
      RingOp& o = ops_[static_cast<std::size_t>(op)];
      std::int32_t res = got[i].result;
      std::string error;
      const std::string& path = o.c.other ? o.c.other->file->path() : file_.path();
      if (res < 0) {
        error = path + ": read failed at offset " + std::to_string(o.c.off + o.done) + ": " + std::strerror(-res);
      } else if (res == 0) {
        error = path + (o.c.other ? ": the file ends early (truncated?)"
                                  : ": file ends inside an expert record (truncated or replaced?)");
      } else {
        o.done += static_cast<std::uint64_t>(res);
        if (o.done < o.c.len) {  // a short read: the rest is read again
          submit_op(op);
          ring_->submit();
          continue;
        }
      }
      Chunk c = o.c;
      free_ops_.push_back(op);
      after_read(c, error.empty() ? nullptr : &error, lock, transforms, staging);
    }
    if (stop_ && free_ops_.size() == ops_.size()) return;
    pump();
  }
}

// The kernel zeroes a slot's memory (anonymous, huge pages) the first time a read lands in it, and io_uring faults
// it in from the reaping thread: each first fill of a slot held back the reads behind it. glm5-bench at a 40 %
// cap, 16 decode tokens: 61 % of the run's samples were clear_page_erms in tw-reap, and it decoded at 9.7 tok/s
// against 16.2 at 25 %, whose smaller cache had filled during the prompt (docs/results.md). So the empty slots'
// pages are faulted in here, in the background from the start, off the read path. A slot that is read into
// meanwhile faults its own pages (populating never writes a present page); one given away on loan meanwhile is
// given back again, so a loan still frees its memory.
void StreamCore::populate_loop() {
  name_thread("tw-populate");
  // Idle CPU only: at a 40 % cap on mm-bench (2 cores, one compute thread) the faulting took 72 ms of CPU a token
  // beside the decode's 75 and halved its speed (9.65 against 17.25 tok/s at 25 %, whose smaller cache was filled
  // sooner). A slot it has not reached is faulted in by its first read, as before this thread.
  sched_param idle{};
  pthread_setschedparam(pthread_self(), SCHED_IDLE, &idle);
#ifdef MADV_POPULATE_WRITE
  for (Layer& L : layers_) {
    for (int s = 0; s < L.geo.n_slots; ++s) {
      std::uint8_t* at = L.memory + static_cast<std::size_t>(s) * L.geo.record_size;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stop_) return;
        if (L.slots[static_cast<std::size_t>(s)]->meta.state != SlotState::Empty) continue;
      }
      if (madvise(at, L.geo.record_size, MADV_POPULATE_WRITE) != 0) return;  // (a kernel before 5.14: as before)
      std::lock_guard<std::mutex> lock(mu_);
      if (L.slots[static_cast<std::size_t>(s)]->meta.state == SlotState::Loaned)
        madvise(at, L.geo.record_size, MADV_DONTNEED);
    }
  }
#endif
}

// After a quiet spell, fill empty slots with the most-used experts (usage table), evicting nothing.
void StreamCore::idle_loop() {
  name_thread("tw-idle");
  std::unique_lock<std::mutex> lock(mu_);
  auto idle = std::chrono::milliseconds(cfg_.idle_fill_ms);
  while (!stop_) {
    if (filled_) {
      idle_cv_.wait_for(lock, idle);
      continue;
    }
    auto due = last_activity_ + idle;
    if (Clock::now() < due) {
      idle_cv_.wait_until(lock, due);
      continue;
    }
    filled_ = true;
    bool added = false;
    for (int li = 0; li < n_layers(); ++li) {
      Layer& L = layers_[static_cast<std::size_t>(li)];
      int empty = 0;
      for (auto& s : L.slots) empty += s->meta.state == SlotState::Empty;
      int rank = 0;
      for (int e : L.usage) {
        if (empty == 0) break;
        if (L.expert_slot[static_cast<std::size_t>(e)] >= 0) continue;
        if (std::any_of(waiting_.begin(), waiting_.end(),
                        [&](const Prediction& p) { return p.li == li && p.expert == e; }))
          continue;
        waiting_.push_back(Prediction{li, e, 1 << 20, rank++, pred_seq_++, true, 0.0, 1, 0, 0});
        --empty;
        added = true;
      }
    }
    if (added) {
      if (ring_) {
        pump();
      } else {
        io_cv_.notify_all();
      }
    }
  }
}

// --------------------------------------------------------------------------------------- loans, stats

std::uint64_t StreamCore::loan(std::uint64_t bytes, int keep_per_layer) {
  std::lock_guard<std::mutex> lock(mu_);
  std::uint64_t freed = 0;
  auto give = [&](Layer& L, int s) {
    Slot& sl = *L.slots[static_cast<std::size_t>(s)];
    evict(L, s);
    sl.meta.state = SlotState::Loaned;
    madvise(L.memory + static_cast<std::size_t>(s) * L.geo.record_size, L.geo.record_size, MADV_DONTNEED);
    freed += L.geo.record_size;
  };
  auto kept = [&](const Layer& L) {
    int n = 0;
    for (auto& s : L.slots) n += s->meta.state != SlotState::Loaned;
    return n;
  };
  // Empty slots first, then the coldest ready ones across all layers.
  for (Layer& L : layers_)
    for (int s = 0; s < L.geo.n_slots && freed < bytes; ++s)
      if (L.slots[static_cast<std::size_t>(s)]->meta.state == SlotState::Empty && kept(L) > keep_per_layer)
        give(L, s);
  while (freed < bytes) {
    int best_l = -1, best_s = -1;
    double best_v = 0;
    std::uint64_t best_use = 0;
    for (int li = 0; li < n_layers(); ++li) {
      Layer& L = layers_[static_cast<std::size_t>(li)];
      if (kept(L) <= keep_per_layer) continue;
      for (int s = 0; s < L.geo.n_slots; ++s) {
        const SlotMeta& m = L.slots[static_cast<std::size_t>(s)]->meta;
        if (m.state != SlotState::Ready || m.pins > 0) continue;
        double v = keep_value(m, clock_);
        if (best_l < 0 || v < best_v || (v == best_v && m.last_use < best_use)) {
          best_l = li, best_s = s, best_v = v, best_use = m.last_use;
        }
      }
    }
    if (best_l < 0) break;
    give(layers_[static_cast<std::size_t>(best_l)], best_s);
  }
  return freed;
}

void StreamCore::unloan() {
  std::unique_lock<std::mutex> lock(mu_);
  for (int li = 0; li < n_layers(); ++li) {
    for (auto& s : layers_[static_cast<std::size_t>(li)].slots)
      if (s->meta.state == SlotState::Loaned) s->meta = SlotMeta{};
    assign_pending(li);
  }
  touch();
  kick(lock);
}

std::uint64_t StreamCore::loaned_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::uint64_t n = 0;
  for (const Layer& L : layers_)
    for (auto& s : L.slots) n += s->meta.state == SlotState::Loaned ? L.geo.record_size : 0;
  return n;
}

int StreamCore::usable_slots(int li) const {
  std::lock_guard<std::mutex> lock(mu_);
  int n = 0;
  for (auto& s : layer(li).slots) n += s->meta.state != SlotState::Loaned;
  return n;
}

void StreamCore::set_usage(int li, const std::vector<int>& ranked_experts) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (int e : ranked_experts) check_expert(e);
    layer(li).usage = ranked_experts;
    filled_ = false;  // a new table: fill again at the next quiet spell
  }
  idle_cv_.notify_all();
}

std::vector<std::uint64_t> StreamCore::counters() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::uint64_t> out;
  out.reserve(layers_.size() * kNumCounters);
  for (const Layer& L : layers_) out.insert(out.end(), L.count.begin(), L.count.end());
  return out;
}

std::array<std::uint64_t, 5> StreamCore::queue_depths() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {demand_q_.size(), prefetch_q_.size(), waiting_.size(), static_cast<std::uint64_t>(demand_busy_),
          static_cast<std::uint64_t>(prefetch_busy_)};
}

void StreamCore::hold_io_after(std::int64_t chunks) {
  std::unique_lock<std::mutex> lock(mu_);
  io_allowance_ = chunks < 0 ? -1 : chunks;
  kick(lock);
}

std::array<std::uint64_t, 3> StreamCore::scheduler_marks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return marks_;
}

std::vector<std::int64_t> StreamCore::take_demand_latencies() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::int64_t> out;
  out.swap(latencies_);
  return out;
}

std::vector<int> StreamCore::resident_experts(int li) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int> out;
  for (auto& s : layer(li).slots) out.push_back(s->meta.state == SlotState::Ready ? s->meta.expert : -1);
  return out;
}

}  // namespace tw
