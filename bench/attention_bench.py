"""A prompt chunk's attention: F32 tiled flash attention (what prompts use) against the two matrix products (what
they used, and what decode uses), on the bench model's attention shape.

    python bench/attention_bench.py [--keys 512,2048,4096] [--queries 64] [--reps 5] [--threads 2] [--only flash]

Prints CPU milliseconds per call (process time, so other load on the machine counts less than in wall time),
medians of interleaved repetitions. For instruction counts, which do not depend on load at all, run one variant
under callgrind and subtract a run that builds the graph but computes nothing:
    valgrind --tool=callgrind --callgrind-out-file=/dev/null python bench/attention_bench.py --only flash --reps 1 \\
        --threads 1 --keys 2048   (and --only products, --only none)
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from tokenwing.compute.ggml_lib import F16, Graph, TensorArena, aligned_bytes
from tokenwing.models import common

N_HEAD, N_HEAD_KV, HEAD_DIM = 32, 4, 128  # the bench preset's attention


def run(kind: str, n_kv: int, n: int, threads: int, reps: int) -> list[float]:
    """CPU seconds of `reps` computes of one chunk's attention (`kind`: flash, products, or none: build only)."""
    width = N_HEAD_KV * HEAD_DIM
    n_ctx = n_kv
    rng = np.random.default_rng(0)
    k_mem = aligned_bytes(width * n_ctx * 2)
    v_mem = aligned_bytes(width * n_ctx * 2)
    k_mem.view(np.float16)[:] = rng.standard_normal(width * n_ctx).astype(np.float16)
    v_mem.view(np.float16)[:] = rng.standard_normal(width * n_ctx).astype(np.float16)
    arena = TensorArena(4)
    kv = common.KVCache(arena.wrap(k_mem, F16, (width, n_ctx)), arena.wrap(v_mem, F16, (n_ctx, width)), 2, width)
    g = Graph(1 << 30, threads)
    out: list[float] = []
    try:
        for _ in range(reps):
            ctx = g.reset()
            at = common.placement(g, n_kv - n, n, n_kv, n_ctx, width, 0, flash=kind == "flash")
            q = g.input(rng.standard_normal((n, N_HEAD, HEAD_DIM)).astype(np.float32))
            k = g.input(rng.standard_normal((n, N_HEAD_KV, HEAD_DIM)).astype(np.float32))
            v = g.input(rng.standard_normal((n, width)).astype(np.float32))
            cur, writes = common.attend(ctx, q, k, v, at, kv, 1 / HEAD_DIM**0.5)
            t = time.process_time()
            if kind != "none":
                g.compute(*writes, cur)
            out.append(time.process_time() - t)
    finally:
        g.close()
        arena.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", default="512,2048,4096")
    ap.add_argument("--queries", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", choices=["flash", "products", "none"])
    args = ap.parse_args()
    kinds = [args.only] if args.only else ["products", "flash"]
    print(
        "| keys | queries | "
        + " | ".join(f"{k} CPU ms" for k in kinds)
        + (" | products ÷ flash |" if not args.only else " |")
    )
    print("|---|---|" + "---|" * len(kinds) + ("---|" if not args.only else ""))
    for n_kv in (int(x) for x in args.keys.split(",")):
        times: dict[str, list[float]] = {k: [] for k in kinds}
        for _ in range(args.reps):  # interleaved
            for k in kinds:
                times[k] += run(k, n_kv, args.queries, args.threads, 1)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        ratio = f" {med['products'] / med['flash']:.2f} |" if not args.only else ""
        print(f"| {n_kv} | {args.queries} | " + " | ".join(f"{med[k]:.2f}" for k in kinds) + " |" + ratio)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
