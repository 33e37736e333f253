"""Prefill under a memory cap: reads per distinct expert and prompt tokens/s (layer-major, expert waves).

python bench/prefill_bench.py [--model models/bench/bench-q4_k_m.tw.gguf] [--tokens 1024] [--cap 0.25]
                              [--llama plain,random] [--llama-timeout 600] [--read-ahead-from N]

With --llama, llama.cpp (llama-cpp-python, the same GGUF before repacking) runs the same prompt under the same
cap in each named mode (see llama_runner.py; its default mode is OOM-killed under these caps).
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
import tokenwing.runtime.session as session_module
if len(sys.argv) > 3:
    session_module.READ_AHEAD_TOKENS = int(sys.argv[3])  # --read-ahead-from
opts = SessionOptions(n_ctx=int(sys.argv[2]) + 16, lookahead=0, usage_table=False)
s = Session(sys.argv[1], opts, log=lambda l: None)
s.trace = []
toks = np.random.default_rng(0).integers(0, s.hp.vocab_size - 16, int(sys.argv[2])).tolist()
t = time.perf_counter(); s.forward(toks); secs = time.perf_counter() - t
c = s.counters()
ahead = c[:, COUNTERS.index("prefetch_issued")]
reads = c[:, COUNTERS.index("demand_reads")] + ahead  # every read: on demand or read ahead
sel = s.trace[0][0]
distinct = [len(np.unique(sel[:, li])) for li in range(sel.shape[1])]
print(json.dumps({"tokens": len(toks), "prompt_tok_s": len(toks) / secs, "slots_per_layer": s.slots_per_layer,
                  "reads": int(reads.sum()), "distinct": int(sum(distinct)),
                  "reads_per_distinct": float(reads.sum() / sum(distinct)),
                  "read_ahead": int(ahead.sum()), "read_ahead_used": int(c[:, COUNTERS.index("prefetch_used")].sum()),
                  "ssd_wait_s": float(c[:, COUNTERS.index("wait_ns")].sum() / 1e9)}))
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/bench/bench-q4_k_m.tw.gguf")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--cap", type=float, default=0.25, help="memory cap as a share of the model file")
    ap.add_argument("--llama", default="", help="llama.cpp modes to run the same prompt in (plain, random)")
    ap.add_argument("--llama-timeout", type=float, default=600)
    ap.add_argument("--read-ahead-from", type=int, default=None, help="prompt length from which the window runs")
    args = ap.parse_args()
    cap = int(os.path.getsize(args.model) * args.cap)
    evict_from_page_cache(args.model)
    child = [sys.executable, "-c", CHILD, args.model, str(args.tokens)]
    if args.read_ahead_from is not None:
        child.append(str(args.read_ahead_from))
    r = run_capped(child, cap, 3600)
    if r.returncode:
        print(r.stderr[-1000:], file=sys.stderr)
        return 1
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["cap_bytes"] = cap
    print(json.dumps(out))
    for mode in filter(None, args.llama.split(",")):
        print(json.dumps(_llama(args.model, args.tokens, mode, cap, args.llama_timeout)))
    return 0


def _llama(tw_model: str, n: int, mode: str, cap: int, timeout: float) -> dict[str, object]:
    """llama.cpp on the same prompt (the same token ids: the bench model's vocabulary is the same)."""
    import numpy as np

    gguf = tw_model.removesuffix(".tw.gguf") + ".gguf"
    from tokenwing.format.reader import ModelFile

    with ModelFile.open(tw_model) as mf:
        vocab = len(mf.header.get("tokenizer.ggml.tokens"))
    toks = np.random.default_rng(0).integers(0, vocab - 16, n + 1)  # the prompt, then one decode token
    path = os.path.join(os.path.dirname(tw_model), f"prefill-{n}.npy")
    np.save(path, toks)
    evict_from_page_cache(gguf)
    runner = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama_runner.py")
    try:
        r = run_capped([sys.executable, runner, gguf, path, str(n), mode], cap, timeout)
    except Exception as e:  # subprocess.TimeoutExpired
        return {"engine": f"llama.cpp {mode}", "failed": f"not done after {timeout:.0f} s ({type(e).__name__})"}
    if r.returncode:
        return {"engine": f"llama.cpp {mode}", "failed": f"exit {r.returncode}: {r.stderr.strip()[-200:]}"}
    res: dict[str, object] = json.loads(r.stdout.strip().splitlines()[-1])
    return {k: res[k] for k in ("engine", "prompt_tok_s", "prompt_read_bytes")}


if __name__ == "__main__":
    raise SystemExit(main())
