"""TokenWing against llama.cpp and against the physical limits, in RAM and under the same cgroup memory caps.

    python bench/engine_bench.py [--model models/bench/bench-q4_k_m.gguf] [--decode 48] [--prompt 32] [--rounds 3]
                                 [--ram-only] [--caps 0.40,0.25] [--lookaheads 0,1,2,3] [--skip-plain] [--quick]

The model is the `bench` preset in Q4_K_M (12 layers, n_embd 2048, 128 experts of 768, top-8; make it with
`tokenwing testmodel models/bench/bench-q4_k_m.gguf --preset bench --type Q4_K_M` and repack it). Both engines
evaluate the same fixed pseudo-random token stream (token embedding std 1.0 spreads the routing),
2 threads (`--threads`).
Before every run the model files are evicted from the page cache. Every configuration runs once per round,
rounds interleaved (--rounds, default 3); a row is the run with the median decode speed, followed by the
decode speed of every run.

Beside every result, its limit (bench/limits.py): in RAM, the bytes a token touches ÷ RAM read bandwidth at the
same thread count; under a cap, min(drive ceiling ÷ Belady's bytes per token on the run's own decode trace from
its own warm cache, 1 ÷ the compute floor), the compute floor being the same decode path with every expert in
RAM. The drive ceiling is the best of a deep-queue probe (io_uring and threads, 512 KiB–4 MiB), fio, and every
rate a reader reached in this run — the engine's included.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from limits import MB, belady, capped_limit, memory_bandwidth, probe_drive
from memcap import evict_from_page_cache, run_capped

from tokenwing.format.reader import ModelFile
from tokenwing.streaming.trace import load_trace

HERE = os.path.dirname(os.path.abspath(__file__))
Result = dict[str, object]


def run(cmd: list[str], cap: int | None, timeout: float, files: list[str]) -> Result:
    for f in files:
        evict_from_page_cache(f)
    try:
        r = run_capped(cmd, cap, timeout)
    except Exception as e:
        return {"failed": f"timed out after {timeout:.0f} s ({type(e).__name__})"}
    if r.returncode != 0:
        why = "killed (out of memory?)" if r.returncode in (-9, 137) else f"exit {r.returncode}"
        return {"failed": f"{why}: {r.stderr.strip()[-200:]}"}
    out: Result = json.loads(r.stdout.strip().splitlines()[-1])
    out["peak_cgroup_bytes"] = r.peak_bytes
    return out


def f(r: Result, key: str) -> float:
    return float(r[key])  # type: ignore[arg-type]


def row(label: str, cap: str, r: Result, runs: str, limit: float | None, belady_mb: float | None) -> str:
    if "failed" in r:
        return f"| {label} | {cap} | — | — | — | — | — | — | — | — | {r['failed']} |"
    hit = r.get("hit_rate")
    wait = r.get("ssd_wait_ms_per_token")
    lim = "—" if limit is None else f"{limit:.2f}"
    share = "—" if limit is None else f"{f(r, 'decode_tok_s') / limit:.0%}"
    bel = "—" if belady_mb is None else f"{belady_mb:.1f} MB"
    return (
        f"| {label} | {cap} | {f(r, 'decode_tok_s'):.2f} | {lim} | {share} | {f(r, 'prompt_tok_s'):.1f} | "
        f"{f(r, 'read_bytes_per_token') / MB:.1f} MB | {bel} | "
        f"{'—' if wait is None else f'{float(wait):.1f} ms'} | {'—' if hit is None else f'{float(hit):.0%}'} | "  # type: ignore[arg-type]
        f"{runs} |"
    )


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="tw-bench-", ignore_cleanup_errors=True) as work:  # streams, traces
        return _main(work)


def _main(work: str) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/bench/bench-q4_k_m.gguf")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--decode", type=int, default=48)
    ap.add_argument("--timeout", type=float, default=420)
    ap.add_argument("--skip-plain", action="store_true", help="skip llama.cpp's slowest (plain mmap) runs")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; rows show the median run")
    ap.add_argument("--ram-only", action="store_true", help="only the in-RAM rows (no memory caps)")
    ap.add_argument("--caps", default="0.40,0.25", help="memory caps as shares of the model file")
    ap.add_argument(
        "--budget-caps",
        action="store_true",
        help="no cgroup: a --ram-budget of that share of the experts instead (models too small for a cgroup cap, "
        "such as the demo model; llama.cpp then only runs in RAM)",
    )
    ap.add_argument("--lookaheads", default="0,1,2,3", help="lookahead distances to run under the caps")
    ap.add_argument("--tw-extra", default="", help="more runner options for every TokenWing run (io_engine=…)")
    ap.add_argument("--no-llama", action="store_true", help="TokenWing and the limits only")
    ap.add_argument("--quick", action="store_true", help="a short drive probe (a dry run of the benchmark)")
    ap.add_argument(
        "--threads",
        type=int,
        default=2,
        help="compute threads of both engines (1 on a busy machine: ggml's barriers spin while a core is taken, "
        "which swung q4x-bench's in-RAM decode from 0.6 to 34 tok/s between runs on 2 threads, 14-20 on 1)",
    )
    args = ap.parse_args()
    os.environ["BENCH_THREADS"] = str(args.threads)  # (read by both runners)
    tw_model = args.model.removesuffix(".gguf") + ".tw.gguf"
    caps = () if args.ram_only else tuple(float(x) for x in args.caps.split(",") if x)
    lookaheads = [int(x) for x in args.lookaheads.split(",") if x]
    size = os.path.getsize(args.model)
    with ModelFile.open(tw_model) as mf:
        vocab = len(mf.header.get("tokenizer.ggml.tokens"))
    tokens = np.random.default_rng(0).integers(0, vocab - 16, args.prompt + args.decode)
    tok_path = os.path.join(work, "bench-tokens.npy")
    np.save(tok_path, tokens)
    py = sys.executable
    extra = args.tw_extra.split()
    llama = lambda mode: [py, os.path.join(HERE, "llama_runner.py"), args.model, tok_path, str(args.prompt), mode]  # noqa: E731
    tw = lambda la, *more: [  # noqa: E731
        py,
        os.path.join(HERE, "tokenwing_runner.py"),
        tw_model,
        tok_path,
        str(args.prompt),
        str(la),
        *extra,
        *more,
    ]
    files = [args.model, tw_model]

    print(
        f"model {args.model}: {size / 1e9:.2f} GB; {args.prompt} prompt + {args.decode} decode tokens, "
        f"{args.threads} threads\n"
    )
    ceiling = probe_drive(tw_model, budget=(256 if args.quick else 1024) << 20, quick=args.quick)
    ram_bw = memory_bandwidth(args.threads)
    print("drive probe (direct random reads over the model file, MB/s):")
    for label, v in sorted(ceiling.rates.items(), key=lambda kv: -kv[1]):
        print(f"  {label}: {v:.0f}")
    print(f"RAM read bandwidth, {args.threads} threads (STREAM-style): {ram_bw / 1e9:.1f} GB/s\n")

    # Every configuration once per round, rounds interleaved; each row is the run with the median decode speed.
    configs: list[tuple[str, str, str, list[str], int | None]] = []
    if not args.no_llama:
        configs.append(("ram-llama", "llama.cpp default", "in RAM", llama("default"), None))
    configs += [
        ("ram-tw", "TokenWing", "in RAM", tw(2), None),
        ("ram-tw-layers", "TokenWing, a graph per layer", "in RAM", tw(2, "layergraphs"), None),
    ]
    if caps:  # the compute floor of the capped path: the same path (layer graphs, streamed experts' kernels)
        for la in sorted({0, *lookaheads}):
            floor = tw(la, "layergraphs", "plainexperts", "budget=100%")
            configs.append(
                (f"floor-{la}", f"TokenWing capped path, every expert in RAM, lookahead {la}", "in RAM", floor, None)
            )
    for frac in caps:
        if args.budget_caps:
            label = f"budget {frac:.0%} of the experts"
            for la in lookaheads:
                configs.append((f"{frac}-tw-{la}", f"TokenWing lookahead {la}", label, tw(la, f"budget={frac:.0%}"), 0))
            continue
        cap = int(size * frac)
        label = f"cap {frac:.0%} ({cap / 2**30:.2f} GiB)"
        if not args.no_llama:
            for mode in ["default", "random"] + ([] if args.skip_plain else ["plain"]):
                configs.append((f"{frac}-llama-{mode}", f"llama.cpp {mode}", label, llama(mode), cap))
        for la in lookaheads:
            configs.append((f"{frac}-tw-{la}", f"TokenWing lookahead {la}", label, tw(la), cap))
    runs: dict[str, list[Result]] = {key: [] for key, *_ in configs}
    for rnd in range(args.rounds):
        for key, _, _, cmd, cap in configs:
            if rnd and key.endswith("llama-default") and cap and all("failed" in r for r in runs[key]):
                continue  # OOM-killed under this cap: once is enough
            capped = cap is not None  # (0: a RAM budget instead of a cgroup cap)
            if "-tw-" in key and capped:
                cmd = [*cmd, f"trace={os.path.join(work, f'{key}-{rnd}.npz')}"]
            r = run(cmd, cap or None, args.timeout, files)
            if "-tw-" in key and capped and "failed" not in r:
                _add_belady(r, os.path.join(work, f"{key}-{rnd}.npz"))
            for rate_key, label in (("expert_mb_per_s", "TokenWing's own reads"),):
                if "failed" not in r and rate_key in r:
                    ceiling.add(f"{label} (decode average)", f(r, rate_key))
            dev = r.get("device") if "failed" not in r else None
            if isinstance(dev, dict):
                ceiling.add("device during a TokenWing decode (average)", float(dev["mb_per_s"]))
            runs[key].append(r)
        print(f"(round {rnd + 1} of {args.rounds} done)", file=sys.stderr, flush=True)
    results = {key: _median(rs) for key, rs in runs.items()}

    ceil = ceiling.mb_per_s
    print(f"drive ceiling: {ceil:.0f} MB/s ({ceiling.best}); fio's best {ceiling.fio_best():.0f} MB/s\n")
    print(
        "| engine | memory | decode tok/s | limit tok/s | of the limit | prompt tok/s | read per token "
        "| Belady per token | SSD wait per token | hit rate | decode tok/s of each run |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    last_cap = None
    floors: dict[int, float] = {}
    for key, res in results.items():
        if key.startswith("floor-") and "failed" not in res:
            floors[int(key.split("-")[1])] = 1 / f(res, "decode_tok_s")
    limits: dict[str, float] = {}
    for key, label, cap_label, _, _ in configs:
        r = results[key]
        limit = bel_mb = None
        if "failed" not in r and key.startswith("ram-tw"):
            touched = _touched(r)
            limit = ram_bw / touched
        elif "failed" not in r and "-tw-" in key:
            la = int(key.rsplit("-", 1)[1])
            bel_mb = f(r, "belady_bytes_per_token") / MB
            lim = capped_limit(ceil, f(r, "belady_bytes_per_token"), floors.get(la, 0.0))
            limit = lim["limit_tok_s"]
        if limit is not None:
            limits[key] = limit
        if cap_label != last_cap:
            last_cap = cap_label
        print(row(label, cap_label, r, _spread(runs[key]), limit, bel_mb))

    print()
    ram_tw = results.get("ram-tw", {"failed": "not run"})
    ram_ll = results.get("ram-llama", {"failed": "not run"})
    if "failed" not in ram_tw:
        touched = _touched(ram_tw)
        print(
            f"in RAM: a token touches {touched / MB:.1f} MB (experts, resident weights, KV): memory-bandwidth "
            f"limit {ram_bw / touched:.1f} tok/s at {ram_bw / 1e9:.1f} GB/s; TokenWing reached "
            f"{f(ram_tw, 'decode_tok_s') / (ram_bw / touched):.0%}"
        )
    if "failed" not in ram_tw and "failed" not in ram_ll:
        print(f"in RAM: TokenWing / llama.cpp decode = {f(ram_tw, 'decode_tok_s') / f(ram_ll, 'decode_tok_s'):.2f}x")
    for la, secs in sorted(floors.items()):
        print(f"compute floor, lookahead {la}: {secs * 1e3:.1f} ms per token ({1 / secs:.1f} tok/s)")
    for frac in caps:
        print(f"\n{'budget' if args.budget_caps else 'cap'} {frac:.0%}:")
        for la in lookaheads:
            best = results.get(f"{frac}-tw-{la}", {"failed": ""})
            if "failed" in best:
                continue
            lim = capped_limit(ceil, f(best, "belady_bytes_per_token"), floors.get(la, 0.0))
            speed = f(best, "decode_tok_s")
            print(
                f"  lookahead {la}: {speed:.2f} tok/s = {speed / lim['limit_tok_s']:.0%} of the capped limit"
                f" {lim['limit_tok_s']:.2f} (drive {lim['drive_tok_s']:.2f}: {ceil:.0f} MB/s ÷ "
                f"{f(best, 'belady_bytes_per_token') / MB:.1f} MB Belady; compute {lim['compute_tok_s']:.2f}); read "
                f"{f(best, 'expert_bytes_per_token') / f(best, 'belady_bytes_per_token'):.2f}× Belady's bytes"
            )
            _bounds(best)
        base, la2 = results.get(f"{frac}-tw-0"), results.get(f"{frac}-tw-2")
        if base and la2 and "failed" not in base and "failed" not in la2:
            print(f"  lookahead 2 / lookahead 0: {f(la2, 'decode_tok_s') / f(base, 'decode_tok_s'):.2f}x (medians)")
        best = results.get(f"{frac}-tw-2")
        for mode in ("random", "plain"):
            other = results.get(f"{frac}-llama-{mode}")
            if best and other and "failed" not in other and "failed" not in best:
                print(f"  TokenWing / llama.cpp {mode}: {f(best, 'decode_tok_s') / f(other, 'decode_tok_s'):.1f}x")
    print("\nraw results:", json.dumps(runs, default=str))
    return 0


def _add_belady(r: Result, trace_path: str) -> None:
    """Belady's bytes per token on the run's own decode trace, at its slots, from the cache it decoded from."""
    trace = load_trace(trace_path)
    warm = np.load(trace_path + ".warm.npy")
    b = belady(trace, int(r["slots_per_layer"]), list(r["record_sizes"]), warm)  # type: ignore[call-overload,arg-type]
    r["belady_bytes_per_token"] = b["bytes_per_token"]
    r["belady_misses"] = b["misses"]


def _touched(r: Result) -> float:
    return f(r, "touched_bytes_per_token")


def _bounds(r: Result) -> None:
    """What bounds a capped run: the drive's idle share, demand waits, CPU in I/O threads and elsewhere."""
    dev = r.get("device")
    busy = f"{float(dev['busy_share']):.0%}" if isinstance(dev, dict) else "—"
    waits = r.get("demand_wait_ms_per_layer") or []
    cpu = r.get("cpu_ms_per_token") or {}
    top = ", ".join(f"{k} {v:.1f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])[:4])  # type: ignore[union-attr]
    print(
        f"    drive busy {busy} of the decode; SSD wait {f(r, 'ssd_wait_ms_per_token'):.1f} ms/token "
        f"(per layer: {' '.join(f'{w:.1f}' for w in waits)}); CPU ms/token: {top}; "  # type: ignore[union-attr]
        f"I/O threads {f(r, 'io_cpu_ms_per_token'):.2f} ms/token"
    )


def _median(rs: list[Result]) -> Result:
    ok = sorted((r for r in rs if "failed" not in r), key=lambda r: f(r, "decode_tok_s"))
    return ok[(len(ok) - 1) // 2] if ok else (rs[0] if rs else {"failed": "not run"})


def _spread(rs: list[Result]) -> str:
    return " / ".join(f"{f(r, 'decode_tok_s'):.2f}" for r in rs if "failed" not in r)


if __name__ == "__main__":
    raise SystemExit(main())
