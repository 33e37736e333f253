"""Held-out loss of the demo model by position past its 512 training positions, with and without RoPE scaling.

    python resources/demo-model/eval_context.py [--windows 16] [--length 2048] [--variants none,yarn2,yarn4,...]
        [--out build/demo-model/context-eval.json]

Needs `build.py corpus` and `build.py tokenizer`: the held-out stream is `build.py`'s (documents joined with
<|endoftext|>, checked against the model's own tokenizer in TokenWing); `--windows` windows of `--length` tokens
are taken at evenly spaced starts. Each variant is the shipped file with other
context keys (`export.py`'s `context_kv`, written by `gguf_io.rewrite_metadata`: tensors byte-identical), run by
TokenWing (F32 KV cache) over each window from position 0. The loss (nats/token) is averaged per bucket of
positions. (TokenWing against llama.cpp past position 512: tests/demomodel/test_demo_model.py.)

Variants: `none` (the 512-context file as is, run past 512), `yarnF` / `linearF` (factor F from 512 positions).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import recipe  # noqa: E402  (the recipe's paths, special tokens and documents)
from export import context_kv  # noqa: E402
from train import tokens  # noqa: E402

BUCKETS = [(0, 512), (512, 1024), (1024, 2048)]


def variant_kv(kv: dict[str, Any], name: str) -> dict[str, Any]:
    if name == "none":
        return context_kv(kv, "none", 1.0)
    for kind in ("yarn", "linear"):
        if name.startswith(kind):
            return context_kv(kv, kind, float(name[len(kind) :]))
    raise SystemExit(f"unknown variant {name!r} (none, yarnF, linearF)")


def heldout_stream(model: Path) -> np.ndarray:
    """build.py's held-out stream (its `tokenizers` BPE, which is the GGUF's vocabulary and merges), checked
    against the model's own tokenizer in TokenWing on the first documents."""
    from tokenwing.runtime.session import Session, SessionOptions

    stream = tokens("heldout").astype(np.int64)
    s = Session(str(model), SessionOptions(kv_type="f32", n_ctx=512), log=lambda line: None)
    try:
        eot = s.tokenizer.encode(recipe.ENDOFTEXT, special=True)
        ids: list[int] = []
        for doc in recipe.read_docs("heldout.jsonl")[:4]:
            ids += s.tokenizer.encode(doc, special=True) + eot
    finally:
        s.close()
    if stream[: len(ids)].tolist() != ids:
        raise SystemExit("the held-out stream's tokens differ from the model's tokenizer (run build.py tokenizer)")
    return stream


def nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=1, keepdims=True)
    logz = np.log(np.exp(x).sum(axis=1))
    return logz - x[np.arange(len(targets)), targets]


def buckets(per_pos: np.ndarray) -> list[float]:
    """Mean over windows and over each bucket's positions (per_pos: [window, position])."""
    return [float(per_pos[:, a:b].mean()) for a, b in BUCKETS if b <= per_pos.shape[1]]


def tokenwing_logits(model: Path, windows: np.ndarray) -> list[np.ndarray]:
    from tokenwing.runtime.session import Session, SessionOptions

    s = Session(str(model), SessionOptions(kv_type="f32", n_ctx=windows.shape[1] + 8), log=lambda line: None)
    try:
        out = []
        for w in windows:
            s.reset()
            out.append(s.forward(w[:-1].tolist(), all_logits=True))
        return out
    finally:
        s.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(recipe.OUTPUT))
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--variants", default="none,yarn2,yarn4,linear2,linear4")
    p.add_argument("--out", default=str(recipe.WORK / "context-eval.json"))
    args = p.parse_args()
    from tokenwing.format.gguf_io import read_header, rewrite_metadata
    from tokenwing.format.repack import repack

    src = Path(args.model)
    base_kv = read_header(str(src)).kv
    with tempfile.TemporaryDirectory(prefix="demo-ctx-") as d:
        tmp = Path(d)
        n = args.length
        results: dict[str, Any] = {"length": n}
        table: dict[str, Any] = {}
        windows = np.zeros((0, n + 1), dtype=np.int64)
        for name in args.variants.split(","):
            gguf = tmp / f"demo-{name}.gguf"
            rewrite_metadata(str(src), str(gguf), variant_kv(base_kv, name))
            tw = tmp / f"demo-{name}.tw.gguf"
            repack([str(gguf)], str(tw), show_progress=False)
            if not len(windows):
                stream = heldout_stream(tw)
                starts = np.linspace(0, len(stream) - n - 2, args.windows).astype(np.int64)
                windows = np.stack([stream[s : s + n + 1] for s in starts])  # n inputs + the last target
                print(f"held-out stream {len(stream)} tokens; {len(windows)} windows of {n} at {starts.tolist()}")
                results["buckets"] = [f"{a}-{b - 1}" for a, b in BUCKETS if b <= n]
                results.update(stream_tokens=len(stream), starts=starts.tolist())
            t0 = time.monotonic()
            logits = tokenwing_logits(tw, windows)
            loss = np.stack([nll(lg, w[1:]) for lg, w in zip(logits, windows, strict=True)])
            table[name] = buckets(loss)
            print(f"{name:>9}: " + "  ".join(f"{v:.4f}" for v in table[name]) + f"  ({time.monotonic() - t0:.0f} s)")
            results["loss"] = table
            Path(args.out).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")  # so far
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
