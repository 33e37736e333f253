"""Subprocess: TokenWing on a token stream; prints one JSON line of measurements.

usage: python tokenwing_runner.py MODEL.tw.gguf TOKENS.npy N_PROMPT LOOKAHEAD [norepack] [layergraphs] [budget=25%]
The RAM budget comes from the process's own memory limit (the benchmark's cgroup cap), as in real use, or from
`budget=` (a share of the experts or a size, as `--ram-budget` takes it).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from tokenwing.cli import parse_size
from tokenwing.format.reader import ModelFile
from tokenwing.runtime.session import Session, SessionOptions
from tokenwing.streaming.streamer import COUNTERS
from tokenwing.testmodel.oracle import process_read_bytes


def main() -> int:
    model, tokens_path, n_prompt, lookahead = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    tokens = np.load(tokens_path).astype(np.int64).tolist()
    notes: list[str] = []
    t0 = time.perf_counter()
    # no usage table: a benchmark must not start from what earlier runs learnt
    repack = "norepack" not in sys.argv[5:]
    one_graph = "layergraphs" not in sys.argv[5:]  # layergraphs: a graph per layer even with every expert in RAM
    budget = None
    for arg in sys.argv[5:]:
        if arg.startswith("budget="):
            with ModelFile.open(model, announce_fallback=False) as mf:
                budget = parse_size(arg.removeprefix("budget="), mf.index.total_bytes)
    opts = SessionOptions(
        ram_budget=budget,
        lookahead=lookahead,
        n_ctx=len(tokens) + 16,
        max_batch=64,
        usage_table=False,
        cpu_repack=repack,
        token_graph=one_graph,
    )
    s = Session(model, opts, log=notes.append)
    load = time.perf_counter() - t0
    c = {n: i for i, n in enumerate(COUNTERS)}
    r0 = process_read_bytes()
    t1 = time.perf_counter()
    s.forward(tokens[:n_prompt])
    t2 = time.perf_counter()
    r1 = process_read_bytes()
    mid = s.counters()
    for tok in tokens[n_prompt:]:
        s.forward([tok])
    t3 = time.perf_counter()
    r2 = process_read_bytes()
    d = s.counters() - mid
    n_dec = len(tokens) - n_prompt
    hits, misses = d[:, c["hits"]].sum(), d[:, c["misses"]].sum()
    print(
        json.dumps(
            {
                "engine": f"tokenwing lookahead {lookahead}",
                "load_s": load,
                "notes": notes,
                "slots_per_layer": s.slots_per_layer,
                "prompt_tok_s": n_prompt / (t2 - t1),
                "decode_tok_s": n_dec / (t3 - t2),
                "prompt_read_bytes": r1 - r0,
                "read_bytes_per_token": (r2 - r1) / n_dec,
                "ssd_wait_ms_per_token": d[:, c["wait_ns"]].sum() / 1e6 / n_dec,
                "hit_rate": float(hits / (hits + misses)),
                "expert_bytes_per_token": float(d[:, c["bytes_read"]].sum()) / n_dec,
                "prediction_recall": s.stats()["prediction_recall"],
                "prefetch_issued": int(d[:, c["prefetch_issued"]].sum()),
                "prefetch_used": int(d[:, c["prefetch_used"]].sum()),
            }
        ),
        flush=True,
    )
    s.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
