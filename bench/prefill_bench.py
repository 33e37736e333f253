"""Prefill under a memory cap: reads per distinct expert and prompt tokens/s (layer-major, expert waves).

python bench/prefill_bench.py [--model models/bench/bench-q4_k_m.tw.gguf] [--tokens 1024] [--cap 0.25]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from memcap import evict_from_page_cache, run_capped

CHILD = r"""
import json, sys, time
import numpy as np
from tokenwing.runtime.session import Session, SessionOptions
from tokenwing.streaming.streamer import COUNTERS
opts = SessionOptions(n_ctx=int(sys.argv[2]) + 16, lookahead=0, usage_table=False)
s = Session(sys.argv[1], opts, log=lambda l: None)
s.trace = []
toks = np.random.default_rng(0).integers(0, s.hp.vocab_size - 16, int(sys.argv[2])).tolist()
t = time.perf_counter(); s.forward(toks); secs = time.perf_counter() - t
reads = s.streamer.counters()[:, COUNTERS.index("demand_reads")]
sel = s.trace[0][0]
distinct = [len(np.unique(sel[:, li])) for li in range(sel.shape[1])]
print(json.dumps({"tokens": len(toks), "prompt_tok_s": len(toks) / secs, "slots_per_layer": s.slots_per_layer,
                  "reads": int(reads.sum()), "distinct": int(sum(distinct)),
                  "reads_per_distinct": float(reads.sum() / sum(distinct))}))
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/bench/bench-q4_k_m.tw.gguf")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--cap", type=float, default=0.25, help="memory cap as a share of the model file")
    args = ap.parse_args()
    cap = int(os.path.getsize(args.model) * args.cap)
    evict_from_page_cache(args.model)
    r = run_capped([sys.executable, "-c", CHILD, args.model, str(args.tokens)], cap, 3600)
    if r.returncode:
        print(r.stderr[-1000:], file=sys.stderr)
        return 1
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["cap_bytes"] = cap
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
