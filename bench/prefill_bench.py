"""Prefill under a memory cap: reads per distinct expert and prompt tokens/s (layer-major, expert waves), against
its limits.

python bench/prefill_bench.py [--model models/bench/bench-q4_k_m.tw.gguf] [--tokens 1024] [--cap 0.25]
                              [--llama plain,random] [--llama-timeout 600] [--read-ahead-from N] [--rounds 1]
                              [--reply 0] [--prompt-attention products|flash]

With --llama, llama.cpp (llama-cpp-python, the same GGUF before repacking) runs the same prompt under the same
cap in each named mode, once per round, interleaved with TokenWing's runs (see llama_runner.py: default, plain,
random; `+flash` after a mode turns its flash attention on, as llama.cpp's own programs do on the CPU; its
default mode is OOM-killed under these caps).

--cap 0: both in RAM, as each engine runs by default (TokenWing reads every expert at start, in ggml's repacked
layouts where this CPU has them; llama.cpp's `default` repacks too) — the in-RAM comparison. Its limit is then the
compute floor alone.

Limits (bench/limits.py): the fewest bytes a prompt can read are its distinct experts, once each; the compute floor
is the same prompt through the same path with every expert already in RAM (no cap, experts in the file's layout,
as streamed ones are); the drive ceiling is the best of the deep-queue probe, fio and the engine's own rate.
Limit = min(ceiling ÷ distinct bytes per token, 1 ÷ floor per token). With --reply N, N reply tokens follow the
prompt and the first 32 are timed against tokens 200–232 (seed §15: after a long prompt, are the first reply tokens
slower while the cache moves from the prompt's experts to the reply's?).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from limits import DiskWatch, capped_limit, probe_drive
from memcap import evict_from_page_cache, run_capped

CHILD = r"""
import json, sys, time
import numpy as np
from tokenwing.runtime.session import Session, SessionOptions
from tokenwing.runtime.experts import ExpertPools
from tokenwing.streaming.streamer import COUNTERS
import tokenwing.runtime.scheduler as scheduler_module
import tokenwing.runtime.session as session_module
model, n, read_ahead = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
in_ram, reply, attention = sys.argv[4] == "1", int(sys.argv[5]), sys.argv[6]
if read_ahead >= 0:
    scheduler_module.READ_AHEAD_TOKENS = read_ahead  # --read-ahead-from
budget = None
if in_ram:  # the compute floor: every expert in RAM, in the file's layout (as streamed experts compute)
    session_module.ExpertPools = lambda sched, arena, _repack: ExpertPools(sched, arena, False)
    budget = 1 << 62
opts = SessionOptions(n_ctx=n + reply + 16, lookahead=0, usage_table=False, ram_budget=budget,
                      prompt_attention=attention)
s = Session(model, opts, log=lambda l: None)
s.trace = []
toks = np.random.default_rng(0).integers(0, s.hp.vocab_size - 16, n + reply).tolist()
t = time.perf_counter(); s.forward(toks[:n], prompt=True); secs = time.perf_counter() - t
c = s.counters()
ahead = c[:, COUNTERS.index("prefetch_issued")]
reads = c[:, COUNTERS.index("demand_reads")] + ahead  # every read: on demand or read ahead
sel = s.trace[0][0]
distinct = [len(np.unique(sel[:, li])) for li in range(sel.shape[1])]
records = [el.record_size for el in s.scheduler.streamer.layers]
times = []
for tok in toks[n:]:
    t1 = time.perf_counter(); s.forward([tok]); times.append(time.perf_counter() - t1)
out = {"tokens": n, "prompt_tok_s": n / secs, "slots_per_layer": s.slots_per_layer,
       "reads": int(reads.sum()), "distinct": int(sum(distinct)),
       "distinct_bytes": int(sum(d * r for d, r in zip(distinct, records))),
       "reads_per_distinct": float(reads.sum() / sum(distinct)),
       "expert_bytes": int(c[:, COUNTERS.index("bytes_read")].sum()),
       "read_ahead": int(ahead.sum()), "read_ahead_used": int(c[:, COUNTERS.index("prefetch_used")].sum()),
       "ssd_wait_s": float(c[:, COUNTERS.index("wait_ns")].sum() / 1e9)}
if len(times) >= 232:
    out["reply_first_32_tok_s"] = 32 / sum(times[:32])
    out["reply_200_232_tok_s"] = 32 / sum(times[200:232])
print(json.dumps(out))
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/bench/bench-q4_k_m.tw.gguf")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--cap", type=float, default=0.25, help="memory cap as a share of the model file")
    ap.add_argument("--llama", default="", help="llama.cpp modes to run the same prompt in (plain, random)")
    ap.add_argument("--llama-timeout", type=float, default=600)
    ap.add_argument("--read-ahead-from", type=int, default=-1, help="prompt length from which the window runs")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds (medians)")
    ap.add_argument("--reply", type=int, default=0, help="reply tokens after the prompt (≥ 232: first 32 vs 200–232)")
    ap.add_argument("--quick", action="store_true", help="a short drive probe (a dry run)")
    ap.add_argument("--prompt-attention", default="flash", choices=["products", "flash"])
    args = ap.parse_args()
    cap = int(os.path.getsize(args.model) * args.cap)
    in_ram = cap == 0
    ceiling = probe_drive(args.model, budget=(256 if args.quick else 1024) << 20, quick=args.quick)
    child = [sys.executable, "-c", CHILD, args.model, str(args.tokens), str(args.read_ahead_from)]
    runs: dict[str, list[dict[str, object]]] = {"capped": [], "floor": []}
    modes = list(filter(None, args.llama.split(",")))
    llama_runs: dict[str, list[dict[str, object]]] = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        for mode in modes:  # llama.cpp in the same rounds, interleaved: this VM's speed drifts within a run
            llama_runs[mode].append(_llama(args.model, args.tokens, mode, cap, args.llama_timeout))
        att = args.prompt_attention
        runs_here = [("capped", ["0", str(args.reply), att], cap or None)]
        if not in_ram:
            runs_here.append(("floor", ["1", "0", att], None))
        for key, extra, limit in runs_here:
            evict_from_page_cache(args.model)
            watch = DiskWatch(args.model).start()
            r = run_capped([*child, *extra], limit, 3600)
            dev = watch.stop()
            if r.returncode:
                print(r.stderr[-1000:], file=sys.stderr)
                return 1
            out = json.loads(r.stdout.strip().splitlines()[-1])
            out["cap_bytes"] = limit
            if dev is not None and key == "capped":
                out["device_mb_per_s"] = dev["mb_per_s"]
            runs[key].append(out)
            if key == "capped":
                secs = out["tokens"] / out["prompt_tok_s"]
                ceiling.add("TokenWing's own reads (prompt average)", out["expert_bytes"] / secs / 1e6)
    capped = _median(runs["capped"])
    floor = _median(runs["floor"]) if runs["floor"] else capped  # (in RAM: the run is its own floor)
    each = " / ".join(f"{float(r['prompt_tok_s']):.1f}" for r in runs["capped"])  # type: ignore[arg-type]
    per_token = capped["distinct_bytes"] / capped["tokens"]
    lim = capped_limit(ceiling.mb_per_s, per_token, 1 / floor["prompt_tok_s"])
    print(json.dumps(capped))
    print(
        f"drive ceiling {ceiling.mb_per_s:.0f} MB/s ({ceiling.best}); fewest bytes: the prompt's distinct experts "
        f"once, {capped['distinct_bytes'] / 1e9:.2f} GB; compute floor (every expert in RAM): "
        f"{floor['prompt_tok_s']:.1f} tok/s\n"
        f"limit {lim['limit_tok_s']:.1f} tok/s (drive {lim['drive_tok_s']:.1f}, compute {lim['compute_tok_s']:.1f}); "
        f"TokenWing {'in RAM' if in_ram else f'under the {args.cap:.0%} cap'}: {capped['prompt_tok_s']:.1f} tok/s = "
        f"{capped['prompt_tok_s'] / lim['limit_tok_s']:.0%} of it, {capped['reads_per_distinct']:.2f} reads per "
        f"distinct expert (runs: {each})"
    )
    if "reply_first_32_tok_s" in capped:
        print(
            f"reply after the prompt: first 32 tokens {capped['reply_first_32_tok_s']:.2f} tok/s, tokens 200–232 "
            f"{capped['reply_200_232_tok_s']:.2f} tok/s"
        )
    for mode, results in llama_runs.items():
        done = [r for r in results if "prompt_tok_s" in r]
        for r in results:
            print(json.dumps(r))
        if done:
            res = _median(done)
            speeds = " / ".join(f"{float(r['prompt_tok_s']):.1f}" for r in done)  # type: ignore[arg-type]
            print(
                f"llama.cpp {mode}: {float(res['prompt_tok_s']):.1f} tok/s (runs: {speeds}); TokenWing / llama.cpp "
                f"{mode}: {capped['prompt_tok_s'] / float(res['prompt_tok_s']):.2f}x (medians)"
            )
    return 0


def _median(rs: list[dict[str, object]]) -> dict[str, Any]:
    return sorted(rs, key=lambda r: float(r["prompt_tok_s"]))[(len(rs) - 1) // 2]  # type: ignore[arg-type]


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
        r = run_capped([sys.executable, runner, gguf, path, str(n), mode], cap or None, timeout)
    except Exception as e:  # subprocess.TimeoutExpired
        return {"engine": f"llama.cpp {mode}", "failed": f"not done after {timeout:.0f} s ({type(e).__name__})"}
    if r.returncode:
        return {"engine": f"llama.cpp {mode}", "failed": f"exit {r.returncode}: {r.stderr.strip()[-200:]}"}
    res: dict[str, object] = json.loads(r.stdout.strip().splitlines()[-1])
    return {k: res[k] for k in ("engine", "prompt_tok_s", "prompt_read_bytes")}


if __name__ == "__main__":
    raise SystemExit(main())
