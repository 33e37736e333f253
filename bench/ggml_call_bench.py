"""What a call into ggml costs through the engine's bindings (compute/ggml_api.py, ctypes), how many calls a decode
token and a prompt make, and what a native module's call costs instead: the measure behind the bindings' choice.

    python bench/ggml_call_bench.py [--model resources/demo-model/tokenwing-demo-moe.gguf] [--tokens 128]

Per-call costs are the median of 7 runs of 20,000 calls each. The native call is one of the streaming core's
nanobind functions with no work in it (`ggml_log_filter`, which returns an address): a floor for any native
binding, whatever it wraps. The call counts wrap every declared ggml function with a counter while the engine
decodes the demo model in RAM, one token at a time (its whole decode step is one graph built once, computed per
token), and while it reads a 512-token prompt.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tokenwing import _core
from tokenwing.compute import ggml_api as ggml
from tokenwing.compute.ggml_lib import Graph

ROOT = Path(__file__).resolve().parents[1]


def per_call_ns(fn: Callable[[], Any], n: int = 20_000, runs: int = 7) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter_ns()
        for _ in range(n):
            fn()
        times.append((time.perf_counter_ns() - start) / n)
    return statistics.median(times)


def call_costs() -> dict[str, float]:
    g = Graph(64 << 20, 1)
    ctx = g.reset()
    a = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, 64, 4)
    b = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, 64, 4)
    made = 0

    def add() -> None:
        nonlocal made, ctx, a, b
        made += 1
        if made % 10_000 == 0:  # (the context's memory holds some 100k tensors: start over now and then)
            ctx = g.reset()
            a = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, 64, 4)
            b = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, 64, 4)
        ggml.ggml_add(ctx, a, b)

    def view() -> None:
        nonlocal made, ctx, a
        made += 1
        if made % 10_000 == 0:
            ctx = g.reset()
            a = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, 64, 4)
        ggml.ggml_view_4d(ctx, a, 64, 2, 1, 1, 256, 512, 512, 0)

    out = {
        "ctypes: ggml_nbytes(t) (1 argument)": per_call_ns(lambda: ggml.ggml_nbytes(a)),
        "ctypes: ggml_add(ctx, a, b) (a new tensor)": per_call_ns(add),
        "ctypes: ggml_view_4d (10 arguments)": per_call_ns(view),
        "nanobind: a native function, no arguments": per_call_ns(_core.ggml_log_filter),
        "Python: a function call, no arguments": per_call_ns(lambda: None),
    }
    g.close()
    return out


def counted_calls(model: Path, n_tokens: int, prompt_tokens: int) -> tuple[float, float, float, Counter[str]]:
    """(calls per decode token, decode ms per token, calls per prompt token, calls by function during decode)."""
    from tokenwing.runtime.session import Session, SessionOptions

    counts: Counter[str] = Counter()
    originals = {name: getattr(ggml, name) for name in ggml.DECLARED}

    def counting(name: str, fn: Any) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            counts[name] += 1
            return fn(*args)

        return call

    s = Session(str(model), SessionOptions(n_ctx=1024), log=lambda line: None)
    try:
        rng = np.random.default_rng(0)
        s.forward(rng.integers(0, s.hp.vocab_size, 8).tolist())  # warm up: the decode graph is built
        for name, fn in originals.items():
            setattr(ggml, name, counting(name, fn))
        try:
            start = time.perf_counter()
            for t in rng.integers(0, s.hp.vocab_size, n_tokens).tolist():
                s.forward([t])
            ms = (time.perf_counter() - start) * 1e3 / n_tokens
            decode = Counter(counts)
            counts.clear()
            s.reset()
            s.forward(rng.integers(0, s.hp.vocab_size, prompt_tokens).tolist())
            prompt = sum(counts.values()) / prompt_tokens
        finally:
            for name, fn in originals.items():
                setattr(ggml, name, fn)
    finally:
        s.close()
    return sum(decode.values()) / n_tokens, ms, prompt, decode


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "resources" / "demo-model" / "tokenwing-demo-moe.gguf"))
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt", type=int, default=512)
    a = p.parse_args()
    print(f"ggml {ggml.build_info()['ggml']}, CPU backend {ggml.CPU_VARIANT}\n")
    costs = call_costs()
    print("| call | ns |\n|---|---:|")
    for name, ns in costs.items():
        print(f"| {name} | {ns:.0f} |")
    model = Path(a.model)
    if model.suffix == ".gguf" and not model.name.endswith(".tw.gguf"):
        import subprocess
        import sys
        import tempfile

        tmp = Path(tempfile.mkdtemp())
        repacked = tmp / "model.tw.gguf"
        subprocess.run([sys.executable, "-m", "tokenwing", "repack", str(model), "-o", str(repacked)], check=True)
        model = repacked
    per_token, ms, per_prompt_token, by_fn = counted_calls(model, a.tokens, a.prompt)
    native = costs["nanobind: a native function, no arguments"]
    ctypes_ns = costs["ctypes: ggml_add(ctx, a, b) (a new tensor)"]
    print(f"\ndecode: {per_token:.1f} ggml calls per token ({ms:.2f} ms a token, in RAM)")
    print("  " + ", ".join(f"{n} {c / a.tokens:.1f}" for n, c in by_fn.most_common(8)))
    print(f"prompt: {per_prompt_token:.1f} ggml calls per prompt token ({a.prompt} tokens)")
    saved_us = per_token * (ctypes_ns - native) / 1e3
    print(
        f"a native binding would save at most {saved_us:.1f} µs of a {ms * 1e3:.0f} µs token "
        f"({saved_us / (ms * 10):.2f} %)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
