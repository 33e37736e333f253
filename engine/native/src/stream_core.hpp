// The streaming core: direct reads of routed experts into per-layer RAM slot pools, with a demand queue
// that always goes first, chunked prefetches bound to slots late, cancel and promote at layer start,
// per-projection ready flags, decay eviction, slots on loan, idle fill and counters.
//
// Threading: one mutex guards all scheduling state; I/O threads take work under it and read without it.
// A slot's memory is only written by reads of its current assignment, and a slot is never reassigned while
// a read into it is in flight.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "cache_policy.hpp"
#include "direct_file.hpp"
#include "uring.hpp"

namespace tw {

struct LayerGeometry {
  std::uint64_t offset = 0;       // absolute file offset of expert 0's record
  std::uint64_t record_size = 0;  // bytes per expert record (multiple of 4096)
  std::array<std::uint64_t, 3> proj_offset{};  // gate, up, down inside the record
  std::array<std::uint64_t, 3> proj_size{};
  int n_slots = 0;
};

// How reads reach the drive: a blocking pread per I/O thread, or one io_uring fed by whoever holds the lock
// (a caller queuing work submits it in its own system call) with one reaper thread for completions.
enum class IoEngine : std::uint8_t { Threads, Uring };

struct StreamConfig {
  int io_threads = 8;  // I/O threads (Threads), or reads in flight (Uring)
  std::uint64_t chunk_bytes = 512 * 1024;
  int prefetch_cap_busy = 2;  // prefetch chunks in service while a demand read is
  int prefetch_cap_idle = 4;  // ... and while none is
  std::uint64_t decay_tokens = 256;
  int idle_fill_ms = 500;     // < 0: off
  bool direct = true;
  Policy policy = Policy::History;
  IoEngine io_engine = IoEngine::Uring;
  bool split_demand = false;  // a demand read as two requests: gate+up first, then down (compute starts sooner)
  bool skip_late = false;     // a prediction whose read cannot land before its layer starts is not read
  // A prediction is read once this many of the token's predictions for its layer (at different distances)
  // name it: 2 waits for the nearer router to confirm the farther one (fewer wasted reads, less lead).
  int prefetch_votes = 2;
  std::vector<double> learned;  // the learned policy's model, flat (parse_learned)
};

enum Counter : int {
  kHits,
  kMisses,
  kDemandReads,
  kPrefetchIssued,
  kPrefetchUsed,
  kPrefetchWasted,
  kPrefetchCancelled,
  kPrefetchPromoted,
  kPrefetchDropped,
  kIdleFills,
  kBytesRead,
  kWaitNs,
  kReadErrors,
  kPrefetchLate,  // predictions not read: they could not land before their layer (skip_late)
  kDemandPredicted,  // demand reads of an expert a prediction named whose read had not started yet
  kKnownReads,       // reads issued by read_known (experts certain before their layer runs)
  kKnownLate,        // known experts still on their way when their layer began (the layer waits on them)
  kKnownWaitNs,      // the part of kWaitNs spent waiting on known reads
  kNumCounters
};
const char* counter_name(int c);

class StreamCore {
 public:
  StreamCore(const std::string& path, int n_expert, std::vector<LayerGeometry> layers, StreamConfig config);
  ~StreamCore();
  StreamCore(const StreamCore&) = delete;
  StreamCore& operator=(const StreamCore&) = delete;

  bool direct() const { return file_.direct(); }
  const std::string& fallback_reason() const { return file_.fallback_reason(); }
  int n_layers() const { return static_cast<int>(layers_.size()); }
  int n_expert() const { return n_expert_; }
  int n_slots(int li) const;
  std::uint64_t record_size(int li) const;
  std::uint8_t* slot_memory(int li) const;

  // A decode token (prompt_tokens == 0) or a prompt batch of prompt_tokens tokens (LRU, ages the values).
  void begin_token(std::uint64_t prompt_tokens);
  // Layer li starts with these selected experts: drops its unselected predictions, promotes selected
  // prefetches, issues demand reads. Returns whether each expert is ready now (hits: compute them first).
  // `keep`: experts a later wave of this layer needs, left where they are (pinned, not counted as used).
  std::vector<bool> begin_layer(int li, const std::vector<int>& experts, const std::vector<int>& keep = {});
  void end_layer(int li);
  // Predictions for a later layer (distance 1, 2, ...), in rank order, with the router's probability of each
  // (optional): the waiting list is read likeliest first, then by distance and rank.
  // `max_votes`: how many distances predict this layer at all (0: unknown); the votes needed are capped by it, so
  // a layer only one earlier layer predicts is still read ahead.
  void predict(int li, const std::vector<int>& experts, int distance, const std::vector<double>& probs = {},
               int max_votes = 0);
  // Experts certain to be selected when layer li runs in this token (DeepSeek V4's hash layers: the token id
  // decides them): read now, in the demand queue (ahead of every prediction, outside the prefetch caps) in chunks,
  // in call order (call in layer order), and kept (pinned) until their layer begins.
  // At begin_layer they are hits, or counted kKnownLate (a wait on a known read), never demand reads.
  void read_known(int li, const std::vector<int>& experts);
  // Which of these experts are ready now (compute those first).
  std::vector<bool> ready(int li, const std::vector<int>& experts);
  // Which of these experts have a slot (in RAM, or on their way).
  std::vector<bool> holding(int li, const std::vector<int>& experts);
  // Blocks until the expert's projection (0 gate, 1 up, 2 down; -1 all) is ready; returns its slot.
  int wait(int li, int expert, int proj);
  // wait(li, e, -1) for each expert, in one call; returns their slots.
  std::vector<int> wait_all(int li, const std::vector<int>& experts);

  // Slots on loan: give back up to `bytes` of slot memory (empty slots first, then the coldest), keeping at
  // least `keep_per_layer` slots in every layer. Returns the bytes given back.
  std::uint64_t loan(std::uint64_t bytes, int keep_per_layer);
  void unloan();
  std::uint64_t loaned_bytes() const;
  int usable_slots(int li) const;  // slots of the layer not on loan

  void set_usage(int li, const std::vector<int>& ranked_experts);

  // After projection `proj` of an expert lands in slot s of layer li, an I/O thread calls
  // fn(ctx[s], plain_bytes, 0, size), which rewrites the slot's bytes in place (ggml's repacked layout;
  // fn has the signature of ggml_backend_tensor_set). The projection is ready only after that. Set before
  // the first read.
  using TransformFn = void (*)(void* ctx, const void* data, std::size_t offset, std::size_t size);
  void set_transform(int li, int proj, TransformFn fn, std::vector<void*> ctx);

  std::vector<std::uint64_t> counters() const;  // n_layers * kNumCounters, layer-major
  std::array<std::uint64_t, 5> queue_depths() const;  // demand queued, prefetch chunks queued, waiting
                                                      // predictions, demand in service, prefetch in service
  std::vector<std::int64_t> take_demand_latencies();  // ns from issue to ready, since the last call
  // High-water marks: prefetch chunks in service when one was started while a demand read was in service,
  // and while none was; demand reads in service. The first two never exceed the caps.
  std::array<std::uint64_t, 3> scheduler_marks() const;
  std::vector<int> resident_experts(int li) const;    // expert in each slot (-1 empty/loading)
  // The engine in use ("threads" or "io_uring") and, when io_uring was asked for but is unavailable, why.
  const char* io_engine() const { return ring_ ? "io_uring" : "threads"; }
  const std::string& io_fallback_reason() const { return io_fallback_; }
  // Estimates behind skip_late: read throughput while reads were in flight (bytes/s) and the interval between
  // two decode layers (ns); 0 until measured.
  std::array<double, 2> estimates() const;
  // Test-only: the I/O threads start `chunks` more reads, then none until called with -1 (the default), so a
  // test can look at a read that is under way however fast the drive is. One comparison per read otherwise.
  void hold_io_after(std::int64_t chunks);

  // Reads of another file (a prompt-cache snapshot: runtime/snapshot.py) through this core's readers, so they
  // share the drive with the expert reads without jumping ahead of them: `len` bytes at `offset` of `file` into
  // `dst`, in `chunk` requests taken only when no demand read, prefetch chunk or prediction may start (the caps'
  // room), at most io_threads - 1 in service (a demand read always finds a reader). Direct files need `offset`,
  // `len`, `chunk` and `dst` 4 KiB-aligned. Returns a job to pass to wait_other; `file` and `dst` must outlive it.
  std::uint64_t start_other(const DirectFile& file, std::uint64_t offset, void* dst, std::uint64_t len,
                            std::uint64_t chunk);
  // Blocks until the job's reads have all landed; throws IoError if one failed (or the core closed).
  void wait_other(std::uint64_t job);
  // Bytes of other files' reads not yet started, and their reads in service.
  std::array<std::uint64_t, 2> other_depths() const;

  void close();

 private:
  // For each expert: has it a slot, and does that slot pass `test`.
  template <typename Test>
  std::vector<bool> slot_states(int li, const std::vector<int>& experts, Test test);
  struct Slot {
    SlotMeta meta;
    std::uint32_t gen = 0;
    int inflight = 0;  // chunks being read and projections being transformed
    int queued = 0;    // chunks waiting in a queue
    bool is_prefetch = false;
    bool known = false;  // read by read_known: its layer's waits count as waits on a known read
    std::array<std::uint64_t, 3> remaining{};
    std::atomic<std::uint32_t> ready_mask{0};
    std::chrono::steady_clock::time_point issued{};
    bool timing = false;
  };
  struct Transform {
    TransformFn fn = nullptr;
    std::vector<void*> ctx;  // per slot
  };
  struct Layer {
    LayerGeometry geo;
    std::array<Transform, 3> transform{};
    std::uint8_t* memory = nullptr;
    std::vector<std::unique_ptr<Slot>> slots;
    std::vector<SlotMeta> metas;  // scratch for the policy (refreshed before each choice)
    std::vector<int> expert_slot;  // expert → slot, -1 if none
    std::deque<int> pending_demand;  // selected experts still waiting for a free slot
    std::unordered_map<int, std::string> errors;  // failed reads not yet reported to a waiter
    std::uint64_t started_token = kNoToken;
    std::vector<int> usage;
    UseHistory history;  // the history policy's counts of experts not in RAM
    std::array<std::uint64_t, kNumCounters> count{};
  };
  struct OtherJob {  // start_other's reads
    const DirectFile* file = nullptr;
    std::uint8_t* dst = nullptr;
    std::uint64_t offset = 0, len = 0, chunk = 0;
    std::uint64_t issued = 0, landed = 0;  // bytes
    int inflight = 0;
    std::string error;
  };
  struct Chunk {
    int li = 0, slot = 0;
    std::uint32_t gen = 0;
    std::uint64_t off = 0, len = 0;
    bool demand = false;
    OtherJob* other = nullptr;  // a read of another file (off: inside the job), not of an expert
  };
  struct Prediction {
    int li = 0, expert = 0, distance = 0, rank = 0;
    std::uint64_t seq = 0;
    bool fill = false;  // idle fill: only into empty slots
    double prob = 0;    // the router's probability (0: unknown)
    int votes = 1;      // how many of this token's predictions (distances) named it
    int max_votes = 0;  // how many distances predict its layer (0: unknown)
    std::int64_t deadline = 0;  // steady-clock ns when its layer is expected to start (0: unknown)
  };
  static bool before(const Prediction& a, const Prediction& b) {
    if (a.prob != b.prob) return a.prob > b.prob;
    return std::tie(a.distance, a.rank, a.seq) < std::tie(b.distance, b.rank, b.seq);
  }
  struct RingOp {
    Chunk c;
    std::uint64_t done = 0;  // bytes landed (a short read is resubmitted for the rest)
  };

  void io_loop();
  void reap_loop();
  void pump();  // io_uring: under the lock, submit what the queues and caps allow
  void kick(std::unique_lock<std::mutex>& lock);  // new work: wake an I/O thread, or pump (then unlock)
  void submit_op(int op);
  void after_read(const Chunk& c, const std::string* error, std::unique_lock<std::mutex>& lock,
                  std::vector<int>& transforms, std::vector<std::uint8_t>& staging);
  void note_waiter_slot(int li, int slot);
  bool late(const Prediction& p, const Layer& L) const;
  void idle_loop();
  void populate_loop();
  bool take_work(Chunk& out);  // take_any, within hold_io_after's allowance
  bool take_any(Chunk& out);
  void note_prefetch_start();
  bool take_other(Chunk& out);
  void complete_other(const Chunk& c, const std::string* error);
  bool bind_prediction(Chunk& out);
  // Bookkeeping of a finished read; the projections it completed that need a transform go to `transforms`.
  void complete(const Chunk& c, const std::string* error, std::vector<int>& transforms);
  void transformed(int li, int slot, int proj, std::uint32_t gen);
  void finish_if_done(Slot& sl);
  void run_transform(int li, int slot, int proj, std::vector<std::uint8_t>& staging);
  int find_slot(Layer& L, Requester who);
  void evict(Layer& L, int s);
  void start_demand(int li, int expert, int s);
  // demand: the demand queue (else the prefetch chunks'); whole: one request (or split_demand's two), else chunks
  void queue_chunks(int li, int s, bool demand, Chunk* first, bool whole);
  void assign_pending(int li);
  bool remove_prediction(int li, int expert);  // whether one was waiting
  bool layer_started(const Layer& L) const { return L.started_token == clock_.token_id; }
  void touch() { last_activity_ = std::chrono::steady_clock::now(); filled_ = false; }
  Layer& layer(int li);
  const Layer& layer(int li) const;
  void check_expert(int expert) const;

  DirectFile file_;
  int n_expert_;
  StreamConfig cfg_;
  std::vector<Layer> layers_;
  PolicyClock clock_;

  mutable std::mutex mu_;
  std::condition_variable io_cv_, ready_cv_, idle_cv_;
  std::deque<Chunk> demand_q_, prefetch_q_;
  std::vector<Prediction> waiting_;  // kept sorted: distance, rank, seq
  std::uint64_t pred_seq_ = 0;
  int demand_busy_ = 0, prefetch_busy_ = 0;
  std::int64_t io_allowance_ = -1;  // hold_io_after: reads the I/O threads may still start (-1: no limit)
  bool stop_ = false;
  bool closed_ = false;
  std::chrono::steady_clock::time_point last_activity_;
  bool filled_ = true;
  std::vector<std::int64_t> latencies_;
  std::array<std::uint64_t, 3> marks_{};
  std::vector<std::thread> threads_;
  std::thread idle_thread_;
  std::thread populate_thread_;
  // io_uring
  std::unique_ptr<Uring> ring_;
  std::string io_fallback_;
  std::vector<RingOp> ops_;
  std::vector<int> free_ops_;
  std::thread reaper_;
  // start_other's jobs by id, and those with bytes not yet issued (in start order)
  std::unordered_map<std::uint64_t, std::unique_ptr<OtherJob>> other_jobs_;
  std::deque<OtherJob*> other_q_;
  std::uint64_t other_seq_ = 0;
  int other_busy_ = 0;
  std::condition_variable other_cv_;
  // Waiters (li, expert) blocked in wait(): a read landing wakes them only if it is theirs.
  std::vector<std::pair<int, int>> waiters_;
  bool wake_waiters_ = false;
  // skip_late's estimates
  std::uint64_t bytes_done_ = 0;
  std::int64_t busy_ns_ = 0, busy_since_ = 0;
  int in_service_ = 0;
  double layer_ns_ = 0;
  std::int64_t last_begin_ns_ = 0;
  int last_begin_li_ = -1;
  std::uint64_t last_begin_token_ = kNoToken;
};

}  // namespace tw
