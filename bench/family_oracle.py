"""A family's distance from llama.cpp, as its oracle tests measure it, printed as a table for docs/results.md.

    python bench/family_oracle.py tests.oracle.test_bailingmoe2

The module's VARIANTS (and KQUANT: the shape changes its Q4_K_M files take with the `kquant` preset, where it has
them) are generated as the tests generate them: F32 over 160 positions (an 80-token prompt, then decode steps),
Q8_0 and Q4_K_M at weights 0.03 over 300 (a 200-token prompt, then decode steps across position 256). Printed for
each: TokenWing's max |Δ| and mean KL from llama.cpp's logits, llama.cpp's own mean KL between its plain and default
weight layouts (its noise when only rounding changes), and the top-1 agreement where llama.cpp leads by > 0.1.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (the tests package, for its oracle helpers)

from tests.oracle.test_families import clear_top1, steps
from tests.oracle.test_logits import _repacked, _tokens, kl_per_position, llama_logits
from tokenwing.testmodel import preset_shape
from tokenwing.testmodel.writer import write_test_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("module", help="a test module with VARIANTS, e.g. tests.oracle.test_bailingmoe2")
    args = ap.parse_args()
    mod = importlib.import_module(args.module)
    kquant: dict[str, dict[str, object]] = getattr(mod, "KQUANT", {})
    tmp = Path(tempfile.mkdtemp(prefix="family-oracle-"))
    print("| variant | type | max abs diff | mean KL | llama.cpp vs itself | clear top-1 |")
    print("|---|---|---|---|---|---|")
    for variant, shape in mod.VARIANTS.items():
        for type_name in ("F32", "Q8_0", "Q4_K_M"):
            changes = {k: v for k, v in shape.items() if k != "arch"}
            preset = "tiny"
            if type_name != "F32":
                changes["weight_std"] = 0.03
            if type_name == "Q4_K_M":
                preset, changes = "kquant", {**changes, **kquant.get(variant, {})}
            s = preset_shape(preset, str(shape["arch"])).with_(**changes)
            src = Path(write_test_model(str(tmp / f"{variant}-{type_name}.gguf"), s, type_name, 0, 1)[0])
            n, prompt, seed = (160, 80, 11) if type_name == "F32" else (300, 200, 12)
            tokens = _tokens(n, 512, seed=seed)
            ref = llama_logits(src, tokens, tmp)
            own = llama_logits(src, tokens, tmp, plain=True)
            got, _ = steps(_repacked(src, tmp), tokens, prompt)
            print(
                f"| {variant} | {type_name} | {np.abs(ref - got).max():.2g} | {kl_per_position(ref, got).mean():.2g} "
                f"| {kl_per_position(ref, own).mean():.2g} | {clear_top1(ref, got):.0%} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
