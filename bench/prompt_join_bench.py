"""A prompt arriving while other conversations decode: its chunks in the decode steps' pass (runtime/batch.py
`step`) against each chunk in a pass of its own before the step (the path where every expert is in RAM).

    python bench/prompt_join_bench.py [--model models/tokenwing-demo-moe.tw.gguf] [--budget 25%] [--streams 3]
                                      [--prompt 256] [--threads 1] [--rounds 3]

N streams decode (teacher-forced pseudo-random ids, so both modes route the same); a new sequence's prompt of
--prompt tokens then runs one chunk (--max-batch 64) per step beside them, as the server runs it. Per mode, in a
fresh session each: the expert bytes read and demand reads over the prompt's steps (what does not depend on the
machine's load), and the steps' wall time. Joined, each layer's experts are read once for the chunk and the
decode tokens; apart, the decode step reads again what the chunk's waves evicted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from tokenwing.format.reader import ModelFile
from tokenwing.fsutil import parse_size
from tokenwing.runtime import batch
from tokenwing.runtime.session import SESSION_COUNTERS, Session, SessionOptions

_C = {name: i for i, name in enumerate(SESSION_COUNTERS)}
CHUNK = 64


def run(model: str, budget: str, streams: int, n_prompt: int, threads: int, joined: bool) -> dict[str, float]:
    with ModelFile.open(model, announce_fallback=False) as mf:
        size = parse_size(budget, mf.index.total_bytes)
    opts = SessionOptions(
        ram_budget=size,
        n_ctx=n_prompt + 256,
        max_batch=CHUNK,
        parallel=streams + 1,
        usage_table=False,
        n_threads=threads,
    )
    s = Session(model, opts, log=lambda line: None)
    try:
        rng = np.random.default_rng(7)
        vocab = s.hp.vocab_size
        ids = rng.integers(10, vocab, size=(streams, 8 + 64)).tolist()
        for i in range(streams):
            s.use(i)
            s.forward(ids[i][:8], prompt=True)
        for j in range(8, 24):  # warm: the cache as a running batch holds it
            batch.decode_step(s, [(i, ids[i][j]) for i in range(streams)])
        prompt = rng.integers(10, vocab, size=n_prompt).tolist()
        if not joined:
            batch.joins = lambda s, part: False  # type: ignore[assignment]
        before = s.counters()
        t0 = time.perf_counter()
        j = 24
        for start in range(0, n_prompt, CHUNK):
            part = batch.PromptPart(streams, prompt[start : start + CHUNK], end=start + CHUNK >= n_prompt)
            batch.step(s, [(i, ids[i][j]) for i in range(streams)], part)
            j += 1
        dt = time.perf_counter() - t0
        d = s.counters() - before
        return {
            "seconds": dt,
            "expert_mb": float(d[:, _C["bytes_read"]].sum()) / 1e6,
            "demand_reads": float(d[:, _C["demand_reads"]].sum()),
            "steps": float(j - 24),
        }
    finally:
        s.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/tokenwing-demo-moe.tw.gguf")
    ap.add_argument("--budget", default="25%")
    ap.add_argument("--streams", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    rows: dict[str, list[dict[str, float]]] = {"joined": [], "apart": []}
    keep = batch.joins
    for _ in range(a.rounds):
        for mode in ("joined", "apart"):
            batch.joins = keep
            rows[mode].append(run(a.model, a.budget, a.streams, a.prompt, a.threads, mode == "joined"))
    batch.joins = keep
    out = {mode: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for mode, runs in rows.items()}
    print(json.dumps(out))
    j, p = out["joined"], out["apart"]
    print(
        f"{a.streams} streams decoding, a {a.prompt}-token prompt in {int(j['steps'])} steps, budget {a.budget}: "
        f"expert reads {p['expert_mb']:.1f} MB apart -> {j['expert_mb']:.1f} MB joined, demand reads "
        f"{p['demand_reads']:.0f} -> {j['demand_reads']:.0f}, time {p['seconds'] * 1e3:.0f} -> "
        f"{j['seconds'] * 1e3:.0f} ms (medians of {a.rounds})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
