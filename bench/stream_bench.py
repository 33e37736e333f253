"""Streaming-core benchmarks on a repacked model file (results go to docs/results.md).

    python bench/stream_bench.py [--model models/bench/bench-q4_0.tw.gguf] [--quick] [--only io,policy,...]

1. Raw drive: direct-read bandwidth with 512 KiB and whole-expert requests at 1…16 threads (fio-style, the
   same DirectFile reads the core uses, random aligned offsets over the whole file).
2. Scheduler throughput on a demand-heavy replay: every layer's top-k are demand reads (tiny cache), all
   layers of a token issued before waiting; compared with the best raw bandwidth measured in the same run.
3. Demand latency (issue → ready) p50/p99 with and without a full prefetch queue.
4. Policy: misses of decay, history and LRU against Belady on synthetic Zipf-skewed, temporally local traces, with
   a rule that knows how the trace was generated (it evicts the expert least likely to be selected next), and
   reads with the lookahead's predictions (votes 1 and 2).
5. I/O engines (threads, io_uring): the CPU time the reads cost (the core's threads and the caller) per MB and
   the context switches per read, on a decode-like replay: both depend little on the machine's load.
Runs are interleaved where they are compared; the drive varies up to 2× between runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from memcap import evict_from_page_cache

from tokenwing import _core
from tokenwing.format.reader import ModelFile
from tokenwing.streaming.replay import replay
from tokenwing.streaming.settings import StreamSettings
from tokenwing.streaming.streamer import COUNTERS, ExpertStreamer
from tokenwing.streaming.trace import Trace, simulate, synthetic_trace

sys.path.insert(0, os.path.dirname(__file__))
from limits import switches, thread_cpu

MB = 1e6


def raw_drive(path: str, record: int, total: int) -> dict[tuple[str, int], float]:
    print("\n### Raw drive: random direct reads\n")
    print("| request | " + " | ".join(f"{t} thr" for t in (1, 2, 4, 8, 16)) + " |")
    print("|---|" + "---|" * 5)
    out: dict[tuple[str, int], float] = {}
    for label, block in (("512 KiB", 512 * 1024), (f"expert {record // 1024} KiB", record)):
        row = []
        for threads in (1, 2, 4, 8, 16):
            secs, nbytes, _ = _core.read_benchmark(path, block, threads, total, seed=threads)
            out[(label, threads)] = nbytes / secs
            row.append(f"{nbytes / secs / MB:.0f} MB/s")
        print(f"| {label} | " + " | ".join(row) + " |")
    return out


def demand_replay(mf: ModelFile, tokens: int, io_threads: int, seed: int) -> tuple[float, float]:
    """Returns (bytes/s, SSD wait per token in ms) for a replay where nearly every expert misses."""
    k = mf.index.n_used
    rng = np.random.default_rng(seed)
    settings = StreamSettings(io_threads=io_threads, idle_fill_ms=-1)
    with ExpertStreamer(mf, k, settings) as s:
        layers = [el.layer for el in mf.index.layers]
        t0 = time.perf_counter()
        for _ in range(tokens):
            s.begin_token()
            sel = {layer: rng.choice(mf.index.n_expert, k, replace=False).tolist() for layer in layers}
            for layer in layers:
                s.begin_layer(layer, sel[layer])
            for layer in layers:
                for e in sel[layer]:
                    s.wait(layer, e)
        secs = time.perf_counter() - t0
        c = dict(zip(COUNTERS, s.counters().sum(axis=0), strict=True))
    return c["bytes_read"] / secs, c["wait_ns"] / 1e6 / tokens


def demand_latency(mf: ModelFile, samples: int, loaded: bool, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    layers = [el.layer for el in mf.index.layers]
    target = layers[0]
    with ExpertStreamer(mf, mf.index.n_used, StreamSettings(idle_fill_ms=-1)) as s:
        stop = threading.Event()

        def load() -> None:  # keep the prediction list full for the other layers
            r = np.random.default_rng(seed + 1)
            while not stop.is_set():
                s.begin_token()
                for layer in layers[1:]:
                    s.predict(layer, r.choice(mf.index.n_expert, mf.index.n_used, replace=False).tolist(), 1)
                time.sleep(0.02)

        loader = threading.Thread(target=load)
        if loaded:
            loader.start()
            time.sleep(0.2)
        depth = []
        for _ in range(samples):
            e = int(rng.integers(mf.index.n_expert))
            s.begin_layer(target, [e])
            depth.append(sum(s.core.queue_depths()[1:3]))
            s.wait(target, e)
            time.sleep(0.002)
        stop.set()
        if loaded:
            loader.join()
        lat = s.core.take_demand_latencies()
    print(
        f"    ({'with' if loaded else 'without'} prefetch load: mean prefetch backlog at issue "
        f"{np.mean(depth):.1f} chunks+predictions, {len(lat)} demand reads)"
    )
    return lat


def policy_table(quick: bool) -> None:
    print("\n### Policy on synthetic traces (12 layers, 128 experts, top-8; `tokenwing trace simulate`)\n")
    print(
        "| trace | cache | decay | history | LRU | Belady | decay / B | history / B | knows the generator / B "
        "| reads / B: history + prefetch, 1 vote | 2 votes |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    n = 500 if quick else 2000
    for zipf, loc in ((0.8, 0.2), (1.0, 0.3), (1.2, 0.4)):
        t, pop = synthetic_trace(n, 12, 128, 8, zipf=zipf, locality=loc, seed=7), _popularity(n, zipf, loc)
        for frac in (0.25, 0.40):
            slots = round(128 * frac)
            m = {p: simulate(t, slots, p)["misses"] for p in ("decay", "history", "lru", "belady")}
            bound = oracle_misses(t, slots, pop, loc)
            b = m["belady"]
            v1, v2 = (simulate(t, slots, "history", prefetch=True, prefetch_votes=v)["reads"] for v in (1, 2))
            print(
                f"| zipf {zipf}, locality {loc} | {frac:.0%} | {m['decay']} | {m['history']} | {m['lru']} | {b} | "
                f"{m['decay'] / b:.2f} | {m['history'] / b:.2f} | {bound / b:.2f} | {v1 / b:.2f} | {v2 / b:.2f} |"
            )


def _popularity(n: int, zipf: float, loc: float) -> list[np.ndarray]:
    """The generator's per-layer popularity for `synthetic_trace(n, 12, 128, 8, zipf, loc, seed=7)` (its first
    draws from the same seed)."""
    rng = np.random.default_rng(7)
    out = []
    for _ in range(12):
        w = 1.0 / np.arange(1, 129) ** zipf
        out.append(rng.permutation(w / w.sum()))
    return out


def oracle_misses(t: Trace, slots: int, pop: list[np.ndarray], loc: float) -> int:
    """An eviction rule that knows how the synthetic trace was made: it evicts the expert least likely to be
    selected by the next token (kept from the last one with probability `loc`, else drawn by popularity). It is
    not an exact bound (a greedy rule; a lucky one can beat it on a sample) but shows how far knowing the
    generator gets an eviction rule without hindsight: what Belady gains beyond it needs the future."""
    k = t.k
    misses = 0
    for li in range(t.selected.shape[1]):
        p = np.minimum(1.0, k * (1 - loc) * pop[li])
        resident: set[int] = set()
        prev: set[int] = set()
        for row in t.selected[:, li]:
            cur = [int(e) for e in row if e >= 0]
            for e in cur:
                if e in resident:
                    continue
                misses += 1
                if len(resident) >= slots:
                    pool = [r for r in resident if r not in cur]
                    score = [(loc + (1 - loc) * p[r]) if r in prev else p[r] for r in pool]
                    resident.remove(pool[int(np.argmin(score))])
                resident.add(e)
            prev = set(cur)
    return misses


def io_engines(mf: ModelFile, tokens: int, rounds: int) -> None:
    """CPU per MB and context switches per read of each I/O engine on the same decode-like replay: a synthetic
    trace at 25 % of the experts with its two-distance predictions (votes 1: every prediction read)."""
    print("\n### I/O engines: CPU and wake-ups per read (decode-like replay, 25 % of the experts, lookahead 2)\n")
    print("| round | engine | MB read | CPU ms per 100 MB: I/O threads | caller | switches per read: I/O | caller |")
    print("|---|---|---|---|---|---|---|")
    idx = mf.index
    trace = synthetic_trace(tokens, len(idx.layers), idx.n_expert, idx.n_used, seed=3)
    slots = max(idx.n_used, idx.n_expert // 4)
    mine = ("tw-io", "tw-reap", "iou-")  # (iou-wrk: the kernel's io_uring workers, where it needs them)
    for rnd in range(rounds):
        for engine in ("threads", "io_uring"):
            settings = StreamSettings(io_engine=engine, idle_fill_ms=-1, prefetch_votes=1)
            cpu0, sw0, c0 = thread_cpu(), switches(), time.thread_time()
            after: list[dict[str, float]] = []
            r = replay(mf, slots, settings, trace, before_close=lambda: after.extend((thread_cpu(), switches())))  # noqa: B023
            caller = time.thread_time() - c0
            cpu1, sw1 = after
            io = sum(cpu1.get(k, 0) - cpu0.get(k, 0) for k in cpu1 if k.startswith(mine))
            io_sw = sum(sw1.get(k, 0) - sw0.get(k, 0) for k in sw1 if k.startswith(mine))
            main_sw = sw1.get("main", 0) - sw0.get("main", 0)
            mb = r.bytes_read / MB
            print(
                f"| {rnd + 1} | {r.io_engine} | {mb:.0f} | {io * 1e3 / mb * 100:.1f} | {caller * 1e3 / mb * 100:.1f} | "
                f"{io_sw / max(r.reads, 1):.2f} | {main_sw / max(r.reads, 1):.2f} |"
            )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/bench/bench-q4_0.tw.gguf")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated sections: drive,scheduler,latency,policy,io")
    args = ap.parse_args()
    only = set(filter(None, args.only.split(",")))
    if only == {"policy"}:
        policy_table(args.quick)
        return 0
    if not os.path.exists(args.model):
        print(f"{args.model} missing: run `python bench/repack_bench.py` first", file=sys.stderr)
        return 1
    evict_from_page_cache(args.model)
    with ModelFile.open(args.model) as mf:
        record = mf.index.layers[0].record_size
        print(
            f"model {args.model}: {len(mf.index.layers)} streamed layers, {mf.index.n_expert} experts of "
            f"{record / 1024:.0f} KiB, top-{mf.index.n_used}; direct reads: {mf.direct}"
        )
        if only == {"io"}:
            io_engines(mf, 20 if args.quick else 100, 3)
            return 0
        total = (256 if args.quick else 1024) << 20
        raw = raw_drive(args.model, record, total)
        best_raw = max(raw.values())
        best_label = max(raw, key=lambda key: raw[key])

        print("\n### Scheduler throughput, demand-heavy replay (interleaved with raw whole-expert reads)\n")
        print("| round | raw expert reads, 8 thr | scheduler, 8 I/O threads | ratio | SSD wait per token |")
        print("|---|---|---|---|---|")
        tokens = 20 if args.quick else 60
        ratios = []
        for r in range(3):
            secs, nbytes, _ = _core.read_benchmark(args.model, record, 8, total, seed=100 + r)
            raw8 = nbytes / secs
            bw, wait_ms = demand_replay(mf, tokens, 8, seed=r)
            ratios.append(bw / raw8)
            print(f"| {r + 1} | {raw8 / MB:.0f} MB/s | {bw / MB:.0f} MB/s | {bw / raw8:.0%} | {wait_ms:.1f} ms |")
        print(
            f"\nmedian ratio to raw whole-expert reads at 8 threads: {np.median(ratios):.0%}; best raw in this run: "
            f"{best_raw / MB:.0f} MB/s ({best_label[0]}, {best_label[1]} threads)"
        )

        print("\n### Demand latency, issue → ready\n")
        samples = 100 if args.quick else 300
        rows = []
        for r in range(2):  # interleaved: without, with, without, with
            for loaded in (False, True):
                lat = demand_latency(mf, samples, loaded, seed=10 * r + loaded) / 1e6
                rows.append((loaded, np.percentile(lat, 50), np.percentile(lat, 99)))
        print("\n| prefetch queue | p50 | p99 |")
        print("|---|---|---|")
        for loaded, p50, p99 in rows:
            print(f"| {'full' if loaded else 'empty'} | {p50:.2f} ms | {p99:.2f} ms |")
        p99_without = np.median([p for loaded, _, p in rows if not loaded])
        p99_with = np.median([p for loaded, _, p in rows if loaded])
        print(f"\np99 with prefetch load / without: {p99_with / p99_without:.2f}")
        io_engines(mf, 20 if args.quick else 100, 3)
    policy_table(args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
