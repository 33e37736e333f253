"""A quantized family case's distance from llama.cpp per position, beside llama.cpp's own when only its batch
changes (all 300 tokens in one pass against one token a pass): where a mean KL above llama.cpp's plain-vs-default
noise comes from a few positions whose near-tie rounding flips, llama.cpp's one-token run flips them the same way.

    python bench/oracle_batch_noise.py tests.oracle.test_step35 factory Q4_K_M

The file is generated as bench/family_oracle.py generates it (weights 0.03, the `kquant` preset for K-quants) and
run as tests/oracle/test_families.quantized_matches_llama_cpp runs it (a 200-token prompt, then decode steps).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (the tests package, for its oracle helpers)

from tests.oracle.test_families import steps
from tests.oracle.test_logits import _repacked, _tokens, kl_per_position, llama_logits
from tokenwing.testmodel import preset_shape
from tokenwing.testmodel.writer import write_test_model


def _line(name: str, kl: np.ndarray, top: np.ndarray) -> str:
    at = ", ".join(f"{int(p)}: {kl[p]:.2g}" for p in top)
    return f"{name}: mean KL {kl.mean():.2g} (prompt {kl[:200].mean():.2g}, decode {kl[200:].mean():.2g}), at {at}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("module", help="a test module with VARIANTS, e.g. tests.oracle.test_step35")
    ap.add_argument("variant")
    ap.add_argument("type", nargs="?", default="Q4_K_M")
    args = ap.parse_args()
    mod = importlib.import_module(args.module)
    shape = mod.VARIANTS[args.variant]
    changes = {k: v for k, v in shape.items() if k != "arch"} | {"weight_std": 0.03}
    preset = "tiny"
    if args.type.startswith("Q4_K"):
        preset, changes = "kquant", {**changes, **getattr(mod, "KQUANT", {}).get(args.variant, {})}
    tmp = Path(tempfile.mkdtemp(prefix="batch-noise-"))
    s = preset_shape(preset, str(shape["arch"])).with_(**changes)
    src = Path(write_test_model(str(tmp / f"{args.variant}-{args.type}.gguf"), s, args.type, 0, 1)[0])
    tokens = _tokens(300, 512, seed=12)
    ref = llama_logits(src, tokens, tmp)
    plain = llama_logits(src, tokens, tmp, plain=True)
    one = llama_logits(src, tokens, tmp, n_batch=1)
    got, _ = steps(_repacked(src, tmp), tokens, 200)
    ours = kl_per_position(ref, got)
    top = np.argsort(ours)[::-1][:4]  # ours' worst positions, read in every line
    print("KL from llama.cpp (one 300-token pass, default layout); at: the positions TokenWing is furthest at")
    print(_line("TokenWing", ours, top))
    rest = np.ones(len(ours), bool)
    rest[top[ours[top] > 10 * np.median(ours)]] = False
    print(f"TokenWing without its outliers (KL > 10x its median): mean KL {ours[rest].mean():.2g}")
    print(_line("llama.cpp, plain layout", kl_per_position(ref, plain), top))
    print(_line("llama.cpp, one token a pass", kl_per_position(ref, one), top))
    print(_line("TokenWing from llama.cpp one token a pass", kl_per_position(one, got), top))


if __name__ == "__main__":
    main()
