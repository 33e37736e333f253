"""Runs in a subprocess (llama.cpp's ggml must not share our process): loads GGUFs, reports what it sees.

usage: python llama_probe.py REQUEST.json  → prints one JSON line per model
"""

from __future__ import annotations

import json
import sys

import numpy as np


def probe(path: str, texts: list[str]) -> dict[str, object]:
    import llama_cpp

    llm = llama_cpp.Llama(path, n_ctx=128, n_threads=2, n_batch=64, logits_all=True, verbose=False)
    tokens = [llm.tokenize(t.encode(), add_bos=False, special=False) for t in texts]
    tokens_special = [llm.tokenize(t.encode(), add_bos=False, special=True) for t in texts]
    detok = [llm.detokenize(t).decode("utf-8", errors="replace") for t in tokens]
    prompt = tokens[0][:16] or [1]
    llm.eval(prompt)
    logits = np.asarray(llm.scores[: len(prompt)], dtype=np.float64)
    return {
        "path": path,
        "n_vocab": llm.n_vocab(),
        "tokens": tokens,
        "tokens_special": tokens_special,
        "detokenized": detok,
        "logits_finite": bool(np.isfinite(logits).all()),
        "logits_std": float(logits.std()),
    }


def main() -> int:
    with open(sys.argv[1]) as f:
        request = json.load(f)
    for path in request["paths"]:
        print(json.dumps(probe(path, request["texts"])), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
