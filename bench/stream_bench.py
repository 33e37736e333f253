"""Streaming-core benchmarks on a repacked model file (results go to docs/results.md).

    python bench/stream_bench.py [--model models/bench/bench-q4_0.tw.gguf] [--quick]

1. Raw drive: direct-read bandwidth with 512 KiB and whole-expert requests at 1…16 threads (fio-style, the
   same DirectFile reads the core uses, random aligned offsets over the whole file).
2. Scheduler throughput on a demand-heavy replay: every layer's top-k are demand reads (tiny cache), all
   layers of a token issued before waiting; compared with the best raw bandwidth measured in the same run.
3. Demand latency (issue → ready) p50/p99 with and without a full prefetch queue.
4. Policy: misses of decay vs LRU vs Belady on synthetic Zipf-skewed, temporally local traces.
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
from tokenwing.streaming.settings import StreamSettings
from tokenwing.streaming.streamer import COUNTERS, ExpertStreamer
from tokenwing.streaming.trace import simulate, synthetic_trace

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
    print("| trace | cache | decay | LRU | Belady | decay / Belady | LRU / Belady |")
    print("|---|---|---|---|---|---|---|")
    n = 500 if quick else 2000
    for zipf, loc in ((0.8, 0.2), (1.0, 0.3), (1.2, 0.4)):
        t = synthetic_trace(n, 12, 128, 8, zipf=zipf, locality=loc, seed=7)
        for frac in (0.25, 0.40):
            slots = round(128 * frac)
            m = {p: simulate(t, slots, p)["misses"] for p in ("decay", "lru", "belady")}
            print(
                f"| zipf {zipf}, locality {loc} | {frac:.0%} | {m['decay']} | {m['lru']} | {m['belady']} | "
                f"{m['decay'] / m['belady']:.2f} | {m['lru'] / m['belady']:.2f} |"
            )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/bench/bench-q4_0.tw.gguf")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
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
    policy_table(args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
