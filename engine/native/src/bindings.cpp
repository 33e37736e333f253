// Python bindings of the native core. The GIL is released around every read and every call that takes the
// core's lock, so Python threads and the I/O threads never wait on each other through it.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdio>
#include <cstring>

#include "direct_file.hpp"
#include "read_bench.hpp"
#include "simulate.hpp"
#include "stream_core.hpp"
#include "uring.hpp"

namespace nb = nanobind;
using ByteArray = nb::ndarray<std::uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Release = nb::call_guard<nb::gil_scoped_release>;

namespace {

// A fresh numpy array that owns a copy of `values`.
template <typename T>
nb::ndarray<nb::numpy, T> to_numpy(const std::vector<T>& values, std::vector<std::size_t> shape) {
  auto* data = new T[values.empty() ? 1 : values.size()];
  if (!values.empty()) std::memcpy(data, values.data(), values.size() * sizeof(T));
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<T*>(p); });
  return nb::ndarray<nb::numpy, T>(data, shape.size(), shape.data(), owner);
}

template <typename T>
std::vector<T> from_array(nb::ndarray<const T, nb::c_contig, nb::device::cpu> a) {
  return std::vector<T>(a.data(), a.data() + a.size());
}

nb::ndarray<nb::numpy, std::uint64_t> stats_array(const std::vector<tw::LayerSimStats>& st) {
  std::vector<std::uint64_t> flat;
  for (const auto& s : st)
    flat.insert(flat.end(), {s.hits, s.misses, s.demand_reads, s.prefetch_reads, s.prefetch_used,
                             s.prefetch_wasted, s.prefetch_dropped});
  return to_numpy(flat, {st.size(), 7});
}

tw::Trace make_trace(nb::ndarray<const std::int32_t, nb::ndim<3>, nb::c_contig, nb::device::cpu> selected,
                     nb::ndarray<const std::int32_t, nb::ndim<4>, nb::c_contig, nb::device::cpu> predicted,
                     nb::ndarray<const std::int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> prompt_tokens,
                     int n_expert) {
  tw::Trace t;
  t.n_tokens = static_cast<int>(selected.shape(0));
  t.n_layers = static_cast<int>(selected.shape(1));
  t.k = static_cast<int>(selected.shape(2));
  t.n_dist = static_cast<int>(predicted.shape(2));
  t.n_expert = n_expert;
  if (predicted.shape(0) != selected.shape(0) || predicted.shape(1) != selected.shape(1) ||
      (predicted.size() > 0 && predicted.shape(3) != selected.shape(2)))
    throw std::invalid_argument("predicted must be shaped (tokens, layers, distances, k)");
  t.selected.assign(selected.data(), selected.data() + selected.size());
  t.predicted.assign(predicted.data(), predicted.data() + predicted.size());
  t.prompt_tokens.assign(prompt_tokens.data(), prompt_tokens.data() + prompt_tokens.size());
  return t;
}

}  // namespace

// ggml's log callback signature: (enum ggml_log_level, const char*, void*); level 1 is GGML_LOG_LEVEL_DEBUG.
// For tests: a transform that writes the bitwise NOT of a projection to ctx (the projection's own address).
static void invert_transform(void* ctx, const void* data, std::size_t offset, std::size_t size) {
  auto* dst = static_cast<std::uint8_t*>(ctx) + offset;
  const auto* src = static_cast<const std::uint8_t*>(data);
  for (std::size_t i = 0; i < size; ++i) dst[i] = static_cast<std::uint8_t>(~src[i]);
}

static void log_filter(int level, const char* text, void* /*user*/) {
  if (level != 1 && text != nullptr) std::fputs(text, stderr);
}

NB_MODULE(_core, m) {
  m.doc() = "TokenWing native core: direct-I/O expert streaming, RAM expert cache, trace replay";
  m.attr("DIRECT_ALIGNMENT") = tw::kDirectAlignment;
  nb::exception<tw::IoError>(m, "IoError", PyExc_OSError);

  nb::class_<tw::DirectFile>(m, "DirectFile")
      .def(nb::init<const std::string&, bool>(), nb::arg("path"), nb::arg("direct") = true)
      .def_prop_ro("direct", &tw::DirectFile::direct)
      .def_prop_ro("size", &tw::DirectFile::size)
      .def_prop_ro("path", &tw::DirectFile::path)
      .def_prop_ro("fallback_reason", &tw::DirectFile::fallback_reason)
      .def(
          "read_into",
          [](const tw::DirectFile& f, std::uint64_t offset, ByteArray dst) {
            std::uint8_t* ptr = dst.data();
            std::size_t len = dst.shape(0);
            nb::gil_scoped_release release;
            f.read_exact(offset, ptr, len);
          },
          nb::arg("offset"), nb::arg("dst"),
          "Fill the whole writable uint8 array `dst` from `offset` (aligned when direct).")
      .def("close", &tw::DirectFile::close)
      .def("__enter__", [](tw::DirectFile& f) -> tw::DirectFile& { return f; }, nb::rv_policy::reference)
      .def("__exit__", [](tw::DirectFile& f, nb::args) { f.close(); });

  nb::class_<tw::LayerGeometry>(m, "LayerGeometry")
      .def(nb::init<>())
      .def_rw("offset", &tw::LayerGeometry::offset)
      .def_rw("record_size", &tw::LayerGeometry::record_size)
      .def_rw("proj_offset", &tw::LayerGeometry::proj_offset)
      .def_rw("proj_size", &tw::LayerGeometry::proj_size)
      .def_rw("n_slots", &tw::LayerGeometry::n_slots);

  nb::class_<tw::StreamConfig>(m, "StreamConfig")
      .def(nb::init<>())
      .def_rw("io_threads", &tw::StreamConfig::io_threads)
      .def_rw("chunk_bytes", &tw::StreamConfig::chunk_bytes)
      .def_rw("prefetch_cap_busy", &tw::StreamConfig::prefetch_cap_busy)
      .def_rw("prefetch_cap_idle", &tw::StreamConfig::prefetch_cap_idle)
      .def_rw("decay_tokens", &tw::StreamConfig::decay_tokens)
      .def_rw("idle_fill_ms", &tw::StreamConfig::idle_fill_ms)
      .def_rw("direct", &tw::StreamConfig::direct)
      .def_rw("split_demand", &tw::StreamConfig::split_demand)
      .def_rw("skip_late", &tw::StreamConfig::skip_late)
      .def_rw("prefetch_votes", &tw::StreamConfig::prefetch_votes)
      .def_rw("learned", &tw::StreamConfig::learned)
      .def_prop_rw(
          "policy", [](const tw::StreamConfig& c) { return std::string(tw::policy_name(c.policy)); },
          [](tw::StreamConfig& c, const std::string& p) { c.policy = tw::parse_policy(p); })
      .def_prop_rw(
          "io_engine",
          [](const tw::StreamConfig& c) { return c.io_engine == tw::IoEngine::Uring ? "io_uring" : "threads"; },
          [](tw::StreamConfig& c, const std::string& e) {
            if (e != "threads" && e != "io_uring") throw std::invalid_argument("io engine must be threads or io_uring");
            c.io_engine = e == "io_uring" ? tw::IoEngine::Uring : tw::IoEngine::Threads;
          });

  std::vector<std::string> names;
  for (int c = 0; c < tw::kNumCounters; ++c) names.emplace_back(tw::counter_name(c));
  m.attr("COUNTERS") = names;
  m.attr("SIM_COLUMNS") = std::vector<std::string>{"hits", "misses", "demand_reads", "prefetch_reads",
                                                   "prefetch_used", "prefetch_wasted", "prefetch_dropped"};

  nb::class_<tw::StreamCore>(m, "StreamCore")
      .def(nb::init<const std::string&, int, std::vector<tw::LayerGeometry>, tw::StreamConfig>(), nb::arg("path"),
           nb::arg("n_expert"), nb::arg("layers"), nb::arg("config"), Release())
      .def_prop_ro("direct", &tw::StreamCore::direct)
      .def_prop_ro("fallback_reason", &tw::StreamCore::fallback_reason)
      .def_prop_ro("io_engine", [](const tw::StreamCore& c) { return std::string(c.io_engine()); })
      .def_prop_ro("io_fallback_reason", &tw::StreamCore::io_fallback_reason)
      .def("estimates", &tw::StreamCore::estimates, Release(),
           "(read throughput while reads were in flight in bytes/s, decode layer interval in ns); 0 until measured")
      .def_prop_ro("n_layers", &tw::StreamCore::n_layers)
      .def_prop_ro("n_expert", &tw::StreamCore::n_expert)
      .def("n_slots", &tw::StreamCore::n_slots)
      .def(
          "slot_array",
          [](nb::handle self, int li) {
            auto& core = nb::cast<tw::StreamCore&>(self);
            std::size_t shape[2] = {static_cast<std::size_t>(core.n_slots(li)),
                                    static_cast<std::size_t>(core.record_size(li))};
            return nb::ndarray<nb::numpy, std::uint8_t, nb::ndim<2>>(core.slot_memory(li), 2, shape, self);
          },
          nb::arg("layer"), "The layer's slot pool as a (slots, record_size) uint8 view (no copy).")
      .def("begin_token", &tw::StreamCore::begin_token, nb::arg("prompt_tokens") = 0, Release())
      .def("begin_layer", &tw::StreamCore::begin_layer, nb::arg("layer"), nb::arg("experts"),
           nb::arg("keep") = std::vector<int>{}, Release())
      .def("holding", &tw::StreamCore::holding, nb::arg("layer"), nb::arg("experts"), Release())
      .def("end_layer", &tw::StreamCore::end_layer, nb::arg("layer"), Release())
      .def("predict", &tw::StreamCore::predict, nb::arg("layer"), nb::arg("experts"), nb::arg("distance"),
           nb::arg("probs") = std::vector<double>{}, nb::arg("max_votes") = 0, Release())
      .def("read_known", &tw::StreamCore::read_known, nb::arg("layer"), nb::arg("experts"), Release(),
           "Experts certain to be selected when the layer runs in this token: read now as demand reads, in call "
           "order, ahead of every prediction.")
      .def("ready", &tw::StreamCore::ready, nb::arg("layer"), nb::arg("experts"), Release())
      .def("wait", &tw::StreamCore::wait, nb::arg("layer"), nb::arg("expert"), nb::arg("proj") = -1, Release())
      .def("wait_all", &tw::StreamCore::wait_all, nb::arg("layer"), nb::arg("experts"), Release())
      .def("loan", &tw::StreamCore::loan, nb::arg("bytes"), nb::arg("keep_per_layer"), Release())
      .def("unloan", &tw::StreamCore::unloan, Release())
      .def_prop_ro("loaned_bytes", &tw::StreamCore::loaned_bytes)
      .def("usable_slots", &tw::StreamCore::usable_slots, nb::arg("layer"), Release())
      .def("set_usage", &tw::StreamCore::set_usage, nb::arg("layer"), nb::arg("ranked_experts"), Release())
      .def(
          "set_transform",
          [](tw::StreamCore& c, int li, int proj, std::uintptr_t fn, const std::vector<std::uintptr_t>& ctx) {
            std::vector<void*> ptrs;
            for (std::uintptr_t p : ctx) ptrs.push_back(reinterpret_cast<void*>(p));
            c.set_transform(li, proj, reinterpret_cast<tw::StreamCore::TransformFn>(fn), std::move(ptrs));
          },
          nb::arg("layer"), nb::arg("proj"), nb::arg("fn"), nb::arg("ctx"),
          "After a projection lands: fn(ctx[slot], plain bytes, 0, size) rewrites it in place (addresses).")
      .def("counters",
           [](const tw::StreamCore& c) {
             return to_numpy(c.counters(), {static_cast<std::size_t>(c.n_layers()),
                                            static_cast<std::size_t>(tw::kNumCounters)});
           })
      .def("queue_depths", &tw::StreamCore::queue_depths, Release())
      .def("take_demand_latencies",
           [](tw::StreamCore& c) {
             auto v = c.take_demand_latencies();
             return to_numpy(v, {v.size()});
           })
      .def("scheduler_marks", &tw::StreamCore::scheduler_marks, Release())
      .def("resident_experts", &tw::StreamCore::resident_experts, nb::arg("layer"))
      .def("hold_io_after", &tw::StreamCore::hold_io_after, nb::arg("chunks"),
           "Test-only: the I/O threads start this many more reads, then none until called with -1.")
      .def(
          "start_other",
          [](tw::StreamCore& c, const tw::DirectFile& f, std::uint64_t offset, ByteArray dst, std::uint64_t chunk) {
            std::uint8_t* ptr = dst.data();
            std::size_t len = dst.shape(0);
            nb::gil_scoped_release release;
            return c.start_other(f, offset, ptr, len, chunk);
          },
          nb::arg("file"), nb::arg("offset"), nb::arg("dst"), nb::arg("chunk"),
          "Reads another file's bytes at `offset` into the whole uint8 array `dst` through the core's readers, "
          "behind every expert read, in `chunk` requests: returns a job for wait_other (keep `file` and `dst` "
          "until then).")
      .def("wait_other", &tw::StreamCore::wait_other, nb::arg("job"), Release(),
           "Blocks until start_other's reads have landed; raises IoError (an OSError) if one failed.")
      .def("other_depths", &tw::StreamCore::other_depths, Release(),
           "(bytes of start_other's reads not yet started, those reads in service)")
      .def("close", &tw::StreamCore::close, Release());

  m.def(
      "invert_transform", [] { return reinterpret_cast<std::uintptr_t>(&invert_transform); },
      "For tests: address of a transform that writes the bitwise NOT of each projection in place.");

  m.def(
      "ggml_log_filter",
      [] { return reinterpret_cast<std::uintptr_t>(&log_filter); },
      "Address of a ggml log callback that drops debug messages (they come from I/O threads too).");

  m.def(
      "simulate",
      [](nb::ndarray<const std::int32_t, nb::ndim<3>, nb::c_contig, nb::device::cpu> selected,
         nb::ndarray<const std::int32_t, nb::ndim<4>, nb::c_contig, nb::device::cpu> predicted,
         nb::ndarray<const std::int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> prompt_tokens, int n_expert,
         int n_slots, const std::string& policy, bool prefetch, std::uint64_t decay_tokens,
         std::optional<nb::ndarray<const std::int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>> initial,
         int prefetch_votes, std::vector<double> learned) {
        tw::Trace t = make_trace(selected, predicted, prompt_tokens, n_expert);
        std::vector<std::int32_t> warm;
        int width = 0;
        if (initial) {
          if (initial->shape(0) != static_cast<std::size_t>(t.n_layers))
            throw std::invalid_argument("the initial cache needs one row per layer");
          warm.assign(initial->data(), initial->data() + initial->size());
          width = static_cast<int>(initial->shape(1));
        }
        std::vector<tw::LayerSimStats> st;
        {
          nb::gil_scoped_release release;
          if (policy == "belady") {
            st = tw::simulate_belady(t, n_slots, warm, width);
          } else {
            tw::SimConfig c;
            c.n_slots = n_slots;
            c.policy = tw::parse_policy(policy);
            c.prefetch = prefetch;
            c.decay_tokens = decay_tokens;
            c.prefetch_votes = prefetch_votes;
            c.initial = warm;
            c.initial_width = width;
            c.learned = std::move(learned);
            st = tw::simulate_policy(t, c);
          }
        }
        return stats_array(st);
      },
      nb::arg("selected"), nb::arg("predicted"), nb::arg("prompt_tokens"), nb::arg("n_expert"), nb::arg("n_slots"),
      nb::arg("policy"), nb::arg("prefetch") = false, nb::arg("decay_tokens") = 64, nb::arg("initial") = nb::none(),
      nb::arg("prefetch_votes") = 1, nb::arg("learned") = std::vector<double>{},
      "Replays a routing trace (from `initial`, [layers, width] experts in the cache at the start, -1 empty); "
      "returns per-layer (hits, misses, demand_reads, prefetch_reads, prefetch_used, prefetch_wasted, "
      "prefetch_dropped).");

  auto bench_result = [](const tw::ReadBenchResult& r) {
    return nb::make_tuple(r.seconds, r.bytes, to_numpy(r.latencies_ns, {r.latencies_ns.size()}));
  };
  m.def(
      "read_benchmark",
      [bench_result](const std::string& path, std::uint64_t block, int threads, std::uint64_t total,
                     std::uint64_t seed, bool direct) {
        tw::ReadBenchResult r;
        {
          nb::gil_scoped_release release;
          r = tw::read_benchmark(path, block, threads, total, seed, direct);
        }
        return bench_result(r);
      },
      nb::arg("path"), nb::arg("block"), nb::arg("threads"), nb::arg("total"), nb::arg("seed") = 0,
      nb::arg("direct") = true, "Random direct reads: returns (seconds, bytes, per-read latencies in ns).");

  m.def(
      "read_benchmark_uring",
      [bench_result](const std::string& path, std::uint64_t block, int depth, std::uint64_t total,
                     std::uint64_t seed, bool direct) {
        tw::ReadBenchResult r;
        {
          nb::gil_scoped_release release;
          r = tw::read_benchmark_uring(path, block, depth, total, seed, direct);
        }
        return bench_result(r);
      },
      nb::arg("path"), nb::arg("block"), nb::arg("depth"), nb::arg("total"), nb::arg("seed") = 0,
      nb::arg("direct") = true,
      "Random direct reads, `depth` in flight through one io_uring: (seconds, bytes, per-read latencies in ns).");

  m.def(
      "uring_available",
      [] {
        std::string why;
        bool ok = tw::uring_available(&why);
        return nb::make_tuple(ok, why);
      },
      "(whether io_uring works here, why not)");

  m.def("memory_read_bandwidth", &tw::memory_read_bandwidth, nb::arg("bytes"), nb::arg("threads"),
        nb::arg("passes") = 3, Release(),
        "STREAM-style: bytes per second that `threads` threads read from a `bytes` buffer (best pass).");
}
