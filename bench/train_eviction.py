"""The shipped learned eviction model's recipe, and its held-out table (issue 43; docs/results.md).

    python bench/train_eviction.py --train A.npz B.npz ... --heldout C.npz D.npz ... [--write]

Fits the learned policy's model (`tokenwing.streaming.learned.fit`) on the training traces, then replays every
held-out trace through history, learned and Belady at a 25 % cache (`--slots`), without prefetching and with the
engine's default prefetching (2 votes), and prints a markdown table of the reads against Belady's. Each read is one
expert's record, so the ratio of reads is the ratio of bytes. `--write` replaces the shipped model
(engine/tokenwing/streaming/eviction_default.py; `ruff format` it after). The traces:
bench/eviction_traces.sh.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tokenwing.streaming.learned import HALF_LIVES, fit
from tokenwing.streaming.trace import load_trace, parse_share, parse_slots, simulate

DEFAULT = Path(__file__).resolve().parents[1] / "engine" / "tokenwing" / "streaming" / "eviction_default.py"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", nargs="+", required=True)
    p.add_argument("--heldout", nargs="+", required=True)
    p.add_argument("--slots", default="25%")
    p.add_argument("--write", action="store_true", help="replace the shipped model with this one")
    args = p.parse_args()
    recipe = f"python bench/train_eviction.py --train {' '.join(Path(t).name for t in args.train)} --slots {args.slots}"
    model = fit([load_trace(t) for t in args.train], slots_share=parse_share(args.slots), recipe=recipe)
    print(f"weights {[round(w, 4) for w in model.weights]} (age, then half-lives {list(HALF_LIVES)})")
    if args.write:
        DEFAULT.write_text(
            '"""The shipped learned eviction model (written by bench/train_eviction.py; its recipe is in '
            '`MODEL["recipe"]`)."""\n\n'
            f"MODEL: dict[str, object] = {json.dumps(model.to_json(), indent=4)}\n",
            encoding="utf-8",
        )
        print(f"wrote {DEFAULT}")
    print("| trace | slots | history / B | learned / B | reads / B, prefetch 2 votes: history | learned |")
    print("|---|---|---|---|---|---|")
    weights = model.core_weights()
    for name in args.heldout:
        tr = load_trace(name)
        slots = parse_slots(args.slots, tr.n_expert)
        best = simulate(tr, slots, "belady")["reads"]
        t0 = time.perf_counter()
        row = [simulate(tr, slots, pol, False, 0, 2, None, weights)["reads"] / best for pol in ("history", "learned")]
        row += [simulate(tr, slots, pol, True, 0, 2, None, weights)["reads"] / best for pol in ("history", "learned")]
        elapsed = time.perf_counter() - t0
        cells = " | ".join(f"{r:.3f}" for r in row)
        print(f"| {Path(name).name} ({tr.n_tokens} tokens) | {slots} of {tr.n_expert} | {cells} |  ({elapsed:.2f} s)")


if __name__ == "__main__":
    main()
