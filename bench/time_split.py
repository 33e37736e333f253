"""Where a forward pass spends its time: ggml graphs by the session method that ran them, and waits for experts.

    python bench/time_split.py [--model models/bench/bench-q4_k_m.tw.gguf] [--prompt 2048] [--slots 16]
    python bench/time_split.py --prompt 32 --decode 32          # decode tokens after a short prompt (in RAM)

No memory cap: --slots sets the expert cache (0: the whole model, read at start). Run on an idle machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter, defaultdict
from typing import Any

import numpy as np

from tokenwing.compute import ggml_lib
from tokenwing.format.reader import ModelFile
from tokenwing.runtime.session import Session, SessionOptions
from tokenwing.streaming import streamer as streamer_module


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/bench/bench-q4_k_m.tw.gguf")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--decode", type=int, default=0)
    ap.add_argument("--slots", type=int, default=16)
    args = ap.parse_args()
    spent: dict[str, float] = defaultdict(float)
    calls: Counter[str] = Counter()
    compute, wait_all = ggml_lib.Graph.compute, streamer_module.ExpertStreamer.wait_all

    def timed_compute(self: Any, *outs: Any, **kw: Any) -> None:
        t = time.perf_counter()
        compute(self, *outs, **kw)
        caller = sys._getframe(1).f_code.co_name
        spent[caller] += time.perf_counter() - t
        calls[caller] += 1

    def timed_wait(self: Any, *a: Any) -> list[int]:
        t = time.perf_counter()
        out = wait_all(self, *a)
        spent["waiting for experts"] += time.perf_counter() - t
        return out

    ggml_lib.Graph.compute = timed_compute  # type: ignore[method-assign]
    streamer_module.ExpertStreamer.wait_all = timed_wait  # type: ignore[method-assign]
    n = args.prompt + args.decode
    budget = None
    if args.slots:
        with ModelFile.open(args.model) as mf:
            budget = args.slots * sum(el.record_size for el in mf.index.layers)
    s = Session(args.model, SessionOptions(n_ctx=n + 16, lookahead=2, usage_table=False, ram_budget=budget))
    toks = np.random.default_rng(0).integers(0, s.hp.vocab_size - 16, n).tolist()
    t0 = time.perf_counter()
    s.forward(toks[: args.prompt])
    t1 = time.perf_counter()
    if args.decode:
        spent.clear()
        calls.clear()
        for tok in toks[args.prompt :]:
            s.forward([tok])
    t2 = time.perf_counter()
    total, count = (t2 - t1, args.decode) if args.decode else (t1 - t0, args.prompt)
    what = "decode" if args.decode else "prompt"
    print(f"{what}: {count} tokens in {total:.2f} s = {count / total:.1f} tok/s; slots per layer {s.slots_per_layer}")
    for name, secs in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {name:24s} {secs:8.2f} s  {secs / total:6.1%}  {calls[name] or '':>6} graphs")
    rest = total - sum(spent.values())
    print(f"  {'everything else':24s} {rest:8.2f} s  {rest / total:6.1%}  (Python, numpy, the core's calls)")
    s.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
