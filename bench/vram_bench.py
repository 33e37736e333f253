"""Decode with the VRAM tier at several VRAM budgets against the same engine on the CPU alone, in one run.

    python bench/vram_bench.py MODEL.tw.gguf [--configs cpu,cuda:8G,cuda:16G,cuda:24G] [--ram-budget 25%]
        [--prompt 32] [--decode 64] [--timeout 240] [--json OUT]

Each configuration runs in a process of its own (a device per process, as the engine runs) on the same fixed
pseudo-random token stream. Before the first, a CPU run over another stream writes the usage table the VRAM
cache is seeded from (routing counted on text, as the design seeds it), and every run starts from that table
(restored before each, so no run learns from the one before). `--ram-budget` is the RAM cap of every run: the
share of the experts the RAM cache may hold (the rest streams from the drive).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

import numpy as np


def one(model: str, config: str, ram_budget: str, n_prompt: int, n_decode: int, seed: int) -> dict[str, Any]:
    """One configuration in this process: `cpu`, or `KIND:BUDGET` (cuda:16G, vulkan:8G)."""
    from tokenwing.compute.devices import DeviceOptions, choose
    from tokenwing.format.reader import ModelFile
    from tokenwing.fsutil import parse_size
    from tokenwing.runtime.session import SESSION_COUNTERS, Session, SessionOptions

    notes: list[str] = []
    kind, _, budget = config.partition(":")
    choice = None if kind == "cpu" else choose(DeviceOptions(kind, budget or None))
    with ModelFile.open(model, announce_fallback=False) as mf:
        ram = parse_size(ram_budget, mf.index.total_bytes)
    options = SessionOptions(
        ram_budget=ram, n_ctx=n_prompt + n_decode + 16, device=None if choice is None or choice.on_cpu else choice
    )
    t0 = time.perf_counter()
    s = Session(model, options, log=notes.append)
    load = time.perf_counter() - t0
    tokens = np.random.default_rng(seed).integers(0, s.hp.vocab_size - 8, n_prompt + n_decode).tolist()
    c = {n: i for i, n in enumerate(SESSION_COUNTERS)}
    t1 = time.perf_counter()
    s.forward(tokens[:n_prompt])
    t2 = time.perf_counter()
    mid = s.counters()
    for tok in tokens[n_prompt:]:
        s.forward([tok])
    t3 = time.perf_counter()
    d = s.counters() - mid
    hits, misses, vram = (d[:, c[k]].sum() for k in ("hits", "misses", "vram_hits"))
    out = {
        "config": config,
        "device_line": s.device_line or (choice.reason if choice is not None else "the CPU (--device cpu)"),
        "load_s": load,
        "prompt_tok_s": n_prompt / (t2 - t1),
        "decode_tok_s": n_decode / (t3 - t2),
        "slots_per_layer": s.slots_per_layer,
        "vram": s.stats()["vram"],
        "from_vram": float(vram / (vram + hits + misses)),
        "from_ram": float(hits / (vram + hits + misses)),
        "from_drive": float(misses / (vram + hits + misses)),
        "ssd_wait_ms_per_token": float(d[:, c["wait_ns"]].sum()) / 1e6 / n_decode,
        "vram_swaps_per_token": float(d[:, c["vram_swaps_in"]].sum()) / n_decode,
        "vram_bytes_up_per_token": float(d[:, c["vram_bytes_up"]].sum()) / n_decode,
        "notes": notes,
    }
    s.close()  # (its usage counts are added to the table: the driver restores the table before each run)
    return out


def warm_usage(model: str, ram_budget: str, n_tokens: int) -> None:
    """A CPU run over another token stream that leaves the usage table next to the model (what a user's first
    sessions leave): the VRAM cache is seeded from it."""
    from tokenwing.runtime.session import Session, SessionOptions
    from tokenwing.streaming.usage import usage_path

    if os.path.exists(usage_path(model)):
        os.remove(usage_path(model))
    s = Session(model, SessionOptions(n_ctx=n_tokens + 16), log=lambda line: None)
    rng = np.random.default_rng(12345)
    toks = rng.integers(0, s.hp.vocab_size - 8, n_tokens).tolist()
    s.forward(toks[: n_tokens // 2])
    for t in toks[n_tokens // 2 :]:
        s.forward([t])
    s.close()  # (saves the table)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--configs", default="cpu,cuda:8G,cuda:16G,cuda:24G")
    ap.add_argument("--ram-budget", default="25%")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--warm-tokens", type=int, default=128)
    ap.add_argument("--json")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.model, a.one, a.ram_budget, a.prompt, a.decode, a.seed)), flush=True)
        return 0
    from tokenwing.streaming.usage import usage_path

    table = usage_path(a.model)
    t0 = time.perf_counter()
    warm_usage(a.model, a.ram_budget, a.warm_tokens)
    saved = table + ".bench"
    shutil.copyfile(table, saved)
    print(f"usage table from {a.warm_tokens} tokens in {time.perf_counter() - t0:.1f} s", flush=True)
    results: list[dict[str, Any]] = []

    def save() -> None:  # after every configuration: a run stopped at its deadline keeps what it measured
        if a.json:
            with open(a.json + ".partial", "w") as f:
                json.dump(results, f, indent=2)
            os.replace(a.json + ".partial", a.json)

    for config in a.configs.split(","):
        shutil.copyfile(saved, table)
        cmd = [sys.executable, __file__, a.model, "--one", config, "--ram-budget", a.ram_budget, "--prompt",
               str(a.prompt), "--decode", str(a.decode), "--seed", str(a.seed)]  # fmt: skip
        t = time.perf_counter()
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, check=False)
            lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
            got = json.loads(lines[-1]) if r.returncode == 0 and lines else {"config": config, "error": r.stderr[-800:]}
        except subprocess.TimeoutExpired:
            got = {"config": config, "error": f"no result within {a.timeout:.0f} s"}
        got["wall_s"] = time.perf_counter() - t
        results.append(got)
        save()
        if "error" in got:
            print(f"{config}: {got['error']}", flush=True)
        else:
            print(
                f"{config}: decode {got['decode_tok_s']:.2f} tok/s, prompt {got['prompt_tok_s']:.1f} tok/s, experts "
                f"from VRAM {got['from_vram']:.0%} / RAM {got['from_ram']:.0%} / drive {got['from_drive']:.0%}, SSD "
                f"wait {got['ssd_wait_ms_per_token']:.1f} ms/token, swaps {got['vram_swaps_per_token']:.2f}/token, "
                f"load {got['load_s']:.1f} s — {got['device_line']}",
                flush=True,
            )
    shutil.copyfile(saved, table)
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
