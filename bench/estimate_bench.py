""" "Will it run here?" against the engine: the app's estimate next to the measured decode speed.

    python bench/estimate_bench.py [--bench-model models/bench/bench-q4_k_m.tw.gguf] [--decode 48] [--rounds 3]

For the built-in model (in RAM, and with 40 % and 25 % of its experts in RAM: `--ram-budget`, as the app runs
it) and for the engine's bench model (in RAM, and under 40 % and 25 % cgroup memory caps of its file size, as
bench/engine_bench.py runs it; skipped when the file is not there), the engine decodes the same pseudo-random
token stream (bench/tokenwing_runner.py; the files evicted from the page cache first), and the app's estimate
(`runmyai.library.estimate`, with the footprint from `tokenwing inspect --json`, this machine's probe, the
drive speed measured here and the same memory or budget) is printed beside it. A row is the run with the median
decode speed. The aim (issue 15): every estimate within ±35 % of the measured speed. Also printed: what the
in-RAM runs say of the calibration (the engine's work per token once the weight reads are taken out).
Needs root for the caps (cgroup) and the page-cache eviction. Numbers go to docs/results.md ("The estimate").
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from memcap import evict_from_page_cache, run_capped

from runmyai.engine.info import ask_engine
from runmyai.library.estimate import calibration_for, estimate, footprint_from_inspect
from runmyai.machine import probe_machine
from tokenwing import _core
from tokenwing.format.reader import ModelFile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEMO_SOURCE = os.path.join(ROOT, "resources", "demo-model", "tokenwing-demo-moe.gguf")
AIM = 0.35


def inspect(model: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-m", "tokenwing", "inspect", "--json", model], capture_output=True, text=True, check=True
    )
    data: dict[str, object] = json.loads(out.stdout)
    return data


def measure(model: str, tokens: str, n_prompt: int, cap: int | None, extra: list[str]) -> dict[str, object]:
    evict_from_page_cache(model)
    cmd = [sys.executable, os.path.join(HERE, "tokenwing_runner.py"), model, tokens, str(n_prompt), "2", *extra]
    r = run_capped(cmd, cap, timeout=600, name="tw-estimate")
    if r.returncode != 0:
        return {"failed": f"exit {r.returncode}: {r.stderr.strip()[-200:]}"}
    result: dict[str, object] = json.loads(r.stdout.strip().splitlines()[-1])
    return result


def median(runs: list[dict[str, object]]) -> dict[str, object]:
    ok = sorted((r for r in runs if "failed" not in r), key=lambda r: float(r["decode_tok_s"]))  # type: ignore[arg-type]
    return ok[(len(ok) - 1) // 2] if ok else runs[0]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench-model", default=os.path.join(ROOT, "models", "bench", "bench-q4_k_m.tw.gguf"))
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--decode", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="tw-estimate-")
    demo = os.path.join(work, "demo.tw.gguf")
    subprocess.run([sys.executable, "-m", "tokenwing", "repack", DEMO_SOURCE, "-o", demo, "-q"], check=True)

    machine = probe_machine(Path(work))
    engine = asyncio.run(ask_engine(Path(work)))
    cal = calibration_for(machine)
    # (model, label, cgroup cap or None, runner extras, the estimate's memory: ram_limit or budget share)
    configs: list[tuple[str, str, int | None, list[str], dict[str, object]]] = []
    for label, share in (("in RAM", None), ("40 % of the experts", 0.40), ("25 % of the experts", 0.25)):
        extra = [f"budget={share:.0%}"] if share else []
        configs.append((demo, label, None, extra, {"budget_share": share}))
    if os.path.exists(args.bench_model):
        size = os.path.getsize(args.bench_model)
        configs.append((args.bench_model, "in RAM", None, [], {}))
        for frac in (0.40, 0.25):
            cap = int(size * frac)
            configs.append((args.bench_model, f"cap {frac:.0%} ({cap / 2**30:.2f} GiB)", cap, [], {"cap": cap}))
    else:
        print(f"(no {args.bench_model}: the bench model's rows are skipped; see bench/engine_bench.py)\n")

    tokens: dict[str, str] = {}
    drive: dict[str, float] = {}
    facts: dict[str, dict[str, object]] = {}
    for model in dict.fromkeys(c[0] for c in configs):
        with ModelFile.open(model) as mf:
            vocab = len(mf.header.get("tokenizer.ggml.tokens"))
            record = mf.index.layers[0].record_size
        path = os.path.join(work, f"tokens-{len(tokens)}.npy")
        np.save(path, np.random.default_rng(0).integers(0, vocab - 16, args.prompt + args.decode))
        tokens[model] = path
        secs, nbytes, _ = _core.read_benchmark(model, record, 8, min(1 << 30, os.path.getsize(model)), seed=1)
        drive[model] = nbytes / secs
        facts[model] = inspect(model)

    runs: dict[int, list[dict[str, object]]] = {i: [] for i in range(len(configs))}
    for rnd in range(args.rounds):
        for i, (model, _, cap, extra, _) in enumerate(configs):
            runs[i].append(measure(model, tokens[model], args.prompt, cap, extra))
        print(f"(round {rnd + 1} of {args.rounds} done)", file=sys.stderr, flush=True)

    print(f"calibration: {cal}\n")
    print("| model | memory | measured tok/s | estimate tok/s | estimate / measured | hit rate measured / est. |")
    print("|---|---|---|---|---|---|")
    worst = 0.0
    for i, (model, label, _, _, memory) in enumerate(configs):
        r = median(runs[i])
        name = "built-in" if model == demo else os.path.basename(model)
        if "failed" in r:
            print(f"| {name} | {label} | {r['failed']} | | | |")
            continue
        fp = footprint_from_inspect(facts[model], os.path.getsize(model))
        m = dataclasses.replace(machine, drive_read_bps=drive[model])
        if "cap" in memory:
            m = dataclasses.replace(m, ram_limit=int(memory["cap"]), ram_limit_used=0)  # type: ignore[call-overload]
        share = memory.get("budget_share")
        e = estimate(
            fp,
            m,
            engine,
            installed=True,
            context=args.prompt + args.decode + 16,
            calibration=cal,
            budget_share=float(share) if isinstance(share, float) else None,
        )
        measured = float(r["decode_tok_s"])  # type: ignore[arg-type]
        ratio = e.tokens_per_s / measured
        worst = max(worst, abs(ratio - 1))
        speeds = " / ".join(f"{float(x['decode_tok_s']):.1f}" for x in runs[i] if "failed" not in x)  # type: ignore[arg-type]
        print(
            f"| {name} | {label} | {measured:.2f} ({speeds}) | {e.tokens_per_s:.2f} | {ratio:.2f} "
            f"{'ok' if abs(ratio - 1) <= AIM else 'OUTSIDE ±35 %'} | {float(r['hit_rate']):.0%} / {e.hit_rate:.0%} |"  # type: ignore[arg-type]
        )
        if label == "in RAM":
            read_s = e.active_bytes / cal.mem_bps
            print(
                f"|   | (in RAM: {1000 / measured:.2f} ms a token, of which the estimate's weight reads "
                f"{read_s * 1000:.2f} ms: the engine's own work is {1000 / measured - read_s * 1000:.2f} ms for "
                f"{fp.layers} layers) | | | | |"
            )
    print(
        f"\nworst |estimate / measured - 1| = {worst:.0%} (aim ≤ {AIM:.0%}); drive probe: "
        + ", ".join(f"{os.path.basename(k)} {v / 1e6:.0f} MB/s" for k, v in drive.items())
    )
    raw = {f"{os.path.basename(configs[i][0])} {configs[i][1]}": v for i, v in runs.items()}
    print("\nraw results:", json.dumps(raw, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
