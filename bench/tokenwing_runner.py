"""Subprocess: TokenWing on a token stream; prints one JSON line of measurements.

usage: python tokenwing_runner.py MODEL.tw.gguf TOKENS.npy N_PROMPT LOOKAHEAD [options]
options: norepack (no repacked layouts), nohashreads (DeepSeek V4's hash layers not read at the token's start),
         hashpredict (they are, as certain predictions under the prefetch cap: the design before `read_known`),
         layergraphs (a graph per layer even with every expert in RAM),
         plainexperts (experts kept in the file's layout even when preloaded: the streamed path's kernels),
         budget=25% (a share of the experts or a size, as --ram-budget takes it; default: from the process's own
         memory limit, the benchmark's cgroup cap, as in real use), trace=PATH (the decode's routing trace and
         the cache it started from, for Belady), and any stream setting as NAME=VALUE (io_engine=io_uring,
         io_threads=1, split_demand=1, policy=lru, …: `StreamSettings`' fields).
Besides speed it reports what does not depend on the machine's load: bytes the engine read, the device's sectors
read (/proc/diskstats) and its busy share, and CPU seconds per token by thread (the core's I/O threads are named
tw-io / tw-reap), with context switches.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import fields

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from limits import DiskWatch, decode_bytes_touched, delta, switches, thread_cpu

from tokenwing.format.reader import ModelFile
from tokenwing.fsutil import parse_size
from tokenwing.models import common
from tokenwing.runtime import session as session_module
from tokenwing.runtime.experts import ExpertPools
from tokenwing.runtime.kvcache import kv_element
from tokenwing.runtime.session import Session, SessionOptions
from tokenwing.streaming.settings import StreamSettings
from tokenwing.streaming.streamer import COUNTERS
from tokenwing.testmodel.oracle import process_read_bytes


def stream_settings(args: list[str]) -> StreamSettings:
    s = StreamSettings()
    kinds = {f.name: type(getattr(s, f.name)) for f in fields(StreamSettings)}
    for arg in args:
        name, _, value = arg.partition("=")
        if name in kinds:
            kind = kinds[name]
            setattr(s, name, value not in ("0", "false", "off") if kind is bool else kind(value))
    return s


def main() -> int:
    model, tokens_path, n_prompt, lookahead = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    extra = sys.argv[5:]
    tokens = np.load(tokens_path).astype(np.int64).tolist()
    notes: list[str] = []
    t0 = time.perf_counter()
    # no usage table: a benchmark must not start from what earlier runs learnt
    repack = "norepack" not in extra
    one_graph = "layergraphs" not in extra  # layergraphs: a graph per layer even with every expert in RAM
    if "plainexperts" in extra:  # preloaded experts in the file's layout: what a streamed expert computes with
        session_module.ExpertPools = lambda sched, arena, _repack: ExpertPools(sched, arena, False)  # type: ignore[misc]
    budget = None
    trace_path = None
    for arg in extra:
        if arg.startswith("budget="):
            with ModelFile.open(model, announce_fallback=False) as mf:
                budget = parse_size(arg.removeprefix("budget="), mf.index.total_bytes)
        if arg.startswith("trace="):
            trace_path = arg.removeprefix("trace=")
    opts = SessionOptions(
        ram_budget=budget,
        lookahead=lookahead,
        # a whole number of 256 positions, as real contexts are: DeepSeek V4 decodes in one graph only where its
        # compressed blocks can complete before the context ends (models/deepseek4.py `one_graph_at`)
        n_ctx=-(-(len(tokens) + 16) // 256) * 256,
        max_batch=64,
        usage_table=False,
        cpu_repack=repack,
        token_graph=one_graph,
        stream=stream_settings(extra),
        n_threads=int(os.environ.get("BENCH_THREADS", "2")),  # (engine_bench --threads)
    )
    s = Session(model, opts, log=notes.append)
    if "nohashreads" in extra:  # DeepSeek V4's hash layers read on demand, as a router's layer (the "without" row)
        s.model.known_experts = lambda token: {}  # type: ignore[method-assign]
    if "hashpredict" in extra:  # ... read at the token's start as certain predictions (before `read_known`)
        s.scheduler.read_known = lambda block, experts: s.scheduler.predict(  # type: ignore[method-assign]
            block, experts, block + 1, [1.0] * len(experts), 1
        )
    load = time.perf_counter() - t0
    c = {n: i for i, n in enumerate(COUNTERS)}
    r0 = process_read_bytes()
    t1 = time.perf_counter()
    s.forward(tokens[:n_prompt])
    t2 = time.perf_counter()
    r1 = process_read_bytes()
    mid = s.counters()
    core = s.scheduler.streamer.core
    warm = [core.resident_experts(li) for li in range(core.n_layers)]  # the cache decoding starts from
    s.trace = [] if trace_path else None
    disk = DiskWatch(model).start()
    cpu0, sw0, p0 = thread_cpu(), switches(), os.times()
    t2 = time.perf_counter()
    for tok in tokens[n_prompt:]:
        s.forward([tok])
    t3 = time.perf_counter()
    cpu1, sw1, p1 = thread_cpu(), switches(), os.times()
    device = disk.stop()
    r2 = process_read_bytes()
    d = s.counters() - mid
    n_dec = len(tokens) - n_prompt
    hits, misses = d[:, c["hits"]].sum(), d[:, c["misses"]].sum()
    if trace_path:
        s.recorded_trace().save(trace_path)
        np.save(trace_path + ".warm.npy", np.array(warm, np.int32))
    # what an in-RAM token reads: experts, resident weights, the lookahead's F16 routers, the KV window it attends
    kv_pos = s.model.kv_bytes_per_token(s.hp, kv_element(opts.kv_type)[1])
    windows = [common.decode_window(n_prompt + i, s.n_ctx) for i in range(n_dec)]  # decode's masked window
    touched = decode_bytes_touched(model, windows, kv_pos)
    one_graph_ran = s._token_graph is not None  # the one-graph step computes no lookahead
    routers = (
        0
        if one_graph_ran
        else sum(2 * int(t.contents.ne[0]) * int(t.contents.ne[1]) for t, _ in s.lookahead.fused.values())
    )
    cpu = delta(cpu1, cpu0)
    io_cpu = sum(v for k, v in cpu.items() if k.startswith(("tw-io", "tw-reap", "iou-")))
    sw = delta(sw1, sw0)  # type: ignore[arg-type]
    print(
        json.dumps(
            {
                "engine": f"tokenwing lookahead {lookahead}",
                "load_s": load,
                "notes": notes,
                "slots_per_layer": s.slots_per_layer,
                "record_sizes": [el.record_size for el in s.scheduler.streamer.layers],
                "io_engine": core.io_engine,
                "prompt_tok_s": n_prompt / (t2 - t1),
                "decode_tok_s": n_dec / (t3 - t2),
                "decode_s": t3 - t2,
                "prompt_read_bytes": r1 - r0,
                "read_bytes_per_token": (r2 - r1) / n_dec,
                "ssd_wait_ms_per_token": d[:, c["wait_ns"]].sum() / 1e6 / n_dec,
                "hit_rate": float(hits / (hits + misses)),
                "expert_bytes_per_token": float(d[:, c["bytes_read"]].sum()) / n_dec,
                "expert_mb_per_s": float(d[:, c["bytes_read"]].sum()) / 1e6 / (t3 - t2),
                "demand_reads_per_token": float(d[:, c["demand_reads"]].sum()) / n_dec,
                "demand_wait_ms_per_layer": [float(x) / 1e6 / n_dec for x in d[:, c["wait_ns"]]],
                "demand_reads_per_layer": [float(x) / n_dec for x in d[:, c["demand_reads"]]],
                # (of those, reads of an expert a prediction named that had not started: not a miss nobody saw)
                "demand_predicted_per_layer": [float(x) / n_dec for x in d[:, c["demand_predicted"]]],
                # experts known before their layer (DeepSeek V4's hash layers): read at the token's start, still on
                # their way when their layer began, and the wait on them
                "known_reads_per_layer": [float(x) / n_dec for x in d[:, c["known_reads"]]],
                "known_late_per_layer": [float(x) / n_dec for x in d[:, c["known_late"]]],
                "known_wait_ms_per_layer": [float(x) / 1e6 / n_dec for x in d[:, c["known_wait_ns"]]],
                "prediction_recall": s.stats()["prediction_recall"],
                "prefetch_issued": int(d[:, c["prefetch_issued"]].sum()),
                "prefetch_used": int(d[:, c["prefetch_used"]].sum()),
                "prefetch_late": int(d[:, c["prefetch_late"]].sum()),
                "device": device,
                "cpu_ms_per_token": {k: v * 1e3 / n_dec for k, v in cpu.items() if v > 0},
                "io_cpu_ms_per_token": io_cpu * 1e3 / n_dec,
                "process_cpu_ms_per_token": ((p1.user - p0.user) + (p1.system - p0.system)) * 1e3 / n_dec,
                "switches_per_token": {k: v / n_dec for k, v in sw.items() if v > 0},
                "touched_bytes_per_token": touched["total"] + routers,
                "touched": {**touched, "lookahead_routers": routers},
            }
        ),
        flush=True,
    )
    s.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
