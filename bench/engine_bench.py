"""TokenWing against llama.cpp on the same model, in RAM and under the same cgroup memory caps.

    python bench/engine_bench.py [--model models/bench/bench-q4_k_m.gguf] [--decode 48] [--prompt 32] [--ram-only]

The model is the `bench` preset in Q4_K_M (12 layers, n_embd 2048, 128 experts of 768, top-8; make it with
`tokenwing testmodel models/bench/bench-q4_k_m.gguf --preset bench --type Q4_K_M` and repack it). Both engines
evaluate the same fixed pseudo-random token stream (token embedding std 1.0 spreads the routing), 2 threads.
Before every run the model files are evicted from the page cache. Every configuration runs once per round,
rounds interleaved (--rounds, default 3); a row is the run with the median decode speed, followed by the
decode speed of every run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from memcap import evict_from_page_cache, run_capped

from tokenwing import _core
from tokenwing.format.reader import ModelFile

HERE = os.path.dirname(os.path.abspath(__file__))


def run(cmd: list[str], cap: int | None, timeout: float, files: list[str]) -> dict[str, object]:
    for f in files:
        evict_from_page_cache(f)
    try:
        r = run_capped(cmd, cap, timeout)
    except Exception as e:
        return {"failed": f"timed out after {timeout:.0f} s ({type(e).__name__})"}
    if r.returncode != 0:
        why = "killed (out of memory?)" if r.returncode in (-9, 137) else f"exit {r.returncode}"
        return {"failed": f"{why}: {r.stderr.strip()[-200:]}"}
    out: dict[str, object] = json.loads(r.stdout.strip().splitlines()[-1])
    out["peak_cgroup_bytes"] = r.peak_bytes
    return out


def row(label: str, cap: str, r: dict[str, object], runs: str = "") -> str:
    if "failed" in r:
        return f"| {label} | {cap} | — | — | — | — | {r['failed']} | {runs} |"
    hit = r.get("hit_rate")
    wait = r.get("ssd_wait_ms_per_token")
    return (
        f"| {label} | {cap} | {r['decode_tok_s']:.2f} | {r['prompt_tok_s']:.1f} | "
        f"{float(r['read_bytes_per_token']) / 1e6:.1f} MB | "  # type: ignore[arg-type]
        f"{'—' if wait is None else f'{wait:.1f} ms'} | {'—' if hit is None else f'{hit:.0%}'} | {runs} |"
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/bench/bench-q4_k_m.gguf")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--decode", type=int, default=48)
    ap.add_argument("--timeout", type=float, default=420)
    ap.add_argument("--skip-plain", action="store_true", help="skip llama.cpp's slowest (plain mmap) runs")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; rows show the median run")
    ap.add_argument("--ram-only", action="store_true", help="only the in-RAM rows (no memory caps)")
    args = ap.parse_args()
    tw_model = args.model.removesuffix(".gguf") + ".tw.gguf"
    caps = () if args.ram_only else (0.40, 0.25)  # memory caps as shares of the model file
    size = os.path.getsize(args.model)
    with ModelFile.open(tw_model) as mf:
        vocab = len(mf.header.get("tokenizer.ggml.tokens"))
        record = mf.index.layers[0].record_size
    tokens = np.random.default_rng(0).integers(0, vocab - 16, args.prompt + args.decode)
    tok_path = os.path.join(os.path.dirname(tw_model), "bench-tokens.npy")
    np.save(tok_path, tokens)
    py = sys.executable
    llama = lambda mode: [py, os.path.join(HERE, "llama_runner.py"), args.model, tok_path, str(args.prompt), mode]  # noqa: E731
    tw = lambda la: [py, os.path.join(HERE, "tokenwing_runner.py"), tw_model, tok_path, str(args.prompt), str(la)]  # noqa: E731
    files = [args.model, tw_model]
    secs, nbytes, _ = _core.read_benchmark(tw_model, record, 8, 1 << 30, seed=1)
    bw = nbytes / secs
    print(
        f"model {args.model}: {size / 1e9:.2f} GB; drive probe (direct, whole experts, 8 threads): "
        f"{bw / 1e6:.0f} MB/s; {args.prompt} prompt + {args.decode} decode tokens, 2 threads\n"
    )
    print(
        "| engine | memory | decode tok/s | prompt tok/s | read from drive per token | SSD wait per token | hit rate "
        "| decode tok/s of each run |"
    )
    print("|---|---|---|---|---|---|---|---|")
    # Every configuration once per round, rounds interleaved; each row is the run with the median decode speed.
    configs: list[tuple[str, str, str, list[str], int | None]] = [
        ("ram-llama", "llama.cpp default", "in RAM", llama("default"), None),
        ("ram-tw", "TokenWing", "in RAM", tw(2), None),
        ("ram-tw-layers", "TokenWing, a graph per layer", "in RAM", [*tw(2), "layergraphs"], None),
    ]
    for frac in caps:
        cap = int(size * frac)
        label = f"cap {frac:.0%} ({cap / 2**30:.2f} GiB)"
        for mode in ["default", "random"] + ([] if args.skip_plain else ["plain"]):
            configs.append((f"{frac}-llama-{mode}", f"llama.cpp {mode}", label, llama(mode), cap))
        for la in (0, 1, 2, 3):
            configs.append((f"{frac}-tw-{la}", f"TokenWing lookahead {la}", label, tw(la), cap))
    runs: dict[str, list[dict[str, object]]] = {key: [] for key, *_ in configs}
    for rnd in range(args.rounds):
        for key, _, _, cmd, cap in configs:
            if rnd and key.endswith("llama-default") and cap and all("failed" in r for r in runs[key]):
                continue  # OOM-killed under this cap: once is enough
            runs[key].append(run(cmd, cap, args.timeout, files))
        print(f"(round {rnd + 1} of {args.rounds} done)", file=sys.stderr, flush=True)
    results = {key: _median(rs) for key, rs in runs.items()}
    last_cap = None
    for key, label, cap_label, _, _ in configs:
        if cap_label != last_cap:
            print()
            last_cap = cap_label
        print(row(label, cap_label, results[key], _spread(runs[key])))
    ram_tw, ram_ll = results["ram-tw"], results["ram-llama"]
    if "failed" not in ram_tw and "failed" not in ram_ll:
        ratio = float(ram_tw["decode_tok_s"]) / float(ram_ll["decode_tok_s"])  # type: ignore[arg-type]
        print(f"\nin RAM: TokenWing / llama.cpp decode = {ratio:.2f}x (medians)")
    compute_s = 1 / float(ram_tw["decode_tok_s"]) if "failed" not in ram_tw else 0.0  # type: ignore[arg-type]
    for frac in caps:
        best = results[f"{frac}-tw-2"]
        if "failed" in best:
            continue
        miss = float(best["read_bytes_per_token"])  # type: ignore[arg-type]
        limit = 1 / (miss / bw + compute_s)
        print(
            f"\ncap {frac:.0%}: drive-bound limit for TokenWing's own misses ({miss / 1e6:.1f} MB/token at "
            f"{bw / 1e6:.0f} MB/s, plus in-RAM compute) = {limit:.2f} tok/s; reached "
            f"{float(best['decode_tok_s']) / limit:.0%}"
        )  # type: ignore[arg-type]
        for mode in ("random", "plain"):
            other = results.get(f"{frac}-llama-{mode}")
            if other and "failed" not in other:
                print(
                    f"  TokenWing / llama.cpp {mode}: {float(best['decode_tok_s']) / float(other['decode_tok_s']):.1f}x"
                )  # type: ignore[arg-type]
    print("\nraw results:", json.dumps(runs, default=str))
    return 0


def _median(rs: list[dict[str, object]]) -> dict[str, object]:
    ok = sorted((r for r in rs if "failed" not in r), key=lambda r: float(r["decode_tok_s"]))  # type: ignore[arg-type]
    return ok[(len(ok) - 1) // 2] if ok else rs[0]


def _spread(rs: list[dict[str, object]]) -> str:
    speeds = [f"{float(r['decode_tok_s']):.2f}" for r in rs if "failed" not in r]  # type: ignore[arg-type]
    return " / ".join(speeds)


if __name__ == "__main__":
    raise SystemExit(main())
