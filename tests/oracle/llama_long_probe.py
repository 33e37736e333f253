"""Runs in a subprocess (llama.cpp's ggml must not share our process): a long prompt through each GGUF, twice.

Once as one batch, once as a prefill of part of it and then one token at a time (the decode path), so a model
whose attention keeps state across tokens (DeepSeek V4's window, compressors and indexer) runs both ways.

usage: python llama_long_probe.py REQUEST.json  → one JSON line per model; its logits in PATH.logits.npy
REQUEST: {"paths": [...], "tokens": [...], "prefill": N, "n_ctx": C}
"""

from __future__ import annotations

import json
import sys

import numpy as np


def _logits(path: str, tokens: list[int], steps: list[int], n_ctx: int) -> np.ndarray:
    import llama_cpp

    llm = llama_cpp.Llama(path, n_ctx=n_ctx, n_threads=2, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True, verbose=False)
    start = 0
    for n in steps:
        llm.eval(tokens[start : start + n])
        start += n
    return np.asarray(llm.scores[: len(tokens)], dtype=np.float64)


def probe(path: str, tokens: list[int], prefill: int, n_ctx: int) -> dict[str, object]:
    whole = _logits(path, tokens, [len(tokens)], n_ctx)
    stepped = _logits(path, tokens, [prefill] + [1] * (len(tokens) - prefill), n_ctx)
    np.save(path + ".logits.npy", whole)
    return {
        "path": path,
        "finite": bool(np.isfinite(whole).all() and np.isfinite(stepped).all()),
        "std": float(whole.std()),
        "min_position_std": float(whole.std(axis=1).min()),
        "distinct_argmax": len(set(whole.argmax(axis=1).tolist())),
        "max_diff_stepped": float(np.abs(whole - stepped).max()),
        "top1_agree_stepped": float((whole.argmax(axis=1) == stepped.argmax(axis=1)).mean()),
    }


def main() -> int:
    with open(sys.argv[1]) as f:
        req = json.load(f)
    for path in req["paths"]:
        print(json.dumps(probe(path, req["tokens"], req["prefill"], req["n_ctx"])), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
