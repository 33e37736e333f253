"""The autotuner must not make it slower: decode with `tokenwing autotune`'s settings against the defaults.

    python bench/autotune_bench.py [--models models/bench/bench-q4_k_m.tw.gguf,...] [--cap 0.25] [--rounds 3]
                                   [--decode 48] [--prompt 32] [--replay-tokens 24]

For each model: `tokenwing autotune --json` runs inside the same memory cap as the decodes (so it plans for the
memory they get); then the engine decodes the same token stream with the defaults and with the autotuned settings,
alternating, --rounds times each (bench/tokenwing_runner.py, file evicted from the page cache before each run).
Prints the medians, every run, and autotuned ÷ defaults (the goal: ≥ 1.0 on every geometry).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from memcap import evict_from_page_cache, run_capped

from tokenwing.format.reader import ModelFile

HERE = os.path.dirname(os.path.abspath(__file__))
RUNNER_KEYS = {  # autotune's settings → the runner's NAME=VALUE stream settings
    "moe_stream_io_engine": "io_engine",
    "moe_stream_io_threads": "io_threads",
    "moe_stream_prefetch_votes": "prefetch_votes",
    "moe_stream_direct": "direct",
}


def runner_args(settings: dict[str, object]) -> tuple[int, list[str]]:
    """(lookahead, runner options) for autotune's settings."""
    opts = []
    for key, name in RUNNER_KEYS.items():
        if key in settings:
            value = settings[key]
            opts.append(f"{name}={int(value) if isinstance(value, bool) else value}")
    return int(settings.get("lookahead", 2)), opts  # type: ignore[call-overload]


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="tw-bench-", ignore_cleanup_errors=True) as work:  # streams, traces
        return _main(work)


def _main(work: str) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="models/bench/bench-q4_k_m.tw.gguf")
    ap.add_argument("--cap", type=float, default=0.25, help="memory cap as a share of the model file")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--decode", type=int, default=48)
    ap.add_argument("--replay-tokens", type=int, default=24)
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    py = sys.executable
    print(
        "| model | cap | autotuned settings | defaults tok/s | autotuned tok/s | autotuned ÷ defaults | runs (d / a) |"
    )
    print("|---|---|---|---|---|---|---|")
    for model in filter(None, args.models.split(",")):
        cap = int(os.path.getsize(model) * args.cap)
        evict_from_page_cache(model)
        tune = [py, "-m", "tokenwing", "autotune", model, "--json", "--ctx", str(args.prompt + args.decode + 16)]
        r = run_capped([*tune, "--replay-tokens", str(args.replay_tokens)], cap, args.timeout)
        if r.returncode:
            print(f"| {model} | {args.cap:.0%} | autotune failed: {r.stderr.strip()[-200:]} | | | | |")
            continue
        tuned = json.loads(r.stdout)["settings"]
        la, opts = runner_args(tuned)
        with ModelFile.open(model, announce_fallback=False) as mf:
            vocab = len(mf.header.get("tokenizer.ggml.tokens"))
        tok_path = os.path.join(work, os.path.basename(model) + ".tokens.npy")
        np.save(tok_path, np.random.default_rng(0).integers(0, vocab - 16, args.prompt + args.decode))
        base = [py, os.path.join(HERE, "tokenwing_runner.py"), model, tok_path, str(args.prompt)]
        speeds: dict[str, list[float]] = {"defaults": [], "autotuned": []}
        for _ in range(args.rounds):
            for label, cmd in (("defaults", [*base, "2"]), ("autotuned", [*base, str(la), *opts])):
                evict_from_page_cache(model)
                out = run_capped(cmd, cap, args.timeout)
                if out.returncode == 0:
                    speeds[label].append(float(json.loads(out.stdout.strip().splitlines()[-1])["decode_tok_s"]))
        d, a = (statistics.median(v) if v else float("nan") for v in (speeds["defaults"], speeds["autotuned"]))
        shown = f"lookahead {la}, " + ", ".join(opts)
        runs = (
            " ".join(f"{x:.2f}" for x in speeds["defaults"]) + " / " + " ".join(f"{x:.2f}" for x in speeds["autotuned"])
        )
        print(f"| {os.path.basename(model)} | {args.cap:.0%} | {shown} | {d:.2f} | {a:.2f} | {a / d:.2f} | {runs} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
