"""Routing trace of the demo model reading held-out text one token at a time (decode steps, lookahead on).

    python resources/demo-model/trace_heldout.py MODEL.tw.gguf --out TRACE.npz [--stats STATS.json]
        [--tokens 2000] [--ram-budget 25%] [--lookahead 2]

`tokenwing run --record-trace` records a prompt as one batch row, so it cannot trace a long held-out text token
by token; this feeds the held-out documents (build/demo-model/heldout.jsonl, from `build.py corpus`) through
the engine's Session as decode steps: every token gets its own trace row with the lookahead's predictions.
Documents are separated by <|endoftext|>; the context restarts when it is full.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tokenwing.format.reader import ModelFile
from tokenwing.fsutil import parse_size
from tokenwing.runtime.session import Session, SessionOptions

HELDOUT = Path(__file__).resolve().parents[2] / "build" / "demo-model" / "heldout.jsonl"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--out", required=True)
    p.add_argument("--stats")
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--ram-budget", default="25%")
    p.add_argument("--lookahead", type=int, default=2)
    p.add_argument("--ctx", type=int, default=512)
    args = p.parse_args()
    with ModelFile.open(args.model, announce_fallback=False) as mf:
        budget = parse_size(args.ram_budget, mf.index.total_bytes)
    opts = SessionOptions(ram_budget=budget, lookahead=args.lookahead, n_ctx=args.ctx)
    s = Session(args.model, opts, log=lambda line: None)
    try:
        eot = s.tokenizer.encode("<|endoftext|>", special=True)
        ids: list[int] = []
        with open(HELDOUT, encoding="utf-8") as f:
            for line in f:
                ids += s.tokenizer.encode(json.loads(line), special=True) + eot
                if len(ids) >= args.tokens:
                    break
        ids = ids[: args.tokens]
        s.trace = []
        t0 = time.monotonic()
        used = 0
        for t in ids:
            if used == args.ctx:
                s.reset()
                used = 0
            s.forward([t])
            used += 1
        elapsed = time.monotonic() - t0
        s.recorded_trace().save(args.out)
        st = s.stats()
        st["tokens"] = len(ids)
        st["seconds"] = round(elapsed, 1)
        print(json.dumps({k: st[k] for k in ("tokens", "seconds", "slots_per_layer", "prediction_recall")}))
        if args.stats:
            Path(args.stats).write_text(json.dumps(st, indent=1) + "\n", encoding="utf-8")
    finally:
        s.close()


if __name__ == "__main__":
    main()
